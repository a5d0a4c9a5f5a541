"""The step boundary's decision (training/run/stop.py) in one process: which stop reason wins, when a save is due
(the checkpoint manager's step and clock cadence), that a boundary is decided once, and the signal-only rule of a
run without checkpoints. The multi-rank agreement is the engine tests' (tests/engine/test_checkpoint_resume.py,
tests/launcher/ranks/test_stop_without_checkpoints.py)."""

from __future__ import annotations

import json
import signal

import pytest

from training.contract.config import Config
from training.parallel.mesh import ProcessMesh
from training.run import signals
from training.run.stop import STOP_CODES, StopRule


def _cfg(**train) -> Config:
    cfg = Config()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


@pytest.fixture(autouse=True)
def _no_signal():
    signals.clear()
    yield
    signals.clear()


def test_the_manager_says_when_a_save_is_due(tmp_path):
    from training.checkpoint import CheckpointManager

    cfg = _cfg(checkpoint_every=3, checkpoint_every_min="2")
    ck = CheckpointManager(str(tmp_path), ProcessMesh.single(), cfg, log=lambda msg: None)
    assert [s for s in range(10) if ck.step_due(s)] == [3, 6, 9]
    start = ck._last_save_time
    assert not ck.time_due(start + 119) and ck.time_due(start + 120)


def test_configured_stops_and_signals_with_a_checkpointer(tmp_path):
    class Checkpointer:
        def __init__(self):
            self.logged: list[str] = []

        def step_due(self, step):
            return step == 4

        def time_due(self, now):
            return False

        def log(self, msg):
            self.logged.append(msg)

    ck = Checkpointer()
    rule = StopRule(_cfg(steps=10, exit_interval=4, exit_after_min=1.0), str(tmp_path), ProcessMesh.single(), ck)
    t0 = rule._start
    assert rule.decide(3, now=t0) == (False, None)
    assert rule.decide(4, now=t0) == (True, "exit_interval")
    assert rule.decide(4, now=t0 + 3600) == (True, "exit_interval")  # a boundary is decided once
    assert rule.decide(5, now=t0 + 60) == (False, "exit_after_min")
    signals._handler(signal.SIGUSR2, None)  # a signal wins over the configured stops
    assert rule.decide(8, now=t0 + 60) == (False, "SIGUSR2")
    assert rule.decide(10, now=t0) == (False, "SIGUSR2")  # no exit_interval at the last step; the signal stays
    assert ck.logged and "SIGUSR2 received: saving step 8" in ck.logged[0]
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["event"], e["name"], e["step"]) for e in events] == [("signal", "SIGUSR2", 8), ("signal", "SIGUSR2", 10)]
    assert set(STOP_CODES.values()) == {None, "exit_interval", "exit_after_min", "SIGTERM", "SIGUSR2"}


def test_without_checkpoints_only_a_signal_stops(tmp_path, capsys):
    rule = StopRule(_cfg(steps=10, exit_interval=2), str(tmp_path), ProcessMesh.single(), None)
    assert rule.decide(2) == (False, None)
    signals._handler(signal.SIGTERM, None)
    assert rule.decide(3) == (False, "SIGTERM")
    assert "stopping after step 3 without a checkpoint" in capsys.readouterr().err
    (event,) = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert event["name"] == "SIGTERM" and event["checkpoint"] is False
