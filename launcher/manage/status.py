"""`meshrun action=status run.dir=D`: one JSON object on stdout (state, job_id, attempt, last_step,
excluded_nodes; step, total_steps, eta_s, last_loss, tokens_per_s, log: launcher/manage/progress.py), from
events.jsonl, metrics.jsonl, checkpoints/latest and squeue/sacct; status.format=table prints a table instead. D may also be
a sweep directory (it holds sweep.json): then the object lists every point's status and counts the states.

The readers of a run's record it shares with logs, cancel and the Slurm driver are launcher/records/readers.py's;
Slurm's answers come from launcher/slurm/queries.py."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from launcher.launch.backend import backend_of_run, states_of
from launcher.manage.progress import progress_fields
from launcher.records import goodput
from launcher.records.readers import (
    cancelled_event,
    current_job_id,
    excluded_nodes,
    last_step,
)
from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.events import read_events
from training.contract.rundir.paths import CONFIG_FILE, EVENTS_FILE, SWEEP_FILE, RunPaths


def run_status(
    run_dir: str,
    states: dict[str, str] | None = None,
    events: list[dict[str, Any]] | None = None,
    allocations: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The status of one run; states: Slurm's states already asked for (a sweep asks once for all its jobs);
    allocations: Slurm's accounting of its jobs for the goodput (launcher/records/goodput.py sacct_records), likewise."""
    events = read_events(run_dir) if events is None else events
    backend = backend_of_run(run_dir, events)
    job = current_job_id(events)
    attempt = max((int(ev.get("attempt", 0)) for ev in events if ev.get("event") == "started"), default=None)
    state = None
    reason = None
    last = events[-1] if events else {}
    cancelled = cancelled_event(events)
    if last.get("event") == "completed":
        state = "COMPLETED"
    elif cancelled is not None:
        state, reason = "CANCELLED", cancelled.get("reason")
    elif last.get("event") == "stopped":
        state, reason = "FAILED", last.get("reason")
    else:  # the backend that launched it: the scheduler's state of its job, or the local launcher's events
        state, reason = backend.state(run_dir, events, states)
    log = backend.log_files(run_dir, 0, events)[-1]
    if log is not None and not os.path.exists(log):
        log = None  # never name a log that is not there
    if not events and log is None:  # planned (plan.json, config.json) and never launched: no job, no log yet
        state = "PLANNED"
    out = {
        "state": state or "UNKNOWN",
        "job_id": job if job is not None else (last.get("job_id") if last else None),
        "attempt": attempt,
        "last_step": last_step(run_dir),
        "excluded_nodes": excluded_nodes(events),
    }
    if reason:
        out["reason"] = reason
    out.update(progress_fields(run_dir, out["state"], log))
    current = current_layout(run_dir)
    if current is not None:
        out["layout"] = current
    out.update(in_job_fields(events))
    out.update(goodput_fields(run_dir, events, allocations))
    return out


def in_job_fields(events: list[dict[str, Any]]) -> dict[str, Any]:
    """With in-job restarts (cluster.max_in_job_restarts): the current allocation's idle spares and the in-job
    restarts it has used (launcher/slurm/in_job.py); {} otherwise."""
    started = [ev for ev in events if ev.get("event") == "started"]
    if not started or "spares" not in started[-1]:
        return {}
    last = started[-1]
    return {
        "spares_left": len(last.get("spares") or []),
        "spare_nodes": last.get("spares") or [],
        "in_job_restarts_used": int(last.get("in_job_restarts") or 0),
        "max_in_job_restarts": last.get("max_in_job_restarts"),
        "in_job_restarts_total": sum(1 for ev in events if ev.get("event") == "restarted_in_job"),
    }


def goodput_fields(
    run_dir: str, events: list[dict[str, Any]], allocations: dict[str, Any] | None = None
) -> dict[str, Any]:
    """goodput (productive / wall) and goodput_s (seconds per cause, launcher/records/goodput.py); {} before the first
    attempt."""
    if not any(ev.get("event") == "started" for ev in events):
        return {}
    g = goodput.run_goodput(run_dir, events, allocations)
    return {"goodput": g["goodput"], "goodput_s": goodput.summary(g)} if g else {}


def current_layout(run_dir: str) -> dict[str, Any] | None:
    """The layout the run trains with now (config.json, which an elastic resize rewrites: nodes, ranks, tp, pp,
    cp, dp, zero, micro/global batch, grad_accum); None without a readable config.json."""
    from training.contract.config import load_config
    from training.contract.layout_text import layout_fields

    try:
        return layout_fields(load_config(RunPaths(run_dir).config))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep_status(sweep_dir: str) -> dict[str, Any]:
    """Every point of a sweep: the run's status for launched points, SKIPPED with the reason for the
    points the sweep left out (invalid, did not fit, refused), and how many points are in each state."""
    with open(RunPaths(sweep_dir).sweep) as f:
        sweep = json.load(f)
    # One scheduler query for every job of the sweep (not one per point): a 1,000-point sweep answers as fast as one.
    events_of = {
        row["run_dir"]: read_events(row["run_dir"])
        for row in sweep.get("feasible", [])
        if row.get("run_dir") and os.path.exists(RunPaths(row["run_dir"]).events)
    }
    states = states_of(events_of)
    # One sacct call for every allocation of the sweep's runs (the goodput's queue wait).
    allocations = goodput.sacct_records(
        [ev.get("job_id") for evs in events_of.values() for ev in evs if ev.get("event") == "started"]
    )
    points = []
    for skipped, rows in ((False, sweep.get("feasible", [])), (True, sweep.get("infeasible", []))):
        for row in rows:
            point = {"num": row.get("num"), "overrides": row.get("overrides", [])}
            run_dir = row.get("run_dir")
            if skipped:
                point.update(state="SKIPPED", reason=row.get("reason", row.get("status", "")))
            elif run_dir in events_of:
                point.update(run_dir=run_dir, **run_status(run_dir, states, events_of[run_dir], allocations))
            else:  # an action=plan sweep: nothing was launched
                point.update(state="PLANNED" if row.get("status") == "ok" else "UNKNOWN", run_dir=run_dir)
            points.append(point)
    points.sort(key=lambda pt: (pt["num"] is None, pt["num"]))
    counts: dict[str, int] = {}  # points per state (not the Slurm states above)
    for point in points:
        counts[point["state"]] = counts.get(point["state"], 0) + 1
    out = {"sweep_dir": sweep_dir, "points": points, "states": counts}
    summed = goodput.total([pt.get("goodput_s") for pt in points])
    if summed is not None:
        out["goodput"] = summed["goodput"]
        out["goodput_s"] = summed
    return out


def _emit(status: dict[str, Any], fmt: str) -> None:
    if str(fmt) == "table":
        from launcher.manage.status_table import format_table

        print(format_table(status))
    else:
        print(json.dumps(status, sort_keys=True))


def print_status(run_dir: str, fmt: str = "json") -> dict[str, Any]:
    """Print exactly one JSON object on stdout (fmt="table": a table for people instead); an unknown run dir is
    an error on stderr (EXIT_INVALID)."""
    if os.path.exists(RunPaths(run_dir).sweep):
        out = sweep_status(run_dir)
        _emit(out, fmt)
        return out
    # Hydra has created run_dir (with its app.log) before this runs: a run is known by what meshrun wrote.
    if not any(os.path.exists(path) for path in (RunPaths(run_dir).events, RunPaths(run_dir).config)):
        print(
            f"error: run.dir={run_dir} is not a meshrun run directory (no {EVENTS_FILE} or {CONFIG_FILE}): "
            "give the run directory printed at launch or submission, or a sweep directory (it holds "
            f"{SWEEP_FILE})",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    status = run_status(run_dir)
    _emit(status, fmt)
    return status


def status_action(cfg, run_dir: str) -> dict[str, Any]:
    """action=status (the action table, launcher/cli/actions.py)."""
    return print_status(run_dir, cfg.status.format)
