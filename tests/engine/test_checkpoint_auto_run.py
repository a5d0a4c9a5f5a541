"""A real local run with train.checkpoint_every_min=auto (launcher/plan/cadence.py resolves it, the engine saves
by the resolved minutes: training/checkpoint/manager.py). A node MTBF of 1e-6 h makes the Young/Daly interval
(sqrt(2 x save x MTBF)) a few milliseconds, shorter than any step plus its save, so the time-based saves are
certain without depending on how fast this machine is; it also once overflowed the goodput formula (a
traceback instead of a plan)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
from helpers import ROOT
from helpers.local_run import PYTHON, TINY_RUN

from launcher.plan.cadence import expected_goodput, young_interval_s


def test_goodput_of_an_mtbf_far_below_the_restart_time_is_zero_not_an_overflow():
    assert expected_goodput(60.0, 10.0, 30.0, 0.0036) == 0.0
    assert 0.0 < expected_goodput(60.0, 10.0, 30.0, 3600.0) < 1.0


@pytest.mark.slow  # trains (one CLI launch)
def test_a_run_with_auto_cadence_saves_by_the_resolved_minutes(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [
            PYTHON,
            "-m",
            "launcher",
            f"run.dir={run}",
            *TINY_RUN,
            "train.steps=6",
            "train.warmup_steps=1",
            "train.checkpoint_every=0",
            "train.checkpoint_every_min=auto",
            "cluster.node_mtbf_h=0.000001",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Young/Daly optimum" in p.stdout, p.stdout[-2000:]
    cfg = json.loads((run / "config.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    cad = plan["checkpoint_cadence"]
    minutes = cfg["resolved"]["checkpoint_every_min"]
    assert cfg["train"]["checkpoint_every_min"] == "auto" and minutes == pytest.approx(cad["optimal_min"], abs=1e-9)
    # Young's interval from the plan's own save-time estimate and the job MTBF (1 node x 1e-6 h = 3.6 ms).
    assert 60 * minutes == pytest.approx(young_interval_s(cad["save_s"], 3600 * 1e-6), rel=1e-6)
    assert 60 * minutes == pytest.approx(math.sqrt(2 * cad["save_s"] * 0.0036), rel=1e-6)  # the formula itself
    assert 0 < 60 * minutes < 1.0 and math.isfinite(minutes)
    saves = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    saves = [e for e in saves if e["event"] == "checkpoint"]
    # checkpoint_every=0: no step-based save; every save before the last step is the time-based one.
    assert {e["reason"] for e in saves if e["step"] < 6} == {"interval"} and len(saves) >= 3, saves
    assert saves[-1]["step"] == 6 and saves[-1]["reason"] == "final"
    assert os.path.isdir(run / "checkpoints" / "step_6")
