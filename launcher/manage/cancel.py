"""`meshrun action=cancel run.dir=D`: stop a run, a sweep or one sweep point gracefully, for good.

1. The mark: run.dir/cancel.json (time, who), written under a temporary name and renamed. It applies to the
   launch it was written in: a later launch (a `submitted` event, or a local launcher's `started`) is a new
   run of the directory and ignores an older mark (cancel_requested).
2. The stop: the ranks' own stop path (training/run/signals.py): SIGUSR2, so they agree on a step, save a
   complete checkpoint and exit 3.
   Slurm: `scancel --signal=USR2 JOB` (the job's steps: the ranks) while it runs; the epilogue
   (launcher/slurm/driver.py) sees the mark and records `cancelled` instead of requeueing or resubmitting, and
   releases the run directory; a job that has not started yet (pending, or pending again after a requeue) is
   removed with `scancel` at once. Local: SIGUSR2 to each rank process of the launcher (only once its handler is
   installed: before that the signal would kill it), then `cancelled` once the launcher has ended.
3. A run that does not stop within cancel.timeout_s is killed (scancel / SIGKILL); its last complete checkpoint
   stays, and the event says so.
`meshrun action=status` then says CANCELLED (cancelled_event). A sweep directory cancels every launched point
and asks Slurm once for all its jobs.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from launcher.ranks.proc_tree import children
from launcher.records.readers import cancelled_event, current_job_id, record_cancelled
from training.checkpoint.storage import read_latest
from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.events import read_events
from training.contract.rundir.paths import EVENTS_FILE, SWEEP_FILE, RunPaths

POLL_S = 1.0


def write_mark(run_dir: str) -> dict[str, Any]:
    mark = {"time": time.time(), "user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid()}
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    write_atomic(RunPaths(run_dir).cancel, json.dumps(mark))
    return mark


# ---- local runs ------------------------------------------------------------------------------------
def _rank_pids(launcher: int) -> list[int]:
    """A local launcher's rank processes: its children, where its warm agent (launcher/ranks/warm/local.py)
    stands for the ranks it forked (its children); the agent itself stops with the launch."""
    out = []
    for pid in children(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                warm_agent = b"training.run.warm_agent" in f.read()
        except OSError:
            continue
        out += children(pid) if warm_agent else [pid]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cancel_local(run_dir: str, started: dict[str, Any], timeout_s: float, deadline: float) -> dict[str, Any]:
    """Signal a local run's ranks and wait for its launcher until deadline (the whole cancel's clock, which
    started at timeout_s before it): the reason names timeout_s as the user wrote it."""
    from launcher.ranks.exits import catches

    launcher = int(started["launcher_pid"])
    signalled: set = set()
    while _alive(launcher) and time.time() < deadline:
        for pid in _rank_pids(launcher):
            # Before the rank installs its handler SIGUSR2 would kill it: wait until it catches the signal.
            if pid not in signalled and catches(pid, signal.SIGUSR2):
                try:
                    os.kill(pid, signal.SIGUSR2)
                    signalled.add(pid)
                except OSError:
                    pass
        time.sleep(POLL_S / 4)
    if _alive(launcher):
        for pid in _rank_pids(launcher):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return record_cancelled(
            run_dir,
            f"the ranks did not stop within cancel.timeout_s={timeout_s:g} s: killed; "
            "the last complete checkpoint is kept",
            forced=True,
        )
    if not _checkpointing(run_dir):
        return record_cancelled(
            run_dir,
            "cancelled by meshrun action=cancel: stopped at a step boundary; no checkpoint was written "
            "(train.checkpointing=false): nothing to resume",
        )
    return record_cancelled(run_dir, "cancelled by meshrun action=cancel: saved a checkpoint and stopped")


def _checkpointing(run_dir: str) -> bool:
    """The run's train.checkpointing (config.json); True when it cannot be read (the usual case's words)."""
    from launcher.manage.resume import saved_config

    try:
        train = (saved_config(run_dir) or {}).get("train")
    except (OSError, ValueError, AttributeError):
        return True
    return not (isinstance(train, dict) and train.get("checkpointing") is False)


# ---- Slurm runs ------------------------------------------------------------------------------------
def _scancel(args: list[str]) -> str:
    """ "" when scancel accepted, else its complaint."""
    from training.contract.slurm_env import SlurmUnavailable, slurm_command

    try:
        res = slurm_command(["scancel"] + args)
    except SlurmUnavailable as exc:
        return str(exc)
    return res.stderr.strip() if res.returncode != 0 else ""


def _signal_slurm(run_dir: str, job: str, state: str | None) -> dict[str, Any] | None:
    """Stop one Slurm job: the `cancelled` event when done at once (not started yet), else None (the epilogue
    records it once the ranks have saved)."""
    from training.contract.rundir.lock import release_job

    if state in (None, "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED"):
        problem = _scancel([job])
        release_job(run_dir, job)
        return record_cancelled(
            run_dir,
            "cancelled by meshrun action=cancel before the job started" + (f" (scancel: {problem})" if problem else ""),
            job_id=job,
        )
    problem = _scancel(["--signal=USR2", job])  # the job's steps (the ranks); the batch script keeps running
    if problem:
        print(f"warning: scancel --signal=USR2 {job}: {problem}", file=sys.stderr)
    return None


def _force_slurm(run_dir: str, job: str, timeout_s: float) -> dict[str, Any]:
    from training.contract.rundir.lock import release_job

    _scancel([job])
    release_job(run_dir, job)
    return record_cancelled(
        run_dir,
        f"job {job} did not stop within cancel.timeout_s={timeout_s:g} s: scancel; "
        "the last complete checkpoint is kept",
        job_id=job,
        forced=True,
    )


# ---- the action ------------------------------------------------------------------------------------
def _targets(run_dir: str) -> list[str]:
    """The run directories to cancel: run_dir itself, or every launched point of a sweep directory."""
    paths = RunPaths(run_dir)
    if os.path.exists(paths.sweep):
        with open(paths.sweep) as f:
            sweep = json.load(f)
        return [
            row["run_dir"]
            for row in sweep.get("feasible", [])
            if row.get("run_dir") and os.path.exists(RunPaths(row["run_dir"]).events)
        ]
    if not os.path.exists(paths.events):
        print(
            f"error: run.dir={run_dir} is neither a launched meshrun run (no {EVENTS_FILE}) nor a sweep directory "
            f"(no {SWEEP_FILE}): give the directory printed at launch or submission",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    return [run_dir]


def cancel(run_dir: str, timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
    """Cancel the run(s) in run_dir; returns run dir -> its status afterwards."""
    from launcher.manage.status import run_status
    from launcher.slurm.queries import FINAL_STATES, slurm_states

    if not timeout_s > 0:
        print(
            f"error: cancel.timeout_s={timeout_s} must be > 0 (seconds the ranks get to save before they are killed)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    targets = _targets(run_dir)
    events_of = {d: read_events(d) for d in targets}
    states = slurm_states([j for j in (current_job_id(e) for e in events_of.values()) if j is not None])
    waiting: dict[str, Any] = {}
    for d in targets:
        status = run_status(d, states, events_of[d])
        if status["state"] in FINAL_STATES:
            print(f"{d}: already {status['state']}; nothing to cancel", file=sys.stderr)
            continue
        write_mark(d)
        job = current_job_id(events_of[d])
        if job is not None:
            if _signal_slurm(d, job, states.get(job)) is None:
                waiting[d] = job
            continue
        started = [ev for ev in events_of[d] if ev.get("event") == "started" and "launcher_pid" in ev]
        if started:
            waiting[d] = started[-1]
    deadline = time.time() + timeout_s
    for d, what in waiting.items():
        if isinstance(what, dict):  # local: this process signals the ranks and waits for the launcher
            _cancel_local(d, what, timeout_s, deadline)
            continue
        while (
            time.time() < deadline
            and cancelled_event(read_events(d)) is None
            and run_status(d)["state"] not in FINAL_STATES
        ):
            time.sleep(POLL_S)
        if cancelled_event(read_events(d)) is None and run_status(d)["state"] not in FINAL_STATES:
            _force_slurm(d, what, timeout_s)
    out = {d: run_status(d) for d in targets}
    for d, st in out.items():
        print(f"{st['state']}: {d} (checkpoint step {read_latest(d)})", file=sys.stderr)
    return out


def run_cancel(cfg, run_dir: str) -> dict[str, Any]:
    """The app's action=cancel: one JSON object on stdout (run dir -> state)."""
    result = cancel(run_dir, cfg.cancel.timeout_s)
    summary = {d: st["state"] for d, st in result.items()}
    print(json.dumps(summary, sort_keys=True))
    return summary
