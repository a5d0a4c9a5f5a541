"""Reading run.dir/metrics.jsonl: the one reader (status, progress, report and calibrate read through it).
One JSON object per line, written by rank 0 (training/observe/metrics.py); a line torn by a crash mid-write is
skipped, never an error. Pure Python (launcher and ranks)."""

from __future__ import annotations

import json
import os
from typing import Any

from training.contract.rundir.events import well_formed
from training.contract.rundir.files import open_regular
from training.contract.rundir.paths import RunPaths

TAIL_BYTES = 65536
"""How much of the file's end tail_rows reads: many rows whatever the run's length, in constant time."""


def metrics_path(run_dir: str) -> str:
    return RunPaths(run_dir).metrics


def _rows(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line
        if well_formed(row):  # an object with numbers where numbers belong
            out.append(row)
    return out


def _read(path: str) -> list[dict[str, Any]]:
    """The rows of a regular file (a FIFO or a link to /dev/zero reads as none: it would block or never end; a
    line beyond training/contract/rundir/lines.py's MAX_LINE_BYTES is skipped without being read whole)."""
    from training.contract.rundir.lines import read_objects

    return [row for row in read_objects(path) if well_formed(row)]


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    """Every row of metrics.jsonl, oldest first ([] without the file)."""
    return _read(metrics_path(run_dir))


def read_purged_rows(run_dir: str) -> list[dict[str, Any]]:
    """Every row of metrics.purged.jsonl (steps a resume went back over), oldest first ([] without the file)."""
    return _read(RunPaths(run_dir).metrics_purged)


def tail_rows(run_dir: str, limit_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete step rows (an integer `step`) in the last limit_bytes of metrics.jsonl, oldest first."""
    try:
        with open_regular(metrics_path(run_dir), binary=True) as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    if size > limit_bytes:
        lines = lines[1:]  # the first line is cut
    return [row for row in _rows(lines) if isinstance(row.get("step"), int)]


def last_step(run_dir: str) -> int | None:
    """Step of the last complete row of metrics.jsonl; None without one."""
    rows = tail_rows(run_dir)
    return rows[-1]["step"] if rows else None
