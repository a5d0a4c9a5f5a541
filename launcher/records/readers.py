"""The readers of a run's record that status, logs, cancel, both launchers and the Slurm driver share: the last
step (metrics.jsonl, checkpoints/latest), the job chain in events.jsonl, the cancel mark, where each rank's log
is; and the `cancelled` event every canceller writes."""

from __future__ import annotations

import json
import os
from typing import Any

from training.checkpoint.storage import read_latest
from training.contract.rundir.events import append_event, read_events
from training.contract.rundir.metrics import last_step as metrics_last_step
from training.contract.rundir.paths import RunPaths


def last_metrics_step(run_dir: str) -> int | None:
    """Step of the last complete line of metrics.jsonl."""
    return metrics_last_step(run_dir)


def last_step(run_dir: str) -> int | None:
    steps = [s for s in (last_metrics_step(run_dir), read_latest(run_dir)) if s is not None]
    return max(steps) if steps else None


def current_job_id(events: list[dict[str, Any]]) -> str | None:
    """The newest Slurm job of the run: the last submitted or resubmitted one."""
    job = None
    for ev in events:
        if ev.get("event") == "submitted" and ev.get("job_id") not in (None, "local"):
            job = str(ev["job_id"])
        if ev.get("event") == "requeued" and ev.get("new_job_id"):
            job = str(ev["new_job_id"])
    return job


def job_log_dir(run_dir: str, job: str) -> str:
    """Where submitit keeps a job's logs: recorded at submission (a sweep's job array shares the sweep's
    folder); a resubmitted job's are in run_dir/submitit."""
    for ev in read_events(run_dir):
        if ev.get("event") == "submitted" and str(ev.get("job_id")) == job and ev.get("log_dir"):
            return str(ev["log_dir"])
    return RunPaths(run_dir).submitit


def job_log(run_dir: str, job: str, rank: int = 0) -> str:
    """The file submitit writes `rank`'s output to in Slurm job `job` (it may not exist yet)."""
    return os.path.join(job_log_dir(run_dir, job), f"{job}_{rank}_log.out")


def excluded_nodes(events: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for ev in events:
        if ev.get("event") in ("submitted", "requeued") and "excluded_nodes" in ev:
            out = list(ev["excluded_nodes"])
    return out


RETRY_CAUSES = ("failure", "no_progress", "save_failed")
"""Requeue causes that spend one of cluster.max_retries: a failure, a stop that saved nothing newer than the
previous attempt (else a job stopped by every signal before its first save would requeue forever), a save
that failed on an I/O error. A stop after new progress (preemption, time limit) costs nothing."""


def retries_used(events: list[dict[str, Any]]) -> int:
    """Requeues and resubmissions that count against cluster.max_retries so far (RETRY_CAUSES)."""
    return sum(1 for ev in events if ev.get("event") == "requeued" and ev.get("cause") in RETRY_CAUSES)


def _launches(events: list[dict[str, Any]]) -> list[float]:
    """Times of the launches of the run directory (submission, or a local launcher's start)."""
    return [
        float(ev.get("time", 0))
        for ev in events
        if ev.get("event") == "submitted" or (ev.get("event") == "started" and "launcher_pid" in ev)
    ]


def cancel_requested(run_dir: str, events: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The cancel mark when it applies to the current launch (written after it), else None."""
    try:
        with open(RunPaths(run_dir).cancel) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    events = read_events(run_dir) if events is None else events
    launches = _launches(events)
    if not isinstance(mark, dict) or (launches and float(mark.get("time", 0)) < max(launches)):
        return None
    return mark


def cancelled_event(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `cancelled` event of the current launch (none after the last launch: None)."""
    launches = _launches(events)
    latest = max(launches) if launches else 0.0
    found = None
    for ev in events:
        if ev.get("event") == "cancelled" and float(ev.get("time", 0)) >= latest:
            found = ev
    return found


def record_cancelled(run_dir: str, reason: str, **fields: Any) -> dict[str, Any]:
    """The `cancelled` event, with the checkpoint the run can resume from (checkpoints/latest)."""
    return append_event(run_dir, "cancelled", reason=reason, checkpoint_step=read_latest(run_dir), **fields)


def slurm_jobs(events: list[dict]) -> list[str]:
    """Every Slurm job of the run, oldest first (submitted, then each resubmission)."""
    jobs: list[str] = []
    for ev in events:
        job = None
        if ev.get("event") == "submitted" and ev.get("job_id") not in (None, "local"):
            job = str(ev["job_id"])
        elif ev.get("event") == "requeued" and ev.get("new_job_id"):
            job = str(ev["new_job_id"])
        if job and job not in jobs:
            jobs.append(job)
    return jobs


def log_files(run_dir: str, rank: int = 0, events: list[dict] | None = None) -> list[str]:
    """The files that hold `rank`'s output, oldest first (they may not exist yet)."""
    events = read_events(run_dir) if events is None else events
    jobs = slurm_jobs(events)
    if not jobs:
        return [RunPaths(run_dir).rank_log(rank)]
    return [job_log(run_dir, job, rank) for job in jobs]


def current_log(run_dir: str, rank: int = 0, events: list[dict] | None = None) -> str:
    """The file rank's output goes to now (the newest attempt)."""
    return log_files(run_dir, rank, events)[-1]
