"""An explicit `train.resume` (a step number or `none`) applies to the first attempt of a launch only.

config.json is written once per launch, but a Slurm job runs it again at every requeue and resubmission.
Re-applying `none` would restart at step 0 forever; re-applying a step would redo the same work until pruning
deleted that step. So the launcher records the explicit choice in run_dir/resume_request.json when it
launches (local run or submission), the first attempt that resumes marks it consumed, and every later
attempt of the same launch resumes from `latest` (`auto`). Pure Python: launcher and ranks import it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from training.contract.rundir.paths import RunPaths


def _path(run_dir: str) -> str:
    return RunPaths(run_dir).resume_request


def _write(run_dir: str, data: dict[str, Any]) -> None:
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    write_atomic(_path(run_dir), json.dumps(data, sort_keys=True))


def read_request(run_dir: str) -> dict[str, Any] | None:
    try:
        with open(_path(run_dir)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_request(run_dir: str, resume: Any) -> None:
    """At each launch (never at a requeue): record an explicit choice; `auto` clears an older one."""
    value = str(resume).strip().lower()
    if value == "auto":
        try:
            os.unlink(_path(run_dir))
        except FileNotFoundError:
            pass
        return
    _write(run_dir, {"resume": value, "requested_at": time.time(), "consumed": None})


def effective_resume(run_dir: str, configured: Any) -> str:
    """What this attempt resumes from: the launch's explicit choice until an attempt has consumed it,
    then `auto`; without a request file (a rank started by hand), the configured value."""
    req = read_request(run_dir)
    if req is None:
        return str(configured)
    return "auto" if req.get("consumed") else str(req.get("resume", configured))


def mark_consumed(run_dir: str, step: int | None, attempt: int, job_id: str) -> None:
    """Rank 0, once this attempt has resumed (or started fresh) as the request asked."""
    req = read_request(run_dir)
    if req is None or req.get("consumed"):
        return
    req["consumed"] = {"attempt": attempt, "job_id": job_id, "step": step, "time": time.time()}
    _write(run_dir, req)
