"""The batch script's own steps around srun: `python -m launcher.slurm.driver prologue|epilogue RUN_DIR`.

prologue (before srun): checks that the run directory's lock names this job (training/contract/rundir/lock.py; else the
  attempt stops before srun) and that the run was not cancelled (launcher/records/readers.py cancel_requested: then
  `cancelled`, no srun), numbers the attempt, records `started` with the nodes and the code it runs (the
  submission's snapshot, launcher/slurm/snapshot.py), prints the rendezvous exports (MASTER_ADDR = first node,
  MASTER_PORT from the job id) for the batch script.
epilogue (after srun): reads every rank's record and acts (launcher/slurm/requeue.py decides):
  completed -> `completed`; cancelled (meshrun action=cancel) -> `cancelled`, never a requeue; all ranks stopped
  early -> `requeued`, `scontrol requeue` (same job; a stop without a new checkpoint, or a failed save, costs one of
  cluster.max_retries);
  a failure -> `failed` (node, rank, exit code), then a new job excluding the failing node, up to
  cluster.max_retries -> then `stopped`; EXIT_INVALID or the same error on every rank at step 0 -> `stopped`.
The epilogue's own status is EXIT_OK only when the run completed or was cancelled as asked (a recorded
`cancelled`: Slurm's accounting then agrees that nothing failed) (training/contract/exit_codes.py); when the run ends
(completed, stopped) it releases the run directory's lock, and a resubmission hands the lock to the new job.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from launcher.ranks.exits import Failure
from launcher.ranks.processes import PROJECT_ROOT
from launcher.records.goodput import write_goodput_quietly
from launcher.records.readers import cancel_requested, excluded_nodes, last_step, record_cancelled, retries_used
from launcher.slurm import in_job
from launcher.slurm.queries import job_alive
from launcher.slurm.requeue import Decision, blamed_failures, decide
from training.checkpoint.storage import planned_resume_step
from training.contract.config import load_config
from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_OK, EXIT_RESTART_IN_JOB
from training.contract.layout_text import format_layout, layout_of
from training.contract.rundir.events import append_event, read_events
from training.contract.rundir.lock import claim_for_job, release_job, set_job_holder
from training.contract.rundir.paths import RunPaths
from training.contract.slurm_env import (
    PREFLIGHT_PASSED_ENV,
    SlurmUnavailable,
    hostnames,
    port_from_job,
    slurm_command,
    slurm_job_id,
)

REQUEUE_WAIT_S = 120


def job_id() -> str:
    """This job's id for Slurm commands and events ("<array>_<task>" in a sweep's job array)."""
    return slurm_job_id() or "0"


def prologue(run_dir: str) -> int:
    events = read_events(run_dir)
    attempt = sum(1 for ev in events if ev.get("event") == "started")
    problem = claim_for_job(run_dir, job_id(), job_alive)
    if problem:
        # This job must not touch a run directory another run owns (not even its events.jsonl): stop
        # before srun and say why in the job's log.
        print(f"meshrun prologue: {problem}", file=sys.stderr)
        return EXIT_INVALID
    if cancel_requested(run_dir, events) is not None:
        # `meshrun action=cancel` came while this attempt was queued (launcher/manage/cancel.py): do not start it.
        record_cancelled(run_dir, "cancelled by meshrun action=cancel before this attempt started", job_id=job_id())
        release_job(run_dir, job_id())
        print(
            "meshrun prologue: the run was cancelled (meshrun action=cancel); this attempt does not start",
            file=sys.stderr,
        )
        print("exit 0")  # evaluated by the batch script: ends before srun, and Slurm's accounting says COMPLETED
        return EXIT_OK
    allocation = hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    paths = RunPaths(run_dir)
    cfg = load_config(paths.config)
    restart_count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    nodes, extra = allocation, {}
    if in_job.enabled(cfg.cluster):
        nodes, extra = _step_nodes(cfg, events, allocation, restart_count)
    elif cfg.cluster.preflight.mode != "off" and cfg.cluster.preflight.requeue_reuse_min > 0:
        from launcher.slurm.preflight_reuse import requeue_passed

        # A requeue after a stop with a checkpoint: nodes that passed the preflight minutes ago are not checked again.
        passed = requeue_passed(events, attempt, nodes, 60 * cfg.cluster.preflight.requeue_reuse_min, time.time())
        if passed:
            extra = {"preflight_passed": passed}
    step = last_step(run_dir)
    os.makedirs(paths.attempt(attempt), exist_ok=True)
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    write_atomic(
        paths.prologue(attempt),
        json.dumps({"last_step": step, "nodes": nodes, "job_id": job_id(), "allocation": allocation}),
    )
    append_event(
        run_dir,
        "started",
        attempt=attempt,
        job_id=job_id(),
        nodes=nodes,
        restart_count=restart_count,
        # The checkpoint this attempt resumes from (the last logged step may be far past it: a rank killed after
        # step 29 of a run saved at 9 resumes from 9), and the last step logged before it.
        resume_step=planned_resume_step(run_dir, cfg.train.resume),
        last_step=step,
        code=PROJECT_ROOT,
        **extra,
    )
    # MESHRUN_SELF_STOP=0 in the submitter's environment turns the ranks' own clock off, leaving only
    # Slurm's --signal (tests/slurm/test_fault_matrix_slurm.py checks that one alone still stops a run in time).
    own_clock = os.environ.get("MESHRUN_SELF_STOP", "1") != "0"
    stop_at = stop_time(cfg.cluster.signal_delay_s) if own_clock else None
    exports = {
        "MESHRUN_STOP_AT": f"{stop_at:.0f}" if stop_at else "",
        "MESHRUN_ATTEMPT": str(attempt),
        "MASTER_ADDR": nodes[0] if nodes else "localhost",
        # SLURM_JOB_ID is unique per array task too (job_id() of tasks 1 and 11 could share digits).
        "MASTER_PORT": str(port_from_job(os.environ.get("SLURM_JOB_ID", "0"), attempt)),
    }
    for k, v in exports.items():
        print(f"export {k}={shlex.quote(v)}")
    if in_job.enabled(cfg.cluster):
        print(in_job.step_args_line(nodes, cfg.cluster.gpus_per_node))
    if in_job.enabled(cfg.cluster) or extra.get("preflight_passed"):
        print(f"export {PREFLIGHT_PASSED_ENV}={shlex.quote(','.join(extra.get('preflight_passed') or []))}")
    return EXIT_OK


def _step_nodes(cfg, events, allocation: list[str], restart_count: int):
    """With in-job restarts: this attempt's step nodes (the allocation minus the nodes blamed earlier in it and
    those Slurm shows down or drained, the previous step's healthy nodes first) and the started event's extra
    fields (allocation, spares, in-job restarts used)."""
    from launcher.slurm.elastic import UNUSABLE, node_states

    bad = in_job.bad_nodes(events, job_id(), restart_count)
    done = in_job.restarts(events, job_id(), restart_count)
    previous = done[-1].get("nodes", []) if done else []
    states = node_states(cfg.cluster.partition) if bad or done else {}
    unusable = [n for n in allocation if states.get(n) in UNUSABLE]
    step = in_job.choose_step(allocation, bad, previous, cfg.cluster.nodes, unusable)
    if step is None:  # the epilogue checked there were enough; Slurm's view changed since: try the allocation's
        step = [n for n in allocation if n not in bad][: cfg.cluster.nodes] or allocation[: cfg.cluster.nodes]
    spare = in_job.spares(allocation, bad + unusable, step)
    passed = [n for n in in_job.preflight_passed(events, job_id(), restart_count) if n in step]
    return step, {
        "preflight_passed": passed,
        "allocation": allocation,
        "spares": spare,
        "bad_nodes": bad,
        "in_job_restarts": len(done),
        "max_in_job_restarts": in_job.restart_limit(cfg.cluster),
    }


SIGNAL_SWEEP_S = 30
"""Slurm checks time limits (and sends --signal) only this often: its USR2 comes up to this late."""


def stop_time(signal_delay_s: int):
    """When the ranks should save and stop on their own: the job's end minus signal_delay_s minus
    Slurm's sweep period, so the stop comes before Slurm's own USR2 (which may arrive while the ranks
    still start up and is then lost) and never after it. None when the job has no time limit."""
    try:
        out = slurm_command(["squeue", "-h", "-j", job_id(), "-o", "%e"]).stdout.strip()
    except SlurmUnavailable:
        return None  # Slurm's own USR2 still comes
    try:
        end = time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    return end - signal_delay_s - SIGNAL_SWEEP_S


def rank_layout(nodes: list[str], ranks_per_node: int) -> dict[int, str]:
    """Global rank -> node under Slurm's block distribution (ranks fill a node before the next)."""
    return {n * ranks_per_node + i: node for n, node in enumerate(nodes) for i in range(ranks_per_node)}


@dataclass
class _Attempt:
    """What the epilogue knows of the attempt it decides: the ranks' records, the prologue's, the run's events
    and requeue.py's decision."""

    number: int
    records: list[dict[str, Any]]
    pro: dict[str, Any]
    step_now: int | None
    events: list[dict[str, Any]]
    excluded: list[str]
    elastic: bool
    d: Decision
    ev: dict[str, Any]
    """The fields every event of this attempt carries (attempt, job_id)."""


def epilogue(run_dir: str, srun_rc: int, then_prologue: bool = False) -> int:
    """then_prologue (the in-job batch loop): on an in-job restart, also run the next attempt's prologue here
    and print its exports (the batch script evaluates them), one Python start less on the restart's path."""
    number = int(os.environ.get("MESHRUN_ATTEMPT", "0"))
    cfg = load_config(RunPaths(run_dir).config)
    _claim_decision(run_dir, number)
    a = _assess(run_dir, cfg, number)
    d = a.d
    if d.action == "completed":
        append_event(run_dir, "completed", last_step=a.step_now, **a.ev)
        write_goodput_quietly(run_dir)
        release_job(run_dir, job_id())
        return EXIT_OK
    if cancel_requested(run_dir, a.events) is not None:
        # `meshrun action=cancel` (launcher/manage/cancel.py): the ranks saved on its SIGUSR2; never requeue or resubmit.
        _record_failed(run_dir, d.failures, srun_rc, a.ev)
        record_cancelled(
            run_dir, "cancelled by meshrun action=cancel: saved a checkpoint and stopped", last_step=a.step_now, **a.ev
        )
        release_job(run_dir, job_id())
        # The run ended as asked: Slurm's accounting says COMPLETED 0:0, not FAILED 3:0 beside meshrun's CANCELLED.
        return EXIT_OK
    _record_failed(run_dir, d.failures, srun_rc, a.ev, consequences=d.consequences)
    if in_job.enabled(cfg.cluster) and _failure_like(d):
        code = _restart_in_job(run_dir, cfg, a, then_prologue)
        if code is not None:
            return code
    resize = None
    if d.action == "requeue" and a.elastic:
        # A requeue keeps the job's node count: a run that must shrink (its node drained) or can grow back
        # (nodes returned) is resubmitted instead, below.
        resize = _plan_resize(cfg, a.events, a.pro["nodes"], a.excluded, [])
    if d.action == "requeue" and resize is None:
        return _requeue(run_dir, cfg, a)
    if d.action == "stop":
        append_event(run_dir, "stopped", reason=d.reason, last_step=a.step_now, **a.ev)
        write_goodput_quietly(run_dir)
        release_job(run_dir, job_id())
        return EXIT_FAILED
    return _resubmit(run_dir, cfg, a, resize)


def _claim_decision(run_dir: str, attempt: int) -> None:
    """The attempt's epilogue.pid: a watcher of the batch script (batch_script_lost) leaves the decision to this
    process while it lives."""
    try:
        with open(RunPaths(run_dir).epilogue_pid(attempt), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        pass


def _assess(run_dir: str, cfg, number: int) -> _Attempt:
    """The attempt's records and requeue.py's decision on them."""
    paths = RunPaths(run_dir)
    records = []
    for path in sorted(glob.glob(os.path.join(paths.attempt(number), "rank_*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    with open(paths.prologue(number)) as f:
        pro = json.load(f)
    step_now = last_step(run_dir)
    progressed = step_now is not None and (pro["last_step"] is None or step_now > pro["last_step"])
    events = read_events(run_dir)
    # Progress is a checkpoint written by this attempt, not a step number: after train.resume=none an
    # attempt's steps are lower than the previous attempt's and still new work.
    saved = any(ev.get("event") == "checkpoint" and ev.get("attempt") == number for ev in events)
    excluded = excluded_nodes(events)
    elastic = cfg.cluster.elastic.min_nodes > 0
    # An elastic run may exclude failing nodes down to min_nodes: the next job then shrinks (launcher/slurm/elastic.py).
    d = decide(
        records,
        cfg.cluster.nodes * cfg.cluster.gpus_per_node,
        rank_layout(pro["nodes"], cfg.cluster.gpus_per_node),
        progressed,
        retries_used(events),
        cfg.cluster.max_retries,
        excluded,
        _PartitionNodes(cfg.cluster.partition),
        cfg.cluster.elastic.min_nodes if elastic else cfg.cluster.nodes,
        saved=saved,
    )
    ev = dict(attempt=number, job_id=job_id())
    return _Attempt(number, records, pro, step_now, events, excluded, elastic, d, ev)


def _record_failed(run_dir: str, failures: Sequence[Failure], srun_rc: int | None, ev: dict, **extra: Any) -> None:
    """One `failed` event per blamed rank (node, rank, exit code, reason, srun's exit status); extra: the
    consequences, where the run goes on."""
    for f in failures:
        append_event(
            run_dir,
            "failed",
            node=f.node,
            rank=f.rank,
            exit_code=f.exit_code,
            reason=f.reason,
            **extra,
            srun_exit_code=srun_rc,
            **ev,
        )


def _retry_fields(d: Decision, events: list[dict[str, Any]], cfg) -> dict[str, Any]:
    """A requeue's or resubmission's retry count, when its cause costs one (launcher/records/readers.py RETRY_CAUSES)."""
    if d.cause == "stopped_early":
        return {}
    return {"retry": retries_used(events) + 1, "max_retries": cfg.cluster.max_retries}


def _restart_in_job(run_dir: str, cfg, a: _Attempt, then_prologue: bool) -> int | None:
    """The epilogue's status when the failure restarts in this allocation (launcher/slurm/in_job.py); None when it
    cannot, after adding this allocation's bad nodes to a resubmission's exclusions."""
    d = a.d
    restart = _in_job_restart(run_dir, cfg, d, a.records, a.pro, a.events, a.step_now, a.ev)
    if restart.ok:
        if not then_prologue:
            write_goodput_quietly(run_dir)
            return EXIT_RESTART_IN_JOB  # the batch script's loop starts the next step in this allocation
        _goodput_aside(run_dir)
        if prologue(run_dir) != EXIT_OK:
            print("meshrun: the prologue failed; the attempt stops before srun: see the lines above", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_RESTART_IN_JOB
    # Fall back to the resubmission (or requeue): this allocation's bad nodes are excluded too.
    if d.action == "resubmit":
        from launcher.slurm.requeue import plan_exclusion
        from launcher.slurm.submit import partition_nodes as _partition_nodes

        d.exclude, note = plan_exclusion(
            d.exclude,
            restart.bad,
            _partition_nodes(cfg.cluster.partition),
            cfg.cluster.elastic.min_nodes if a.elastic else cfg.cluster.nodes,
        )
        d.note = "; ".join(x for x in (d.note, note, f"no in-job restart: {restart.why}") if x)
    return None


def _requeue(run_dir: str, cfg, a: _Attempt) -> int:
    """`requeued`, then `scontrol requeue` of this job (Slurm ends this script as part of it); `stopped` when
    Slurm refuses."""
    d = a.d
    fields = dict(cause=d.cause, reason=d.reason, excluded_nodes=a.excluded, last_step=a.step_now, **a.ev)
    fields.update(_retry_fields(d, a.events, cfg))
    append_event(run_dir, "requeued", **fields)
    writer = _goodput_beside_requeue(run_dir)
    try:
        res = slurm_command(["scontrol", "requeue", job_id()])
        refused = res.stderr.strip() if res.returncode != 0 else ""
    except SlurmUnavailable as exc:
        refused = str(exc)
    if refused:
        append_event(run_dir, "stopped", reason=f"scontrol requeue failed: {refused}", **a.ev)
        release_job(run_dir, job_id())
        _wait_quietly(writer)
        write_goodput_quietly(run_dir)  # with the stop
        return EXIT_FAILED
    time.sleep(REQUEUE_WAIT_S)  # Slurm kills this script as part of the requeue
    return EXIT_FAILED


def _resubmit(run_dir: str, cfg, a: _Attempt, resize) -> int:
    """A new job with the failing node(s) excluded, resuming from the last checkpoint (an elastic run's on its
    new node count); the lock goes to it and `requeued` names it."""
    from launcher.slurm.submit import submit_job

    d = a.d
    if d.action == "resubmit" and a.elastic:
        resize = _plan_resize(cfg, a.events, a.pro["nodes"], d.exclude, [n for n in d.exclude if n not in a.excluded])
    exclude = resize.exclude if resize else d.exclude
    for key in [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_"))]:
        del os.environ[key]  # the new job must not inherit this job's allocation
    try:
        new_id = submit_job(_fit_spares(resize.cfg if resize else cfg, exclude), run_dir, exclude=",".join(exclude))
    except Exception as exc:
        append_event(run_dir, "stopped", reason=f"resubmission failed: {exc}", **a.ev)
        release_job(run_dir, job_id())
        return EXIT_FAILED
    if resize is not None:  # config.json of the new layout before the new job may start (it waits for the lock)
        from launcher.slurm.elastic import apply_resize

        apply_resize(run_dir, resize, new_job_id=new_id, **a.ev)
    set_job_holder(run_dir, new_id, previous_job_id=job_id())  # the new job's prologue waits for this
    fields = dict(cause=d.cause, reason=d.reason, excluded_nodes=exclude, new_job_id=new_id, **a.ev)
    fields.update(_retry_fields(d, a.events, cfg))
    if d.note:
        fields["note"] = d.note
    append_event(run_dir, "requeued", **fields)
    write_goodput_quietly(run_dir)
    new_cfg = resize.cfg if resize else cfg
    print(
        f"meshrun: attempt {a.number} {'failed' if d.action == 'resubmit' else 'stopped'} ({d.reason}); "
        f"resubmitted as job {new_id} on {new_cfg.cluster.nodes} node(s) excluding {exclude or 'no node'}"
        + (f", layout {format_layout(layout_of(new_cfg), 'short')}" if resize else ""),
        file=sys.stderr,
    )
    return EXIT_FAILED


class _PartitionNodes(Sequence[str]):
    """The partition's node names, asked of Slurm (sinfo) on first use: only a resubmission's exclusion plan
    reads them, so the requeue after a preemption (on the way to the next attempt) does not wait for sinfo."""

    def __init__(self, partition: str) -> None:
        self.partition = partition
        self._nodes: list[str] | None = None

    def _get(self) -> list[str]:
        if self._nodes is None:
            from launcher.slurm.submit import partition_nodes

            self._nodes = partition_nodes(self.partition)
        return self._nodes

    def __getitem__(self, i):  # type: ignore[override]
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())


def _goodput_beside_requeue(run_dir: str) -> int | None:
    """goodput.json written by a forked copy of this process while Slurm requeues the job: its sacct query is
    then not on the way from the preemption signal to the requeue. The copy ignores the
    SIGTERM with which the requeue ends the batch script, and the job is requeued once it is done (Slurm
    waits for every process of the job). Its pid, or None when it was written here (fork failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        write_goodput_quietly(run_dir)
        return None
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write_goodput_quietly(run_dir)
        finally:
            os._exit(0)
    return pid


def _wait_quietly(pid: int | None) -> None:
    if pid is not None:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _goodput_aside(run_dir: str) -> None:
    """goodput.json written by a forked copy of this process while the next step starts (its standard output,
    the next prologue's exports for the batch script, goes to /dev/null there)."""
    sys.stdout.flush()
    try:
        pid = os.fork()
    except OSError:
        write_goodput_quietly(run_dir)
        return
    if pid == 0:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            write_goodput_quietly(run_dir)
        finally:
            os._exit(0)


def _failure_like(d) -> bool:
    """A failure the allocation can recover from in place: a failed rank or node, a failed save, or such a
    failure past cluster.max_retries (the in-job restarts do not count against it). A stop after a checkpoint
    (preemption, time limit) is not: the allocation is going away."""
    if d.cause in ("failure", "save_failed"):
        return True
    return d.action == "stop" and bool(d.failures) and d.reason.startswith("retries exhausted")


def _in_job_restart(run_dir, cfg, d, records, pro, events, step_now, ev) -> in_job.Restart:
    """launcher/slurm/in_job.py's plan for this failure; when it is possible, the `restarted_in_job` event."""
    from launcher.slurm.elastic import UNUSABLE, node_states

    restart_count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    allocation = pro.get("allocation") or pro["nodes"]
    by_rank = {int(r["rank"]): r for r in records}
    blamed = [f.node for f in blamed_failures(d.failures, by_rank)]
    states = node_states(cfg.cluster.partition)
    unusable = [n for n in allocation if states.get(n) in UNUSABLE]
    done = in_job.restarts(events, job_id(), restart_count)
    r = in_job.plan(
        cfg.cluster,
        allocation,
        pro["nodes"],
        blamed,
        in_job.bad_nodes(events, job_id(), restart_count),
        len(done),
        unusable,
    )
    if r.ok:
        left = in_job.spares(allocation, r.bad + unusable, r.step)
        append_event(
            run_dir,
            in_job.EVENT,
            cause=in_job.cause_of(d.failures, by_rank),
            reason=d.reason,
            replaced_node=r.replaced[0] if r.replaced else None,
            spare=r.spares_used[0] if r.spares_used else None,
            replaced_nodes=r.replaced,
            spares_used=r.spares_used,
            nodes=r.step,
            bad_nodes=r.bad,
            spares_left=len(left),
            restart=len(done) + 1,
            max_in_job_restarts=in_job.restart_limit(cfg.cluster),
            restart_count=restart_count,
            last_step=step_now,
            resume_step=planned_resume_step(run_dir, cfg.train.resume),
            **ev,
        )
        print(
            f"meshrun: attempt {ev['attempt']} failed ({d.reason}); restarting in job {job_id()} on "
            f"{', '.join(r.step)}"
            + (f" ({', '.join(r.spares_used)} replacing {', '.join(r.replaced)})" if r.spares_used else ""),
            file=sys.stderr,
        )
    return r


def _fit_spares(cfg, exclude):
    """cfg with cluster.spare_nodes lowered so that nodes + spares fit the partition after `exclude` (a
    resubmission that asked for more nodes than remain would never start)."""
    if cfg.cluster.spare_nodes <= 0:
        return cfg
    import dataclasses

    from launcher.slurm.submit import partition_nodes

    usable = [n for n in partition_nodes(cfg.cluster.partition) if n not in exclude]
    spare = max(0, min(cfg.cluster.spare_nodes, len(usable) - cfg.cluster.nodes)) if usable else cfg.cluster.spare_nodes
    if spare == cfg.cluster.spare_nodes:
        return cfg
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, spare_nodes=spare))


def _plan_resize(cfg, events, own, exclude, newly_excluded):
    """launcher/slurm/elastic.py's next node count; None (no change) when it cannot be planned, so a
    failure of the elastic logic never costs the run its resubmission."""
    from launcher.slurm.elastic import job_end_time, plan_resize

    try:
        return plan_resize(cfg, events, own, exclude, newly_excluded, job_end=job_end_time(job_id()))
    except Exception as exc:  # noqa: BLE001 - logged; the plain requeue or resubmission still happens
        print(f"meshrun epilogue: elastic resize not planned: {exc!r}", file=sys.stderr)
        return None


_DECIDED = ("completed", "stopped", "cancelled", "requeued", "restarted_in_job")
"""Events that end an attempt's decision (the epilogue's)."""

LOST_GRACE_S = 2.0
"""How long the early epilogue waits, once the batch script is gone, for a job-wide signal that would end it too."""


def _epilogue_running(run_dir: str, attempt: int) -> bool:
    try:
        with open(RunPaths(run_dir).epilogue_pid(attempt)) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except (OSError, ValueError):
        return False


def batch_script_lost(run_dir: str) -> int:
    """The early epilogue's standard input closed before srun's exit status came: the batch script is gone while
    srun still ran. A job-wide end (scancel of the whole job, the time limit, a requeue from outside) sends every
    process of the batch step SIGTERM and ends this one too (it does not handle it), so alive after LOST_GRACE_S
    means the batch script alone was killed (`scancel --signal=KILL --batch`, an operator's kill -9): nothing
    else would decide this attempt. It is recorded as `failed` (rank -1, the reason naming it) and the job
    requeues itself from the last complete checkpoint (costs one of cluster.max_retries; past them `stopped`).
    Slurm ends the job's steps when its batch step has ended (the ranks' SIGTERM: they save if they can); the
    requeue is retried until Slurm takes it."""
    time.sleep(LOST_GRACE_S)
    events = read_events(run_dir)
    started = [e for e in events if e.get("event") == "started" and str(e.get("job_id")) == job_id()]
    if not started:
        return EXIT_OK  # no attempt of this job started (its prologue ended the script)
    attempt = int(started[-1].get("attempt", 0))
    ev = dict(attempt=attempt, job_id=job_id())
    cfg = load_config(RunPaths(run_dir).config)
    # With in-job restarts the epilogue runs after srun as a child of the batch script and outlives it: while it
    # lives, the decision is its own.
    while _epilogue_running(run_dir, attempt):
        time.sleep(0.5)
    if any(e.get("attempt") == attempt and e.get("event") in _DECIDED for e in read_events(run_dir)):
        return EXIT_OK  # decided by the epilogue
    reason = (
        "the batch script was killed while srun still ran (a signal to the batch step alone, e.g. scancel "
        "--signal=KILL --batch): the ranks' ends were not seen"
    )
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    _record_failed(run_dir, [Failure(-1, node, None, reason)], None, ev, consequences=[])
    step_now = last_step(run_dir)
    used = retries_used(events)
    if cancel_requested(run_dir, events) is not None or used >= cfg.cluster.max_retries:
        why = (
            "cancelled by meshrun action=cancel"
            if cancel_requested(run_dir, events) is not None
            else f"retries exhausted (cluster.max_retries={cfg.cluster.max_retries})"
        )
        append_event(run_dir, "stopped", reason=f"{reason}; {why}", last_step=step_now, **ev)
        release_job(run_dir, job_id())
        write_goodput_quietly(run_dir)
        return EXIT_FAILED
    append_event(
        run_dir,
        "requeued",
        cause="failure",
        reason=f"{reason}; requeued from the last complete checkpoint",
        excluded_nodes=excluded_nodes(events),
        last_step=step_now,
        retry=used + 1,
        max_retries=cfg.cluster.max_retries,
        **ev,
    )
    deadline = time.time() + REQUEUE_WAIT_S
    refused = ""
    while time.time() < deadline:
        try:
            res = slurm_command(["scontrol", "requeue", job_id()])
            refused = res.stderr.strip() if res.returncode != 0 else ""
        except SlurmUnavailable as exc:
            refused = str(exc)
        if not refused:
            return EXIT_FAILED
        time.sleep(1.0)  # the job is still completing: Slurm requeues it once it has ended
    append_event(run_dir, "stopped", reason=f"{reason}; scontrol requeue failed: {refused}", **ev)
    release_job(run_dir, job_id())
    write_goodput_quietly(run_dir)
    return EXIT_FAILED


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("prologue", "epilogue", "watch"):
        print(
            "usage: python -m launcher.slurm.driver prologue|epilogue|watch RUN_DIR [SRUN_RC | --srun-rc-on-stdin] "
            "[--then-prologue]",
            file=sys.stderr,
        )
        return EXIT_INVALID
    if argv[0] == "prologue":
        return prologue(argv[1])
    if argv[0] == "watch":
        # The in-job batch loop's watcher (launcher/slurm/in_job.py batch_watch_lines): "done" before the script's
        # own exit; end of input without it: the batch script was killed.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if sys.stdin.readline().strip() == "done":
            return EXIT_OK
        return batch_script_lost(argv[1])
    srun_rc = int(argv[2]) if len(argv) > 2 and argv[2].lstrip("-").isdigit() else -1
    if "--srun-rc-on-stdin" in argv[2:]:
        # The early epilogue (launcher/slurm/sbatch.py early_epilogue_lines): imported already, it waits for the
        # batch script to hand over srun's exit status. A job-wide SIGUSR2 is the ranks' signal, not its own.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        line = sys.stdin.readline().strip()
        if not line.lstrip("-").isdigit():
            # The batch script ended without handing over: killed while srun still ran.
            return batch_script_lost(argv[1])
        srun_rc = int(line)
        # The batch script's cue that this process decides the attempt (before anything is decided), then the
        # job's log as standard output, as for an epilogue started after srun.
        os.write(1, b"ok\n")
        if "--log-fd" in argv:
            os.dup2(int(argv[argv.index("--log-fd") + 1]), 1)
    return epilogue(argv[1], srun_rc, then_prologue="--then-prologue" in argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
