"""The forced cancel on the real dev Slurm cluster (launcher/manage/cancel.py through launcher/launch/slurm_backend.py
`_force`): a running job whose ranks catch SIGUSR2 and ignore it (a sitecustomize in every rank process) does not
stop on `action=cancel`'s `scancel --signal=USR2`; after cancel.timeout_s the action runs `scancel JOB`, records
`cancelled` with forced=true and the timeout in its reason, and the job leaves the queue without a SIGUSR2 checkpoint
or a requeue. (The local forced path is tests/launcher/manage/test_cancel_forced.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
from helpers.slurm import ROOT, meshrun

from launcher.slurm import queries as slurm_queries
from training.contract.rundir.events import read_events

pytestmark = pytest.mark.slurm

TIMEOUT_S = 5
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
    "+cluster.env.MESHRUN_PACE_STEP_S=2",  # idles between steps instead of spinning the shared cores
    "cluster.preflight.mode=off",
]

IGNORE_USR2 = """import signal, sys
if "training.main" in getattr(sys, "orig_argv", []):
    _real = signal.signal

    def _signal(sig, handler):
        if sig == signal.SIGUSR2 and callable(handler):
            handler = lambda *_: None  # caught (the job looks ready to stop) and ignored
        return _real(sig, handler)

    signal.signal = _signal
"""


def _wait(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout} s")


def _logged_steps(run_dir) -> int:
    path = os.path.join(str(run_dir), "metrics.jsonl")
    return len([line for line in open(path) if line.strip()]) if os.path.exists(path) else 0


def test_cancel_scancels_a_running_job_that_ignores_usr2_after_the_timeout(tmp_path, cluster):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(IGNORE_USR2)
    run = tmp_path / "run"
    res = meshrun(*ONE_NODE, f"run.dir={run}", env={"PYTHONPATH": f"{inject}{os.pathsep}{ROOT}"})
    assert res.returncode == 0, res.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    try:
        _wait(lambda: _logged_steps(run) >= 1, 120, "a logged step")
        t0 = time.monotonic()
        cancel = meshrun("action=cancel", f"run.dir={run}", f"cancel.timeout_s={TIMEOUT_S}", timeout=120)
        took = time.monotonic() - t0
        assert cancel.returncode == 0, cancel.stderr[-3000:]
        assert json.loads(cancel.stdout) == {str(run): "CANCELLED"}, cancel.stdout
        assert TIMEOUT_S <= took < TIMEOUT_S + 30, took  # waited the timeout, then scancel without waiting more
        _wait(lambda: slurm_queries.job_alive(job) is False, 60, "the job to leave the queue")
    finally:
        subprocess.run(["scancel", job], capture_output=True)  # a failed test leaves no job behind
    events = read_events(str(run))
    cancelled = [e for e in events if e["event"] == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].get("forced") is True, cancelled
    assert cancelled[0]["job_id"] == job
    assert f"did not stop within cancel.timeout_s={TIMEOUT_S} s: scancel" in cancelled[0]["reason"], cancelled
    assert not any(e["event"] == "checkpoint" and e.get("reason") == "SIGUSR2" for e in events)  # it ignored USR2
    assert not any(e["event"] == "requeued" for e in events)
