"""One sweep point's record: point.json in the point's own directory (pure JSON, no Hydra).

A Hydra launcher runs each point where it likes: in this process (meshrun's and Hydra's basic
launcher), in a worker process (joblib) or in a job of its own (submitit). Return values and
callback state do not come back from those, files do: the point's record is written next to its
plan.json by the process that ran it (launcher/sweep/summary.py's on_job_end), updated by whoever acts on the
point later (the Slurm job-array submission of launcher/slurm/submit.py; with wait=true the final status,
launcher/manage/follow.py), and read back by the sweep's parent process for the closing summary and sweep.json
(launcher/sweep/summary.py's on_multirun_end).

Record keys: sweep_id (which sweep wrote it: a reused sweep directory may hold older points), num,
overrides, status (ok | invalid | no_fit | failed | queued | submitted | dry_run | completed), run_dir,
and as they apply: errors, warnings, reason, sp (sequence parallelism in effect), memory_bytes (a
rejected plan's total per GPU), job_id, final (the run's final status with wait=true).
"""

from __future__ import annotations

import json
import os
from typing import Any

from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import POINT_FILE, RunPaths


def point_path(run_dir: str) -> str:
    return RunPaths(run_dir).point


def write_point(run_dir: str, record: dict[str, Any]) -> None:
    """Replace the point's record (written whole, then renamed: a reader never sees half a file)."""
    os.makedirs(run_dir, exist_ok=True)
    write_atomic(point_path(run_dir), json.dumps(record, indent=2, default=str))


def read_point(run_dir: str) -> dict[str, Any]:
    with open(point_path(run_dir)) as f:
        return json.load(f)


def update_point(run_dir: str, **fields: Any) -> None:
    """Add or change fields of an existing record (a later stage of the same point); without a record
    (hydra.callbacks no longer has the sweep summary) there is nothing to update."""
    if not os.path.exists(point_path(run_dir)):
        return
    record = read_point(run_dir)
    record.update(fields)
    write_point(run_dir, record)


def read_points(sweep_dir: str, sweep_id: str) -> list[dict[str, Any]]:
    """Every record under sweep_dir written by sweep sweep_id, by point number.

    The points' directories are wherever hydra.sweep.subdir put them, so the tree is searched; a
    point's own directory (it holds point.json) is not searched further (checkpoints, logs)."""
    points = []
    for root, dirs, files in os.walk(sweep_dir):
        if POINT_FILE not in files:
            dirs.sort()
            continue
        dirs.clear()
        try:
            record = read_point(root)
        except (OSError, ValueError):  # not ours, or torn by a crash: not a point of this sweep
            continue
        if record.get("sweep_id") == sweep_id:
            points.append(record)
    points.sort(key=lambda r: (r.get("num") is None, r.get("num") or 0))
    return points
