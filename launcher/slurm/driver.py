"""The batch script's own steps around srun: `python -m launcher.slurm.driver prologue|epilogue RUN_DIR`.

prologue (before srun): numbers the attempt, records `started` with the nodes, prints the
  rendezvous exports (MASTER_ADDR = first node, MASTER_PORT from the job id) for `eval`.
epilogue (after srun): reads every rank's record and acts (launcher/slurm/requeue.py decides):
  completed -> `completed`; all ranks stopped early -> `requeued`, `scontrol requeue` (same job);
  a failure -> `failed` (node, rank, exit code), then a new job excluding the failing node, up to
  cluster.max_retries -> then `stopped`; EXIT_INVALID or the same error on every rank at step 0 -> `stopped`.
The epilogue's own status is EXIT_OK only when the run completed (training/exit_codes.py).
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import sys
import time
from typing import Dict, List

from launcher.slurm.requeue import decide
from launcher.slurm.rank_task import attempt_dir
from launcher.status import excluded_nodes, last_step, retries_used
from training.config import load_config
from training.events import append_event, read_events
from training.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from training.slurm_env import SlurmUnavailable, hostnames, port_from_job, slurm_command, slurm_job_id

REQUEUE_WAIT_S = 120


def job_id() -> str:
    """This job's id for Slurm commands and events ("<array>_<task>" in a sweep's job array)."""
    return slurm_job_id() or "0"


def prologue(run_dir: str) -> int:
    events = read_events(run_dir)
    attempt = sum(1 for ev in events if ev.get("event") == "started")
    nodes = hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    step = last_step(run_dir)
    os.makedirs(attempt_dir(run_dir, attempt), exist_ok=True)
    with open(os.path.join(attempt_dir(run_dir, attempt), "prologue.json"), "w") as f:
        json.dump({"last_step": step, "nodes": nodes, "job_id": job_id()}, f)
    append_event(run_dir, "started", attempt=attempt, job_id=job_id(), nodes=nodes,
                 restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0), resume_step=step)
    stop_at = stop_time(load_config(os.path.join(run_dir, "config.json")).cluster.signal_delay_s)
    exports = {
        "MESHRUN_STOP_AT": f"{stop_at:.0f}" if stop_at else "",
        "MESHRUN_ATTEMPT": str(attempt),
        "MASTER_ADDR": nodes[0] if nodes else "localhost",
        # SLURM_JOB_ID is unique per array task too (job_id() of tasks 1 and 11 could share digits).
        "MASTER_PORT": str(port_from_job(os.environ.get("SLURM_JOB_ID", "0"), attempt)),
    }
    for k, v in exports.items():
        print(f"export {k}={shlex.quote(v)}")
    return EXIT_OK


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


def rank_layout(nodes: List[str], ranks_per_node: int) -> Dict[int, str]:
    """Global rank -> node under Slurm's block distribution (ranks fill a node before the next)."""
    return {n * ranks_per_node + i: node for n, node in enumerate(nodes) for i in range(ranks_per_node)}


def epilogue(run_dir: str, srun_rc: int) -> int:
    attempt = int(os.environ.get("MESHRUN_ATTEMPT", "0"))
    cfg = load_config(os.path.join(run_dir, "config.json"))
    adir = attempt_dir(run_dir, attempt)
    records = []
    for path in sorted(glob.glob(os.path.join(adir, "rank_*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    with open(os.path.join(adir, "prologue.json")) as f:
        pro = json.load(f)
    step_now = last_step(run_dir)
    progressed = step_now is not None and (pro["last_step"] is None or step_now > pro["last_step"])
    events = read_events(run_dir)
    excluded = excluded_nodes(events)
    from launcher.slurm.submit import partition_nodes

    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    d = decide(records, world, rank_layout(pro["nodes"], cfg.cluster.gpus_per_node), progressed,
               retries_used(events), cfg.cluster.max_retries, excluded, partition_nodes(cfg.cluster.partition),
               cfg.cluster.nodes)
    ev = dict(attempt=attempt, job_id=job_id())
    if d.action == "completed":
        append_event(run_dir, "completed", last_step=step_now, **ev)
        return EXIT_OK
    if d.action == "requeue":
        append_event(run_dir, "requeued", cause="stopped_early", reason=d.reason, excluded_nodes=excluded,
                     last_step=step_now, **ev)
        sys.stdout.flush()
        try:
            res = slurm_command(["scontrol", "requeue", job_id()])
            refused = res.stderr.strip() if res.returncode != 0 else ""
        except SlurmUnavailable as exc:
            refused = str(exc)
        if refused:
            append_event(run_dir, "stopped", reason=f"scontrol requeue failed: {refused}", **ev)
            return EXIT_FAILED
        time.sleep(REQUEUE_WAIT_S)  # Slurm kills this script as part of the requeue
        return EXIT_FAILED
    for f in d.failures:
        append_event(run_dir, "failed", node=f.node, rank=f.rank, exit_code=f.exit_code, reason=f.reason,
                     srun_exit_code=srun_rc, **ev)
    if d.action == "stop":
        append_event(run_dir, "stopped", reason=d.reason, last_step=step_now, **ev)
        return EXIT_FAILED
    # resubmit: a new job with the failing node(s) excluded, resuming from the last checkpoint.
    from launcher.slurm.submit import submit_job

    for key in [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_"))]:
        del os.environ[key]  # the new job must not inherit this job's allocation
    try:
        new_id = submit_job(cfg, run_dir, exclude=",".join(d.exclude))
    except Exception as exc:
        append_event(run_dir, "stopped", reason=f"resubmission failed: {exc}", **ev)
        return EXIT_FAILED
    fields = dict(cause="failure", reason=d.reason, excluded_nodes=d.exclude, new_job_id=new_id,
                  retry=retries_used(events) + 1, max_retries=cfg.cluster.max_retries, **ev)
    if d.note:
        fields["note"] = d.note
    append_event(run_dir, "requeued", **fields)
    print(f"meshrun: attempt {attempt} failed ({d.reason}); resubmitted as job {new_id} "
          f"excluding {d.exclude or 'no node'}", file=sys.stderr)
    return EXIT_FAILED


def main(argv: List[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("prologue", "epilogue"):
        print("usage: python -m launcher.slurm.driver prologue|epilogue RUN_DIR [SRUN_RC]", file=sys.stderr)
        return EXIT_INVALID
    if argv[0] == "prologue":
        return prologue(argv[1])
    return epilogue(argv[1], int(argv[2]) if len(argv) > 2 and argv[2].lstrip("-").isdigit() else -1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
