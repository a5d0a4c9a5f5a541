"""Append-only job events (run_dir/events.jsonl): pure Python, importable from the launcher and ranks.

One JSON object per line with `event`, `time`, `attempt`, `job_id` plus the event's own fields
(docs/USER_CONTRACTS.md lists the kinds). Lines are written with one `write` call on an O_APPEND file, so
several processes appending at once never interleave within a line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

from training.contract.slurm_env import slurm_job_id

EVENTS_FILE = "events.jsonl"


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


def append_event(run_dir: str, event: str, **fields: Any) -> Dict[str, Any]:
    """Append one event to run_dir/events.jsonl and return the record written."""
    record: Dict[str, Any] = {
        "event": event,
        "time": time.time(),
        "attempt": current_attempt(),
        "job_id": current_job_id(),
    }
    record.update(fields)
    os.makedirs(run_dir, exist_ok=True)
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    from training.contract.rundir.files import append_bytes  # never through a link (training/contract/rundir/files.py)

    append_bytes(os.path.join(run_dir, EVENTS_FILE), line.encode())  # the umask decides the mode
    return record


def read_events(run_dir: str) -> List[Dict[str, Any]]:
    """All events of a run, oldest first; a torn last line (a crash mid-write) is skipped."""
    path = os.path.join(run_dir, EVENTS_FILE)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):  # meshrun writes objects only: a list or number line is not an event
                out.append(record)
    return out
