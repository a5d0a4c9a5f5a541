"""Stops of a local run with `train.checkpointing=false` (issue 46, the tests audit's D1): action=cancel, SIGINT,
SIGTERM and SIGHUP to the launcher, and SIGUSR2 (Slurm's preemption warning) to one rank of two each end the run
at the next step boundary, with no checkpoint and no `forced` kill: exit 3 for cancel and a rank's signal, 130
for a signal to the launcher (docs/USER_CONTRACTS.md, *Exit codes*). Nothing claims a checkpoint or prints a
resume hint: the messages say that no checkpoint was written. A second signal to the launcher stops ranks that
do not stop at once (here: ranks that ignore SIGUSR2), with checkpointing on or off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import ROOT
from helpers.cli import meshrun
from helpers.local_run import PYTHON, TINY_RUN, wait_for

NO_CHECKPOINTS = [
    *TINY_RUN,
    "cluster.peak_tflops=1",
    "cluster.warm_start=false",  # cold ranks: /proc/PID/environ names each rank
    "train.checkpointing=false",
    "train.steps=100000",
    "+cluster.env.MESHRUN_PACE_STEP_S=0.5",  # runs until stopped: idles instead of spinning the shared cores
]
TIMEOUT_S = 120
"""cancel.timeout_s: far above a step, so a stop that only the timeout ends shows as `forced` (and slow)."""
NOTHING_TO_RESUME = "no checkpoint was written (train.checkpointing=false): nothing to resume"


def _launch(run, cwd, *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "launcher", f"run.dir={run}", *NO_CHECKPOINTS, f"cancel.timeout_s={TIMEOUT_S}", *extra],
        cwd=str(cwd),
        env=env or dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ranks(launch: subprocess.Popen, world: int) -> dict:
    """rank -> pid, once every rank catches the stop signals and step 1 is in metrics.jsonl."""
    from launcher.launch.local_backend import rank_pids
    from launcher.ranks.exits import catches

    def ready():
        assert launch.poll() is None, launch.communicate()[1][-3000:]
        out = {}
        for pid in rank_pids(launch.pid):
            if not (catches(pid, signal.SIGUSR2) and catches(pid, signal.SIGTERM)):
                return None
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                return None
            out[int(env[b"RANK"])] = pid
        return out if len(out) == world else None

    return wait_for(ready, 240, "the ranks to install their stop handlers")


def _wait_step(run, step: int = 1) -> None:
    def at():
        try:
            return any(
                json.loads(line).get("step", 0) >= step
                for line in (run / "metrics.jsonl").read_text().split("\n")
                if line.strip()
            )
        except (OSError, ValueError):
            return False

    wait_for(at, 240, f"step {step} in metrics.jsonl")


def _events(run) -> list:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


def _assert_stopped_without_checkpoint(run, err: str) -> dict:
    events = _events(run)
    (signalled,) = [e for e in events if e["event"] == "signal"]
    assert signalled["checkpoint"] is False and signalled["step"] >= 1, signalled
    assert not (run / "checkpoints").exists()
    assert not [e for e in events if e["event"] == "checkpoint"]
    # The run stopped at the boundary the ranks agreed on: no step after the signal's.
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(steps) == signalled["step"], (steps, signalled)
    assert "Resume with" not in err and "Traceback" not in err, err[-3000:]
    assert "Traceback" not in (run / "logs" / "rank_0.log").read_text()
    return signalled


@pytest.mark.slow
def test_cancel_stops_a_run_without_checkpoints_at_the_step_boundary(tmp_path):
    run = tmp_path / "run"
    launch = _launch(run, tmp_path)
    try:
        _ranks(launch, 1)
        _wait_step(run)
        t0 = time.monotonic()
        res = meshrun("action=cancel", f"run.dir={run}", f"cancel.timeout_s={TIMEOUT_S}", cwd=str(tmp_path))
        took = time.monotonic() - t0
        assert res.returncode == 0, res.stderr
        _, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 3, err[-3000:]  # EXIT_STOPPED, as a cancel with checkpoints
    assert took < TIMEOUT_S / 2, took  # stopped by its own boundary, not by the timeout's kill
    _assert_stopped_without_checkpoint(run, err)
    events = _events(run)
    (cancelled,) = [e for e in events if e["event"] == "cancelled"]
    assert not cancelled.get("forced") and cancelled["checkpoint_step"] is None, cancelled
    assert NOTHING_TO_RESUME in cancelled["reason"] and "saved a checkpoint" not in cancelled["reason"], cancelled
    (stopped,) = [e for e in events if e["event"] == "stopped"]
    assert NOTHING_TO_RESUME in stopped["reason"] and "to resume" not in stopped["reason"].replace(
        NOTHING_TO_RESUME, ""
    )
    assert json.loads(res.stdout) == {str(run): "CANCELLED"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_one_signal_to_the_launcher_stops_a_run_without_checkpoints(tmp_path, name):
    run = tmp_path / "run"
    launch = _launch(run, tmp_path)
    try:
        _ranks(launch, 1)
        _wait_step(run)
        launch.send_signal(getattr(signal, name))  # once: the ranks stop at their next boundary
        _, err = launch.communicate(timeout=TIMEOUT_S / 2)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 130, err[-3000:]  # EXIT_INTERRUPTED
    _assert_stopped_without_checkpoint(run, err)
    assert f"interrupted ({name}): stopped at a step boundary; {NOTHING_TO_RESUME}" in err, err[-3000:]
    (cancelled,) = [e for e in _events(run) if e["event"] == "cancelled"]
    assert cancelled["forced"] is False and f"interrupted by {name}" in cancelled["reason"], cancelled


@pytest.mark.slow
def test_usr2_to_one_rank_of_two_stops_both_at_the_same_step(tmp_path):
    """Slurm's preemption warning reaches the ranks, not a local launcher: SIGUSR2 to rank 1 alone. The ranks
    agree on the step (one all-reduce), stop there without a checkpoint, and the launcher says so (exit 3)."""
    run = tmp_path / "run"
    launch = _launch(run, tmp_path, "cluster.gpus_per_node=2")
    try:
        ranks = _ranks(launch, 2)
        _wait_step(run)
        os.kill(ranks[1], signal.SIGUSR2)
        _, err = launch.communicate(timeout=TIMEOUT_S / 2)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 3, err[-3000:]
    signalled = _assert_stopped_without_checkpoint(run, err)
    assert signalled["name"] == "SIGUSR2"
    (stopped,) = [e for e in _events(run) if e["event"] == "stopped"]
    assert NOTHING_TO_RESUME in stopped["reason"], stopped
    for r in (0, 1):
        assert "Traceback" not in (run / "logs" / f"rank_{r}.log").read_text()


IGNORE_USR2 = """import signal, sys
if "training.main" in getattr(sys, "orig_argv", []):
    _real = signal.signal

    def _signal(sig, handler):
        if sig == signal.SIGUSR2 and callable(handler):
            handler = lambda *_: None  # caught (the launcher sees a handler) and ignored
        return _real(sig, handler)

    signal.signal = _signal
"""


@pytest.mark.slow
def test_a_second_signal_stops_ranks_that_do_not_stop_at_once(tmp_path):
    """docs/USER_CONTRACTS.md, exit 130: "a second signal stops them at once". The rank ignores the first
    signal's SIGUSR2, so only the second SIGINT ends it, long before cancel.timeout_s: `forced`, exit 130."""
    run = tmp_path / "run"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(IGNORE_USR2)
    launch = _launch(run, tmp_path, env=dict(os.environ, PYTHONPATH=f"{inject}{os.pathsep}{ROOT}"))
    try:
        _ranks(launch, 1)
        _wait_step(run)
        launch.send_signal(signal.SIGINT)
        time.sleep(3.0)  # several boundaries (MESHRUN_PACE_STEP_S=0.5): the rank ignored the stop
        assert launch.poll() is None
        t0 = time.monotonic()
        launch.send_signal(signal.SIGINT)
        _, err = launch.communicate(timeout=TIMEOUT_S / 2)
        took = time.monotonic() - t0
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 130, err[-3000:]
    assert took < 30, took
    (cancelled,) = [e for e in _events(run) if e["event"] == "cancelled"]
    assert cancelled["forced"] is True and "stopped at once" in cancelled["reason"], cancelled
    assert "Resume with" not in err and "interrupted (SIGINT): stopped at once" in err, err[-3000:]
