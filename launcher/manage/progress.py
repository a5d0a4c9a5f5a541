"""The progress figures of `meshrun action=status`: step/total, ETA, last loss, tokens/s and the log path.

Read from the tail of metrics.jsonl (constant time whatever the run's length) and config.json; no Slurm query.
The ETA is the current attempt's own pace (wall time between its rows, so evaluation and checkpoint pauses
count) times the steps left, and is given only while the run is RUNNING.
"""

from __future__ import annotations

import json
from typing import Any

from training.contract.rundir.metrics import tail_rows
from training.contract.rundir.paths import RunPaths


def total_steps(run_dir: str) -> int | None:
    try:
        with open(RunPaths(run_dir).config) as f:
            return int(json.load(f)["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def seconds_per_step(rows: list[dict[str, Any]]) -> float | None:
    """The newest attempt's pace over its last rows: wall time between rows per step, or its step time."""
    if not rows:
        return None
    attempt = rows[-1].get("attempt")
    mine = [r for r in rows if r.get("attempt") == attempt and isinstance(r.get("time"), (int, float))][-50:]
    if len(mine) >= 2 and mine[-1]["step"] > mine[0]["step"]:
        return (mine[-1]["time"] - mine[0]["time"]) / (mine[-1]["step"] - mine[0]["step"])
    value = rows[-1].get("step_time_s")
    return float(value) if isinstance(value, (int, float)) else None


def progress_fields(run_dir: str, state: str, log: str | None) -> dict[str, Any]:
    """step, total_steps, eta_s (RUNNING only, else None), last_loss, tokens_per_s, log; {} for a directory
    without a readable config.json (not a run meshrun launched: there is no total to measure progress against)."""
    total = total_steps(run_dir)
    if total is None:
        return {}
    rows = tail_rows(run_dir)
    last = rows[-1] if rows else {}
    step = last.get("step")
    eta = None
    pace = seconds_per_step(rows)
    if state == "RUNNING" and step is not None and total is not None and pace is not None:
        eta = max(0.0, pace * (total - step))
    return {
        "step": step,
        "total_steps": total,
        "eta_s": eta,
        "last_loss": last.get("loss"),
        "tokens_per_s": last.get("tokens_per_s"),
        "log": log,
    }
