"""Append-only job events (run_dir/events.jsonl): pure Python, importable from the launcher and ranks.

One JSON object per line with `event`, `time`, `attempt`, `job_id` plus the event's own fields
(docs/USER_CONTRACTS.md lists the kinds). Lines are written with one `write` call on an O_APPEND file, so
several processes appending at once never interleave within a line.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from training.contract.rundir.paths import RunPaths
from training.contract.slurm_env import slurm_job_id


def current_attempt() -> int:
    """Slurm's restart count, or the local launcher's attempt number; 0 for a first attempt."""
    # MESHRUN_ATTEMPT first: the Slurm driver numbers attempts across resubmitted jobs too.
    for key in ("MESHRUN_ATTEMPT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(key)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                pass
    return 0


def current_job_id() -> str:
    """Slurm's job id ("<array>_<task>" in a job array), or "local" for runs on this machine."""
    return slurm_job_id() or "local"


def append_event(run_dir: str, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event to run_dir/events.jsonl and return the record written."""
    record: dict[str, Any] = {
        "event": event,
        "time": time.time(),
        "attempt": current_attempt(),
        "job_id": current_job_id(),
    }
    record.update(fields)
    os.makedirs(run_dir, exist_ok=True)
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    from training.contract.rundir.files import append_bytes  # never through a link (training/contract/rundir/files.py)

    append_bytes(RunPaths(run_dir).events, line.encode())  # the umask decides the mode
    return record


NUMERIC_FIELDS = ("time", "attempt", "blocked_s", "step_time_s", "eval_s", "step", "restart_count")
"""Fields of events and metrics rows that readers compute with."""


def well_formed(record: Any) -> bool:
    """An object whose numeric fields (where present) are finite numbers, the counts whole: a hand-edited or
    damaged line (a string time, an attempt "x", NaN) is skipped by every reader instead of crashing status,
    report and cancel (or making status print NaN, which is not JSON)."""
    if not isinstance(record, dict):  # meshrun writes objects only: a list or number line is not an event
        return False
    for key in NUMERIC_FIELDS:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if key in ("attempt", "step", "restart_count") and value != int(value):
            return False
    return True


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """All events of a run, oldest first; a torn last line (a crash mid-write) or a malformed one is skipped, and
    an events.jsonl that is not a regular file (a FIFO would block the reader) reads as none; a line beyond
    training/contract/rundir/lines.py's MAX_LINE_BYTES is skipped without being read whole."""
    from training.contract.rundir.lines import read_objects

    return [record for record in read_objects(RunPaths(run_dir).events) if well_formed(record)]
