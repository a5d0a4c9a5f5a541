"""`meshrun action=logs`, `action=cancel` and a sweep's status on the real dev Slurm cluster
(slurm/dev-cluster.sh): a cancelled job saves a complete checkpoint, is not requeued, and status says CANCELLED;
the logs are submitit's files of the run's job; a sweep's status asks Slurm once for all its jobs.
Skipped, with the reason, when the cluster cannot run here (the fixture of tests/slurm/test_slurm_cluster.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers.slurm import ROOT, meshrun

from launcher.manage import status as status_mod
from launcher.slurm import queries as slurm_queries
from training.checkpoint.storage import step_dir, verify
from training.contract.rundir.events import read_events

pytestmark = pytest.mark.slurm

ONE_NODE = [
    "cluster=slurm_dev",
    "cluster.nodes=1",
    "cluster.gpus_per_node=2",
    "parallel.tp=2",
    "parallel.pp=1",
    "data=synthetic",
    "model.num_layers=2",
    "model.seq_length=32",
    "parallel.global_batch=2",
    "parallel.micro_batch=1",
    "train.steps=100000",
    "+cluster.env.MESHRUN_PACE_STEP_S=2",  # a run that waits to be cancelled idles instead of spinning the shared cores
    "train.progress_every_s=1",
    "cluster.preflight.mode=off",
]


def _wait(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout} s")


def _ended_records(job: str):
    """The states of every accounting record of the job (requeued instances included), once the last one
    has ended; None while it has not."""
    res = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job], capture_output=True, text=True, timeout=30
    )
    states = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    ended = states and states[-1] not in ("PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING")
    return states if ended else None


def _logged_steps(run_dir) -> int:
    path = os.path.join(str(run_dir), "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return len([line for line in open(path) if line.strip()])


def test_logs_then_cancel_saves_a_complete_checkpoint_and_never_requeues(tmp_path, cluster):
    run = tmp_path / "run"
    res = meshrun(*ONE_NODE, f"run.dir={run}")
    assert res.returncode == 0, res.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    try:
        _wait(lambda: _logged_steps(run) >= 2, 300, "two logged steps")
        running = json.loads(meshrun("action=status", f"run.dir={run}").stdout)
        log0 = os.path.join(str(run), "submitit", f"{job}_0_log.out")
        assert running["state"] == "RUNNING" and running["log"] == log0 and running["step"] >= 2

        logs = meshrun("action=logs", f"run.dir={run}")
        assert logs.returncode == 0 and logs.stdout.startswith(f"==> {log0} <==")
        assert "/100000 " in logs.stdout and "left]" in logs.stdout  # the timed progress lines of rank 0
        rank1 = meshrun("action=logs", f"run.dir={run}", "logs.rank=1")
        assert rank1.stdout.startswith(f"==> {os.path.join(str(run), 'submitit', f'{job}_1_log.out')} <==")
        follow = subprocess.Popen(
            [sys.executable, "-m", "launcher", "action=logs", f"run.dir={run}", "logs.follow=true"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        cancel = meshrun("action=cancel", f"run.dir={run}", timeout=400)
        assert cancel.returncode == 0, cancel.stderr[-3000:]
        assert json.loads(cancel.stdout) == {str(run): "CANCELLED"}
        followed, _ = follow.communicate(timeout=120)  # following ends with the run
    finally:
        subprocess.run(["scancel", job], capture_output=True)  # a failed test leaves no job behind
    events = read_events(str(run))
    cancelled = [e for e in events if e["event"] == "cancelled"]
    assert len(cancelled) == 1 and not cancelled[0].get("forced"), cancelled
    assert cancelled[0]["job_id"] == job  # recorded by the job's own epilogue
    step = cancelled[0]["checkpoint_step"]
    assert any(e["event"] == "checkpoint" and e["step"] == step and e["reason"] == "SIGUSR2" for e in events)
    assert verify(step_dir(str(run), step)).ok
    assert not any(e["event"] == "requeued" for e in events)
    # Not requeued: the job has left the queue for good, and Slurm's accounting holds one record of it, ended
    # (a requeue would have left a REQUEUED record before the last one: sacct --duplicates lists each).
    _wait(lambda: slurm_queries.job_alive(job) is False, 120, "the job to leave the queue")
    records = _wait(lambda: _ended_records(job), 120, "Slurm's accounting to record the job's end")
    assert len(records) == 1 and records[0] != "REQUEUED", records
    assert not any(e["event"] in ("requeued", "started") for e in read_events(str(run))[len(events) :])
    final = json.loads(meshrun("action=status", f"run.dir={run}").stdout)
    assert final["state"] == "CANCELLED" and final["eta_s"] is None
    assert "SIGUSR2 received" in followed
    # Slurm's accounting agrees that nothing failed (it said FAILED 3:0 beside meshrun's CANCELLED).
    acct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"], capture_output=True, text=True, timeout=60
    ).stdout.split()
    assert acct and acct[0] == "COMPLETED|0:0", acct


def test_a_sweeps_status_asks_slurm_once_for_all_its_points(tmp_path, cluster):
    """200 points, each a run of a real job of this cluster: at most two Slurm calls (squeue, then sacct for the
    jobs that have left the queue), and every point's state is the one Slurm gives for its job alone."""
    res = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-S", "now-7days", "-o", "JobID"], capture_output=True, text=True, timeout=60
    )
    jobs = [j for j in res.stdout.split() if j][-10:]
    if not jobs:
        pytest.skip("the dev Slurm cluster has run no job yet: nothing to ask sacct about")
    feasible = []
    for num in range(200):
        run_dir = tmp_path / str(num)
        run_dir.mkdir()
        job = jobs[num % len(jobs)]
        with open(run_dir / "events.jsonl", "w") as f:
            f.write(json.dumps({"event": "submitted", "job_id": job, "time": time.time(), "attempt": 0}) + "\n")
        feasible.append({"num": num, "overrides": [f"train.seed={num}"], "run_dir": str(run_dir), "status": "ok"})
    (tmp_path / "sweep.json").write_text(json.dumps({"feasible": feasible, "infeasible": []}))
    before = slurm_queries.SLURM_QUERIES[0]
    t0 = time.time()
    out = status_mod.sweep_status(str(tmp_path))
    elapsed = time.time() - t0
    assert slurm_queries.SLURM_QUERIES[0] - before <= 2
    expected = {job: slurm_queries.slurm_state(job) for job in jobs}
    assert [p["state"] for p in out["points"]] == [expected[jobs[n % len(jobs)]] or "PENDING" for n in range(200)]
    assert elapsed < 30, f"200 points took {elapsed:.1f} s"
