"""cluster.kind=slurm: the ranks run as a submitit job of the Slurm cluster (launcher/slurm/).

The backend launcher/launch/backend.py registers for `slurm`: a launch submits the job and returns, the run's
state is Slurm's state of its newest job, the logs are submitit's files of every job of the run, and a cancel
signals the job's steps (the epilogue records `cancelled` once the ranks have saved) or scancels a job that has not
started."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from launcher.plan.cluster_facts import SLURM
from launcher.records.readers import current_job_id, log_files, record_cancelled
from training.contract.config import Config

POLL_S = 1.0

NOT_STARTED = (None, "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED")
"""Slurm states of a job whose ranks have not started: a cancel scancels it at once."""


class SlurmBackend:
    facts = SLURM

    def checks(self, cfg: Config) -> list[str]:
        """sbatch safety, and every node count an elastic job may shrink to (validated before the first submission)."""
        from launcher.slurm.elastic import elastic_checks
        from launcher.slurm.sbatch import validate_for_slurm

        return validate_for_slurm(cfg) + elastic_checks(cfg)

    def submit(self, cfg: Config, run_dir: str, plan_result: dict[str, Any], multirun: bool, queue: bool) -> dict:
        from launcher.slurm.submit import submit

        return submit(cfg, run_dir, plan_result, multirun=multirun, queue=queue)

    def preflight(self, cfg: Config, run_dir: str) -> tuple[int, dict[str, Any]]:
        from launcher.launch.preflight import submit_slurm

        result = submit_slurm(cfg, run_dir)
        return result["exit_code"], result

    def states(self, runs: list[list[dict[str, Any]]]) -> dict[str, str]:
        from launcher.slurm.queries import slurm_states

        return slurm_states([j for j in (current_job_id(events) for events in runs) if j is not None])

    def state(
        self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str] | None
    ) -> tuple[str | None, str | None]:
        from launcher.slurm.queries import FINAL_STATES, slurm_end_reason, slurm_state

        job = current_job_id(events)
        if job is None:
            return None, None  # planned, not submitted yet
        state = states.get(job) if states is not None else slurm_state(job)
        last = events[-1] if events else {}
        if state is None:
            return "PENDING", None  # accepted by sbatch but not yet visible (sacct lags)
        if state == "PENDING" and last.get("event") == "requeued":
            return "REQUEUED", None
        if state in FINAL_STATES and states is None:
            # The job ended and meshrun wrote no end (scancel of the whole job, its batch script killed, a node
            # failure): Slurm's accounting says how. (A sweep's status asks Slurm once for all its points: not there.)
            return state, slurm_end_reason(job)
        return state, None

    def log_files(self, run_dir: str, rank: int, events: list[dict[str, Any]]) -> list[str]:
        return log_files(run_dir, rank, events)  # submitit's file of `rank` in each job of the run

    def cancel(self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str]) -> Any:
        job = current_job_id(events)
        if job is None:
            return None
        from training.contract.rundir.lock import release_job

        if states.get(job) in NOT_STARTED:
            problem = _scancel([job])
            release_job(run_dir, job)
            record_cancelled(
                run_dir,
                "cancelled by meshrun action=cancel before the job started"
                + (f" (scancel: {problem})" if problem else ""),
                job_id=job,
            )
            return None
        problem = _scancel(["--signal=USR2", job])  # the job's steps (the ranks); the batch script keeps running
        if problem:
            print(f"warning: scancel --signal=USR2 {job}: {problem}", file=sys.stderr)
        return job  # the epilogue records `cancelled` once the ranks have saved

    def cancel_wait(
        self, run_dir: str, handle: Any, timeout_s: float, deadline: float, ended: Callable[[str], bool]
    ) -> None:
        while time.time() < deadline and not ended(run_dir):
            time.sleep(POLL_S)
        if not ended(run_dir):
            _force(run_dir, handle, timeout_s)


def _scancel(args: list[str]) -> str:
    """ "" when scancel accepted, else its complaint."""
    from training.contract.slurm_env import SlurmUnavailable, slurm_command

    try:
        res = slurm_command(["scancel"] + args)
    except SlurmUnavailable as exc:
        return str(exc)
    return res.stderr.strip() if res.returncode != 0 else ""


def _force(run_dir: str, job: str, timeout_s: float) -> dict[str, Any]:
    from training.contract.rundir.lock import release_job

    _scancel([job])
    release_job(run_dir, job)
    return record_cancelled(
        run_dir,
        f"job {job} did not stop within cancel.timeout_s={timeout_s:g} s: scancel; "
        "the last complete checkpoint is kept",
        job_id=job,
        forced=True,
    )
