"""`meshrun action=cancel` when the ranks ignore the stop (launcher/manage/cancel.py's forced path): a local run whose
rank catches SIGUSR2 and does nothing with it (a sitecustomize swaps the engine's handler for a no-op) is killed
once cancel.timeout_s has passed; the `cancelled` event says forced and names the timeout, nothing of the run
is left running, and the last complete checkpoint stays the one resume would pick."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from helpers import ROOT
from helpers.cli import meshrun
from helpers.local_run import PYTHON, TINY_RUN

from training.checkpoint import storage

TINY = [
    *TINY_RUN,
    "cluster.peak_tflops=1",
    "train.checkpoint_every=2",
    "train.steps=100000",
    "+cluster.env.MESHRUN_PACE_STEP_S=2",  # runs until cancelled: idles instead of spinning the shared cores
]
IGNORE_USR2 = """import signal, sys
if "training.main" in getattr(sys, "orig_argv", []):
    _real = signal.signal

    def _signal(sig, handler):
        if sig == signal.SIGUSR2 and callable(handler):
            handler = lambda *_: None  # caught (the launcher's cancel sees a handler) and ignored
        return _real(sig, handler)

    signal.signal = _signal
"""


@pytest.mark.slow
def test_ranks_that_ignore_the_stop_are_killed_after_the_timeout(tmp_path):
    run = tmp_path / "run"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(IGNORE_USR2)
    env = dict(os.environ, PYTHONPATH=f"{inject}{os.pathsep}{ROOT}")
    launch = subprocess.Popen(
        [PYTHON, "-m", "launcher", f"run.dir={run}", *TINY],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while storage.read_latest(str(run)) is None:  # a complete checkpoint exists before the cancel
            assert time.time() < deadline and launch.poll() is None, "the run never saved a checkpoint"
            time.sleep(0.3)
        t0 = time.monotonic()
        res = meshrun("action=cancel", f"run.dir={run}", "cancel.timeout_s=4", cwd=str(tmp_path))
        waited = time.monotonic() - t0
        assert res.returncode == 0, res.stderr
        assert launch.wait(timeout=120) != 0  # its rank was killed: the launch did not end cleanly
    finally:
        if launch.poll() is None:
            launch.kill()
    assert waited >= 4  # the ranks had their cancel.timeout_s before the kill
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (cancelled,) = [e for e in events if e["event"] == "cancelled"]
    assert cancelled.get("forced") is True and "cancel.timeout_s=4" in cancelled["reason"], cancelled
    assert not any(e["event"] == "checkpoint" and e.get("reason") == "SIGUSR2" for e in events)  # ignored
    leftovers = subprocess.run(["pgrep", "-f", f"training.main {run}"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
    latest = storage.read_latest(str(run))
    assert latest is not None and storage.verify(storage.step_dir(str(run), latest)).ok
    assert cancelled["checkpoint_step"] == latest
