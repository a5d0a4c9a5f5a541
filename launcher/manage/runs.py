"""`meshrun action=runs [runs.dir=runs]`: one line per run directory of a folder, newest first: state, step/total,
last loss, job id, age and the directory. The states are action=status's (launcher/manage/status.py), with one
Slurm query for all the runs' jobs; a directory with a plan and no launch is PLANNED."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from training.contract.config import Config
from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.events import read_events
from training.contract.rundir.paths import RunPaths

COLUMNS = ("state", "step", "loss", "job", "age", "run")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _run_dirs(folder: str) -> list[str]:
    """Run directories of folder (a config.json or plan.json inside), newest first; links (latest) skipped."""
    out = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if any(os.path.exists(f) for f in (RunPaths(path).config, RunPaths(path).plan)):
            out.append(path)
    return sorted(out, key=os.path.getmtime, reverse=True)


def _row(run_dir: str, status: dict[str, Any], now: float) -> list[str]:
    step = status.get("step", status.get("last_step"))
    total = status.get("total_steps")
    loss = status.get("last_loss")
    return [
        status["state"],
        f"{step if step is not None else '-'}/{total if total is not None else '?'}",
        f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
        str(status.get("job_id") or "-"),
        _age(now - os.path.getmtime(run_dir)),
        run_dir,
    ]


def list_runs(folder: str, states: dict[str, str] | None = None) -> list[list[str]]:
    """The rows of action=runs; states: Slurm's states of the runs' jobs, asked for once when None."""
    from launcher.manage.status import run_status
    from launcher.records.readers import current_job_id

    dirs = _run_dirs(folder)
    events = {d: read_events(d) for d in dirs}
    if states is None:
        jobs = [j for j in (current_job_id(ev) for ev in events.values()) if j not in (None, "local")]
        states = {}
        if jobs:
            from launcher.slurm.queries import slurm_states

            try:
                states = slurm_states([str(j) for j in jobs])
            except Exception:  # no Slurm here (a laptop listing a copied folder): states stay unknown
                states = {}
    now = time.time()
    rows = []
    for d in dirs:
        if not events[d]:
            from launcher.manage.progress import total_steps

            status: dict[str, Any] = {"state": "PLANNED", "job_id": None, "total_steps": total_steps(d)}
        else:
            status = run_status(d, states, events[d])
        rows.append(_row(d, status, now))
    return rows


def runs_action(cfg: Config, run_dir: str | None) -> dict[str, Any]:
    folder = cfg.runs.dir
    if not os.path.lexists(folder):  # a first hour: nothing trained yet is not an error
        print(f"no runs in {folder} yet (a launch writes its run directory there; runs.dir=D lists another folder)")
        return {"runs": 0}
    if not os.path.isdir(folder):
        print(
            f"error: runs.dir={folder!r} is not a folder; fix: meshrun action=runs runs.dir=runs (the folder that holds the run directories)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    rows = list_runs(folder)
    if not rows:
        print(f"no runs in {folder} (a run directory holds config.json or plan.json)")
        return {"runs": 0}
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(COLUMNS)]
    for line in [list(COLUMNS)] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    return {"runs": len(rows)}
