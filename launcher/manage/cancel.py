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
and asks Slurm once for all its jobs. Steps 2 and 3 are the backend's that launched the run (config.json's
cluster.kind: launcher/launch/backend.py): local_backend.py and slurm_backend.py beside it.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys
import time
from typing import Any

from launcher.launch.backend import Backend, backend_of_run, states_of
from launcher.records.readers import cancelled_event
from training.checkpoint.storage import read_latest
from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.events import read_events
from training.contract.rundir.paths import EVENTS_FILE, SWEEP_FILE, RunPaths


def write_mark(run_dir: str) -> dict[str, Any]:
    mark = {"time": time.time(), "user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid()}
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    write_atomic(RunPaths(run_dir).cancel, json.dumps(mark))
    return mark


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


def _ended(run_dir: str) -> bool:
    """The run recorded its `cancelled` event or reached a final state."""
    from launcher.manage.status import run_status
    from launcher.slurm.queries import FINAL_STATES

    return cancelled_event(read_events(run_dir)) is not None or run_status(run_dir)["state"] in FINAL_STATES


def cancel(run_dir: str, timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
    """Cancel the run(s) in run_dir; returns run dir -> its status afterwards."""
    from launcher.manage.status import run_status
    from launcher.slurm.queries import FINAL_STATES

    if not timeout_s > 0:
        print(
            f"error: cancel.timeout_s={timeout_s} must be > 0 (seconds the ranks get to save before they are killed)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    targets = _targets(run_dir)
    events_of = {d: read_events(d) for d in targets}
    states = states_of(events_of)  # one question to the scheduler for every target
    waiting: dict[str, tuple[Backend, Any]] = {}
    for d in targets:
        status = run_status(d, states, events_of[d])
        if status["state"] in FINAL_STATES:
            print(f"{d}: already {status['state']}; nothing to cancel", file=sys.stderr)
            continue
        write_mark(d)
        # The backend that launched the run stops it: at once (a job not started yet), or a handle to wait on.
        backend = backend_of_run(d, events_of[d])
        handle = backend.cancel(d, events_of[d], states)
        if handle is not None:
            waiting[d] = (backend, handle)
    deadline = time.time() + timeout_s
    for d, (backend, handle) in waiting.items():
        backend.cancel_wait(d, handle, timeout_s, deadline, _ended)
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
