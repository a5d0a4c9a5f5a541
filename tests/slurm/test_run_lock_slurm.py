"""The Slurm side of the run lock (training/contract/rundir/lock.py, asked through launcher/slurm/queries.py's job_alive):

- a lock that names a Slurm job still in the queue (held, pending) refuses a launch and an attempt of another
  job, naming the job and `scancel`; once that job has left the queue (a real job of the dev cluster that
  ended), a launch takes the directory over and says so in a `lock_taken_over` event, and so does another
  job's prologue (claim_for_job);
- when Slurm cannot answer (no client on PATH, or a client without a configuration), the job is counted as
  alive: the launch is refused and the message says Slurm could not be asked;
- a rank holds the directory only with its own launcher's token or as a rank of the holding job: a foreign
  token, or a rank of another job, gets the message to exit with.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from launcher.slurm import queries
from launcher.slurm.queries import job_alive
from training.contract.rundir import lock as run_lock
from training.contract.rundir.events import read_events


def _sbatch(*args: str) -> str:
    res = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=debug",
            "--nodes=1",
            "--ntasks=1",
            "--time=2",
            "--output=/dev/null",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.3)


def test_a_queued_holder_refuses_and_one_that_left_the_queue_is_taken_over(tmp_path, cluster, slurm_jobs):
    held = _sbatch("--hold", "--wrap", "sleep 60")  # pending (held) for as long as the test needs it
    slurm_jobs.append(held)
    ended = _sbatch("--wrap", "true")
    slurm_jobs.append(ended)
    _wait(lambda: job_alive(ended) is False, 120, f"end of job {ended}")
    assert job_alive(held) is True

    # A launch beside a job that is still queued: refused, naming the job and the fix.
    busy = str(tmp_path / "busy")
    os.makedirs(busy)
    run_lock.set_job_holder(busy, held)
    with pytest.raises(run_lock.RunLocked) as exc:
        run_lock.acquire(busy, job_alive=job_alive)
    assert f"Slurm job {held}" in str(exc.value) and f"scancel {held}" in str(exc.value)
    assert "could not be asked" not in str(exc.value)
    # Another job's attempt waits for it (here not at all) and is then refused the same way.
    message = run_lock.claim_for_job(busy, "999999", job_alive=job_alive, wait_s=0)
    assert f"Slurm job {held}" in message
    assert run_lock.read_holder(busy)["job_id"] == held and not read_events(busy)

    # The holder has left the queue: a launch takes the directory over, with the reason in an event.
    launch = str(tmp_path / "launch")
    os.makedirs(launch)
    run_lock.set_job_holder(launch, ended)
    lock = run_lock.acquire(launch, job_alive=job_alive)
    try:
        holder = run_lock.read_holder(launch)
        assert holder["kind"] == "local" and holder["pid"] == os.getpid()
    finally:
        lock.release()
    (taken,) = [e for e in read_events(launch) if e["event"] == "lock_taken_over"]
    assert taken["previous_holder"] == f"Slurm job {ended}" and taken["reason"] == "the job has left Slurm's queue"

    # ... and so does another job's prologue.
    attempt = str(tmp_path / "attempt")
    os.makedirs(attempt)
    run_lock.set_job_holder(attempt, ended)
    assert run_lock.claim_for_job(attempt, "424242", job_alive=job_alive, wait_s=0) == ""
    assert run_lock.read_holder(attempt)["job_id"] == "424242"
    (taken,) = [e for e in read_events(attempt) if e["event"] == "lock_taken_over"]
    assert taken["previous_holder"] == f"Slurm job {ended}"


# Without a configuration the real squeue searches for a controller for about a minute, so it never answers
# within slurm_command's timeout: that timeout is cut to QUERY_TIMEOUT_S here (three queries of 20 s each cost
# a minute before), the same path (SlurmUnavailable -> "could not be asked").
QUERY_TIMEOUT_S = 2.0


@pytest.mark.parametrize("unreachable", ["no_client", "no_configuration"])
def test_slurm_that_cannot_answer_counts_the_holder_as_alive(tmp_path, monkeypatch, unreachable):
    if unreachable == "no_client":
        monkeypatch.setenv("PATH", str(tmp_path))  # no squeue at all
    else:
        monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing" / "slurm.conf"))
        real = queries.slurm_command
        calls = []

        def short(cmd, timeout=QUERY_TIMEOUT_S):
            calls.append(cmd[0])
            return real(cmd, timeout=min(timeout, QUERY_TIMEOUT_S))

        monkeypatch.setattr(queries, "slurm_command", short)
    assert job_alive("12345") is None
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    run_lock.set_job_holder(run_dir, "12345")
    with pytest.raises(run_lock.RunLocked) as exc:
        run_lock.acquire(run_dir, job_alive=job_alive)
    assert "Slurm job 12345 (Slurm could not be asked whether it still runs)" in str(exc.value)
    assert "scancel 12345" in str(exc.value)
    assert run_lock.read_holder(run_dir)["job_id"] == "12345" and not read_events(run_dir)
    # An attempt of another job is refused too (a lock it cannot prove free stays with its holder).
    assert "Slurm job 12345" in run_lock.claim_for_job(run_dir, "777", job_alive=job_alive, wait_s=0)
    if unreachable == "no_configuration":
        assert calls and set(calls) == {"squeue"}  # the real client was asked each time


def test_a_rank_with_a_foreign_token_or_of_another_job_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    lock = run_lock.acquire(run_dir)  # a local launcher holds it: its ranks carry its token
    try:
        assert run_lock.check_rank(run_dir, None, {run_lock.TOKEN_ENV: lock.token}) is None
        message = run_lock.check_rank(run_dir, None, {run_lock.TOKEN_ENV: "f" * 32})
        assert message and "(not this rank's launcher)" in message
        assert f"pid {os.getpid()}" in message
    finally:
        lock.release()
    run_lock.set_job_holder(run_dir, "5001")  # a Slurm job holds it between attempts
    assert run_lock.check_rank(run_dir, "5001", {}) is None
    message = run_lock.check_rank(run_dir, "5002", {})
    assert message and "Slurm job 5001" in message and "scancel 5001" in message
