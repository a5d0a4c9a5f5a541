"""Checkpoint cadence from failure rates (launcher/plan/cadence.py): the Young/Daly interval against a
simulation of failing jobs written here, the plan's advice, train.checkpoint_every_min=auto end to end."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.cli import compose_cfg
from helpers.oracles_plan import simulate_goodput

from launcher.plan.cadence import advise, expected_goodput, resolve, young_interval_s
from launcher.plan.validate import validate
from training.contract.config import checkpoint_minutes

NODE_MTBF_H = 10_000.0
SAVE_S, RESTART_S = 60.0, 600.0


def _simulated_goodput(tau, save, restart, mtbf, work, seed):
    """Useful work / wall time of a job that needs `work` seconds of compute, saving `save` s after every
    `tau` s of it, with failures at exponential times (mean mtbf) at any moment, each costing the work since the
    last complete save plus a restart of `restart` s (itself hit by failures). Written here, independent of
    launcher/plan/cadence.py, failure by failure."""
    rng = random.Random(seed)
    done = wall = 0.0
    while True:
        to_failure = rng.expovariate(1.0 / mtbf)
        left = work - done
        segments = math.ceil(left / tau)
        if left + segments * save <= to_failure:  # the job ends before the next failure
            return work / (wall + left + segments * save)
        done += (to_failure // (tau + save)) * tau  # complete segments (each saved) survive
        wall += to_failure
        while True:  # restart; a failure during it starts it again
            to_failure = rng.expovariate(1.0 / mtbf)
            if to_failure >= restart:
                wall += restart
                break
            wall += to_failure


@pytest.mark.parametrize("nodes", [8, 32, 128, 512, 1024, 4096])
def test_young_daly_interval_is_within_5_percent_goodput_of_the_simulated_best(nodes):
    mtbf = NODE_MTBF_H * 3600 / nodes
    tau = young_interval_s(SAVE_S, mtbf)
    assert tau == pytest.approx((2 * SAVE_S * mtbf) ** 0.5, rel=0.05)  # Young's first-order form
    work = 300 * mtbf  # about 300 failures per simulated job
    grid = [tau * f for f in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0)]
    sims = {t: _simulated_goodput(t, SAVE_S, RESTART_S, mtbf, work, seed=nodes) for t in grid}
    best = max(sims.values())
    assert sims[tau] >= 0.95 * best, (nodes, sims)
    # Daly's closed form, and the module's own simulation, are this simulation's expectation.
    assert abs(expected_goodput(tau, SAVE_S, RESTART_S, mtbf) - sims[tau]) < 0.02
    assert abs(simulate_goodput(tau, SAVE_S, RESTART_S, mtbf, work, seed=nodes) - sims[tau]) < 0.02
    # And the interval matters: a fixed 4x-too-long one is worse than the optimum.
    assert sims[grid[-1]] < sims[tau]


def test_gpt3_175b_on_128_and_1024_dgx_nodes():
    for nodes, job_mtbf_h in ((128, 78.125), (1024, 9.765625)):
        cfg = compose_cfg(
            "model=gpt3_175b",
            "cluster=dgx_h100",
            f"cluster.nodes={nodes}",
            "parallel=korthikanti_175b",
            "parallel.dp=null",
            "parallel.global_batch=1536",
        )
        cad = advise(cfg)
        assert cad.requested == "auto" and cad.job_mtbf_h == pytest.approx(job_mtbf_h)
        # 174.6e9 parameters (vocabulary padded for tp 8) x (2 bf16 weight + 12 fp32 master and Adam) bytes at the preset's 100 GB/s.
        assert cad.checkpoint_bytes == 174_604_345_344 * 14 and cad.save_s == pytest.approx(24.44, rel=1e-3)
        assert cad.optimal_min * 60 == pytest.approx((2 * cad.save_s * job_mtbf_h * 3600) ** 0.5)
        assert cad.resolved_min == cad.optimal_min and cad.goodput_optimal > 0.9


def test_measured_saves_and_restarts_win_over_the_estimates(tmp_path):
    cfg = compose_cfg(
        "model=gpt3_175b",
        "cluster=dgx_h100",
        "cluster.nodes=128",
        "parallel=korthikanti_175b",
        "parallel.dp=null",
        "parallel.global_batch=1536",
    )
    events = [{"event": "checkpoint", "time": 100.0, "attempt": 0, "total_s": t} for t in (300.0, 200.0, 100.0)]
    events += [
        {"event": "failed", "time": 1000.0, "attempt": 0},
        {"event": "requeued", "time": 1001.0, "attempt": 0},
        {"event": "started", "time": 1180.0, "attempt": 1},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    cad = resolve(cfg, str(tmp_path))
    assert cad.save_s == 200.0 and "measured" in cad.save_source
    assert cad.restart_s == 180.0 and "measured" in cad.restart_source
    assert cfg.resolved.checkpoint_every_min == pytest.approx(cad.optimal_min, abs=1e-4)
    assert checkpoint_minutes(cfg) == cfg.resolved.checkpoint_every_min


def test_auto_needs_an_mtbf_and_minutes_must_be_numbers():
    cfg = compose_cfg("cluster=slurm_dev", "cluster.node_mtbf_h=0")
    keys = {i.key for i in validate(cfg).errors}
    assert "cluster.node_mtbf_h" in keys
    cfg = compose_cfg("train.checkpoint_every_min=soon")
    assert "train.checkpoint_every_min" in {i.key for i in validate(cfg).errors}
    cfg = compose_cfg("train.checkpoint_every_min=30")
    assert not [i for i in validate(cfg).errors if i.code == "cadence"] and checkpoint_minutes(cfg) == 30.0
    cfg = compose_cfg("train.checkpoint_every_min=auto", "cluster.node_mtbf_h=1000")
    with pytest.raises(ValueError, match="not resolved"):
        checkpoint_minutes(cfg)  # only the launcher knows the save time


def test_plan_prints_the_advice_and_config_json_carries_the_minutes(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "action=plan",
            "model=gpt3_175b",
            "cluster=dgx_h100",
            "cluster.nodes=1024",
            "parallel=korthikanti_175b",
            "parallel.dp=null",
            "parallel.global_batch=1536",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "job MTBF 9.77 h (node MTBF 10000 h / 1024 nodes)" in p.stdout
    assert "Young/Daly optimum" in p.stdout
    saved = json.loads((run_dir / "config.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    assert saved["resolved"]["checkpoint_every_min"] == pytest.approx(
        plan["checkpoint_cadence"]["optimal_min"], abs=1e-4
    )
