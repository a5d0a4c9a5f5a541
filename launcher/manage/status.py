"""`meshrun action=status run.dir=D`: one JSON object on stdout (state, job_id, attempt, last_step,
excluded_nodes; step, total_steps, eta_s, last_loss, tokens_per_s, log: launcher/manage/progress.py), from
events.jsonl, metrics.jsonl, checkpoints/latest and squeue/sacct; status.format=table prints a table instead. D may also be
a sweep directory (it holds sweep.json): then the object lists every point's status and counts the states.

The run-directory readers it shares with logs, cancel and the Slurm driver are in launcher/manage/run_state.py, the
Slurm queries in launcher/slurm/queries.py."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

from launcher.manage.run_state import SWEEP_FILE, current_job_id, run_status
from launcher.slurm.queries import slurm_states
from training.contract.rundir.events import EVENTS_FILE, read_events
from training.contract.exit_codes import EXIT_INVALID


def sweep_status(sweep_dir: str) -> Dict[str, Any]:
    """Every point of a sweep: the run's status for launched points, SKIPPED with the reason for the
    points the sweep left out (invalid, did not fit, refused), and how many points are in each state."""
    with open(os.path.join(sweep_dir, SWEEP_FILE)) as f:
        sweep = json.load(f)
    # One Slurm query for every job of the sweep (not one per point): a 1,000-point sweep answers as fast as one.
    events_of = {row["run_dir"]: read_events(row["run_dir"]) for row in sweep.get("feasible", [])
                 if row.get("run_dir") and os.path.exists(os.path.join(row["run_dir"], EVENTS_FILE))}
    states = slurm_states([j for j in (current_job_id(evs) for evs in events_of.values()) if j is not None])
    points = []
    for skipped, rows in ((False, sweep.get("feasible", [])), (True, sweep.get("infeasible", []))):
        for row in rows:
            point = {"num": row.get("num"), "overrides": row.get("overrides", [])}
            run_dir = row.get("run_dir")
            if skipped:
                point.update(state="SKIPPED", reason=row.get("reason", row.get("status", "")))
            elif run_dir in events_of:
                point.update(run_dir=run_dir, **run_status(run_dir, states, events_of[run_dir]))
            else:  # an action=plan sweep: nothing was launched
                point.update(state="PLANNED" if row.get("status") == "ok" else "UNKNOWN", run_dir=run_dir)
            points.append(point)
    points.sort(key=lambda pt: (pt["num"] is None, pt["num"]))
    counts: Dict[str, int] = {}  # points per state (not the Slurm states above)
    for point in points:
        counts[point["state"]] = counts.get(point["state"], 0) + 1
    return {"sweep_dir": sweep_dir, "points": points, "states": counts}


def _emit(status: Dict[str, Any], fmt: str) -> None:
    if str(fmt) == "table":
        from launcher.manage.status_table import format_table

        print(format_table(status))
    else:
        print(json.dumps(status, sort_keys=True))


def print_status(run_dir: str, fmt: str = "json") -> Dict[str, Any]:
    """Print exactly one JSON object on stdout (fmt="table": a table for people instead); an unknown run dir is
    an error on stderr (EXIT_INVALID)."""
    if os.path.exists(os.path.join(run_dir, SWEEP_FILE)):
        out = sweep_status(run_dir)
        _emit(out, fmt)
        return out
    # Hydra has created run_dir (with its app.log) before this runs: a run is known by what meshrun wrote.
    if not any(os.path.exists(os.path.join(run_dir, name)) for name in (EVENTS_FILE, "config.json")):
        print(f"error: run.dir={run_dir} is not a meshrun run directory (no {EVENTS_FILE} or config.json): "
              "give the run directory printed at launch or submission, or a sweep directory (it holds "
              f"{SWEEP_FILE})", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    status = run_status(run_dir)
    _emit(status, fmt)
    return status
