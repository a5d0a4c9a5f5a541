"""train.wandb=true with a stand-in `wandb` module (the real package is not installed here and needs a network):
rank 0's metrics rows reach wandb.Run.log at their steps, every attempt continues the same W&B run
(run.dir/wandb.json, resume="allow"), and a W&B that cannot start never fails the run. The stand-in is a
module file on sys.path that records each call, so the calls checked are the ones the sink really makes."""

from __future__ import annotations

import json
import sys

import pytest

from training.contract.config import Config
from training.observe.metrics import MetricsLog

STAND_IN = """
import json, os
CALLS = os.environ["WANDB_STAND_IN_CALLS"]
def _record(**call):
    with open(CALLS, "a") as f:
        f.write(json.dumps(call) + "\\n")
class Run:
    def log(self, values, step=None):
        _record(call="log", values=values, step=step)
    def finish(self):
        _record(call="finish")
def init(**kwargs):
    if os.environ.get("WANDB_STAND_IN_FAIL"):
        raise RuntimeError("no network")
    _record(call="init", **{k: v for k, v in kwargs.items() if k != "config"}, has_config=bool(kwargs.get("config")))
    return Run()
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "wandb.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("WANDB_STAND_IN_CALLS", str(calls))
    yield lambda: [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []
    sys.modules.pop("wandb", None)


def _cfg() -> Config:
    cfg = Config()
    cfg.train.wandb, cfg.train.wandb_project, cfg.train.tensorboard = True, "proj-x", False
    return cfg


def test_rows_reach_wandb_at_their_steps_and_attempts_share_one_run(tmp_path, stand_in):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = MetricsLog(_cfg(), str(run_dir), resumed_step=0, is_logger=True)
    log.write({"step": 1, "loss": 2.5, "lr": 0.1, "layout": "tp1", "finite": True})
    log.write({"step": 2, "loss": 2.25, "lr": 0.2})
    log.close()
    second = MetricsLog(_cfg(), str(run_dir), resumed_step=2, is_logger=True)  # the next attempt of the run
    second.write({"step": 3, "loss": 2.0, "lr": 0.3})
    second.close()
    calls = stand_in()
    inits = [c for c in calls if c["call"] == "init"]
    run_id = json.loads((run_dir / "wandb.json").read_text())["id"]
    assert len(inits) == 2 and all(
        c["id"] == run_id
        and c["resume"] == "allow"
        and c["project"] == "proj-x"
        and c["dir"] == str(run_dir)
        and c["has_config"]
        for c in inits
    ), inits
    logs = [(c["step"], c["values"]) for c in calls if c["call"] == "log"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in logs] == [r["step"] for r in rows] == [1, 2, 3]
    for (_, values), row in zip(logs, rows):
        # every number of the row but the step, nothing else (no strings, no booleans)
        assert values == {k: v for k, v in row.items() if k not in ("step", "layout", "finite")}, (values, row)
    assert [c["call"] for c in calls].count("finish") == 2


def test_wandb_that_cannot_start_warns_and_the_run_goes_on(tmp_path, stand_in, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_STAND_IN_FAIL", "1")
    log = MetricsLog(_cfg(), str(tmp_path), resumed_step=0, is_logger=True)
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert "W&B did not start (RuntimeError: no network)" in capsys.readouterr().err
    assert log.sinks == [] and (tmp_path / "metrics.jsonl").exists() and stand_in() == []


def test_other_ranks_never_start_wandb(tmp_path, stand_in):
    MetricsLog(_cfg(), str(tmp_path), resumed_step=0, is_logger=False).close()
    assert stand_in() == [] and not (tmp_path / "wandb.json").exists()
