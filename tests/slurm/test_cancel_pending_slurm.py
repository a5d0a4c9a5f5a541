"""`meshrun action=cancel` on Slurm jobs that have not started (launcher/manage/cancel.py): a run whose job is pending
(sbatch --begin an hour away) and a sweep whose job array is pending are cancelled at once, without waiting
for cancel.timeout_s: each run gets its `cancelled` event naming the job, the job leaves Slurm's queue, and
the run lock is released so the directory can be launched again."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from helpers.slurm import meshrun

from launcher.slurm.queries import job_alive
from training.contract.rundir.events import read_events
from training.contract.rundir.lock import read_holder

pytestmark = pytest.mark.slurm

PENDING = [
    "cluster=slurm_dev",
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "model=tiny",
    "data=synthetic",
    "parallel.tp=1",
    "parallel.sp=false",
    "parallel.zero=0",
    "parallel.global_batch=4",
    "train.steps=4",
    "+cluster.sbatch_extra.begin=now+3600",
]


def _state(job: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-r", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60
    ).stdout.split()


def _assert_cancelled_before_start(run_dir, job: str) -> None:
    (ev,) = [e for e in read_events(str(run_dir)) if e["event"] == "cancelled"]
    assert ev["job_id"] == job and "before the job started" in ev["reason"] and not ev.get("forced"), ev
    assert not [e for e in read_events(str(run_dir)) if e["event"] == "started"]
    assert read_holder(str(run_dir)).get("released"), read_holder(str(run_dir))


def test_cancel_of_a_pending_job_is_immediate_and_releases_the_run(tmp_path, cluster, slurm_jobs):
    run_dir = tmp_path / "run"
    res = meshrun(*PENDING, f"run.dir={run_dir}")
    assert res.returncode == 0, res.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    slurm_jobs.append(job)
    assert _state(job) == ["PENDING"]
    res = meshrun("action=cancel", f"run.dir={run_dir}", "cancel.timeout_s=600", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert job_alive(job) is False and _state(job) in ([], ["CANCELLED"])
    _assert_cancelled_before_start(run_dir, job)
    again = meshrun("action=plan", f"run.dir={run_dir}")  # the directory is free again
    assert again.returncode == 0, again.stderr[-2000:]


def test_cancel_of_a_pending_sweep_cancels_every_point(tmp_path, cluster, slurm_jobs):
    sweep_dir = tmp_path / "sweep"
    res = meshrun("-m", *PENDING, "parallel.micro_batch=1,2", f"hydra.sweep.dir={sweep_dir}", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    points = re.findall(r"submitted Slurm job (\d+_\d+); run dir (\S+)", res.stdout)
    slurm_jobs.extend(sorted({job.split("_")[0] for job, _ in points}))
    assert len(points) == 2, res.stdout
    assert json.loads((sweep_dir / "sweep.json").read_text())["feasible"]
    res = meshrun("action=cancel", f"run.dir={sweep_dir}", "cancel.timeout_s=600", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for job, run_dir in points:
        assert job_alive(job) is False, job
        _assert_cancelled_before_start(run_dir, job)
