"""Issue 46 on the dev cluster: every kill survived or told. Each fault lands at a known step of a known attempt
(tests/helpers/faults.py: the ranks kill themselves there, or wait there while the test acts from outside), and each
run ends resumed with every step once and the uninterrupted run's losses, or in the documented final state with a
reason (docs/USER_CONTRACTS.md "Slurm behaviour", "What each kill ends in")."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from helpers.faults import faults_env, reference, start_reference, wait_held
from helpers.slurm import COMMON, STEPS, meshrun, metrics, submit, wait_final

from launcher.manage.status import run_status
from training.contract.rundir.events import read_events

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module", autouse=True)
def _reference(tmp_path_factory, cluster):
    start_reference(tmp_path_factory, *COMMON)  # runs beside the module's first Slurm job


def same_losses(run_dir, steps=STEPS):
    losses = metrics(run_dir)  # asserts no step ran twice
    assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)
    want = reference(*COMMON)
    for step, loss in want.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_a_rank_killed_after_a_preemption_requeue_is_blamed_and_its_node_excluded(tmp_path, cluster):
    """Attempt 0 is preempted (USR2 while every rank waits before its second step) and requeued; in the requeued
    attempt (warm-started ranks, resumed from the stop's checkpoint) rank 2 is SIGKILLed before its second step. The `failed` event blames
    rank 2 and its node, killed by SIGKILL, with the peers' errors as consequences; the resubmission excludes
    that node and the run completes with the uninterrupted losses."""
    env = faults_env(tmp_path, {0: {"kind": "preempt", "rank": 0}, 1: {"kind": "kill_step", "rank": 2}})
    run_dir = tmp_path / "run"
    job = submit(run_dir, env=env)
    wait_held(env, 0, range(4))
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    status = wait_final(run_dir, timeout=300)
    events = read_events(str(run_dir))
    starts = [e for e in events if e["event"] == "started"]
    assert status["state"] == "COMPLETED" and len(starts) == 3, events
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [e["cause"] for e in requeued] == ["stopped_early", "failure"], requeued
    failed = [e for e in events if e["event"] == "failed"]
    node = starts[1]["nodes"][1]  # ranks 2 and 3 run on the attempt's second node
    assert len(failed) == 1 and failed[0]["attempt"] == 1 and failed[0]["rank"] == 2, failed
    assert failed[0]["node"] == node and failed[0]["exit_code"] == -9, failed
    assert failed[0]["reason"].startswith("killed by SIGKILL"), failed
    assert 2 not in failed[0]["consequences"] and set(failed[0]["consequences"]) <= {0, 1, 3}, failed
    assert os.path.exists(os.path.join(env["FAULTS_DIR"], "killed_1_2"))
    rec = json.load(open(run_dir / "slurm" / "attempt_1" / "rank_2.json"))
    assert rec["start"] == "warm", rec  # the requeued attempt's rank was forked by its node's warm agent
    assert requeued[1]["excluded_nodes"] == [node] and node not in starts[2]["nodes"], (requeued, starts)
    assert status["excluded_nodes"] == [node] and status["job_id"] == requeued[1]["new_job_id"]
    sig = [e for e in events if e["event"] == "signal"]
    assert starts[1]["job_id"] == job and sig and starts[1]["resume_step"] == sig[0]["step"], (starts, sig)
    same_losses(run_dir)


def _sacct_state(job, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True
        ).stdout.split()
        if out and out[0] not in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"):
            return " ".join(out)
        time.sleep(1)
    raise AssertionError(f"job {job} not ended in sacct within {timeout} s")


def test_a_killed_batch_script_requeues_and_a_cancelled_job_ends_cancelled_with_a_reason(tmp_path, cluster):
    """One job, two kills while every rank waits before its attempt's second step. `scancel --signal=KILL --batch`
    kills the batch script alone (srun and the ranks go on until Slurm ends the job): the early epilogue sees its
    input close without srun's status, records `failed` naming it and requeues the job (a retry), which resumes.
    Then `scancel` of the whole job (which has --requeue): the run ends CANCELLED (Slurm's word, by the user), not
    requeued, and status gives Slurm's accounting as the reason. Before, the batch kill left the job FAILED with no
    event and status no reason."""
    env = faults_env(tmp_path, {0: {"kind": "batch_kill", "rank": 0}, 1: {"kind": "cancel", "rank": 0}})
    run_dir = tmp_path / "run"
    job = submit(run_dir, env=env)
    wait_held(env, 0, range(4))
    subprocess.run(["scancel", "--signal=KILL", "--batch", job], check=True)
    wait_held(env, 1, range(4))
    events = read_events(str(run_dir))
    failed = [e for e in events if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["attempt"] == 0 and failed[0]["rank"] == -1, events
    assert "scancel --signal=KILL --batch" in failed[0]["reason"], failed
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [(e["cause"], e["retry"]) for e in requeued] == [("failure", 1)], requeued
    starts = [e for e in events if e["event"] == "started"]
    assert [e["job_id"] for e in starts] == [job, job], starts  # the same job, requeued
    subprocess.run(["scancel", job], check=True)
    assert _sacct_state(job).startswith("CANCELLED"), job
    time.sleep(8)  # a requeue (there must be none) would be back within this time on the dev cluster
    status = run_status(str(run_dir))
    assert status["state"] == "CANCELLED", status
    assert status["reason"].startswith(f"Slurm ended job {job} as CANCELLED by "), status
    assert len([e for e in read_events(str(run_dir)) if e["event"] == "started"]) == 2
    out = meshrun("action=status", f"run.dir={run_dir}")
    assert json.loads(out.stdout)["reason"] == status["reason"], out.stdout
    losses = metrics(run_dir)  # no step twice, and every step so far the uninterrupted run's
    assert sorted(losses) == list(range(1, max(losses) + 1)), sorted(losses)
    want = reference(*COMMON)
    for step, loss in losses.items():
        assert loss == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
