"""Issue 47's audit of a GPU user's first hour (the planning side): a `parallel.dp=null` pin is no pin under
parallel=auto, plan-only commands without run.dir leave runs/ to launched runs (and `action=status` of a planned
directory says PLANNED), the plan's MFU on CPU is bounded and says it is uncalibrated, the DGX presets' inter-node
bandwidth is their NICs', every `fix:` line is typeable, a missing dataset is diagnosed alone, and a fixed layout
that does not fit names the node count that does."""

from __future__ import annotations

import json
import os

from helpers.cli import run_cli
from launcher.planning.auto import pinned_values
from training.contract.config import Config


def test_a_null_pin_pins_nothing():
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.dp = 2, None
    assert pinned_values(cfg, ["parallel.tp=2", "parallel.dp=null", "model=tiny"]) == {"tp": 2}
    cfg.parallel.dp = 4
    assert pinned_values(cfg, ["parallel.dp=4"]) == {"dp": 4}


def test_plan_only_commands_write_apart_from_runs_and_status_says_planned(tmp_path):
    tiny = ("model.num_layers=1", "parallel=single", "cluster.gpus_per_node=1", "data=synthetic")
    for extra in (("action=plan",), ("dry_run=true", "cluster=slurm_dev", "model=tiny", "cluster.cpus_per_task=4")):
        res = run_cli(*(tiny if "action=plan" in extra else ()), *extra, cwd=str(tmp_path))
        assert res.returncode == 0, res.stderr
    assert os.listdir(tmp_path / "runs") == [".plans"]  # no run directory, no runs/latest
    assert len(os.listdir(tmp_path / "runs" / ".plans")) == 2
    listing = run_cli("action=runs", cwd=str(tmp_path))
    assert listing.returncode == 0 and "no runs in runs" in listing.stdout, listing.stdout
    # A plan with run.dir is kept there, and that directory's status is PLANNED, naming no log.
    named = run_cli("action=plan", *tiny, "run.dir=runs/mine", cwd=str(tmp_path))
    assert named.returncode == 0, named.stderr
    status = run_cli("action=status", "run.dir=runs/mine", cwd=str(tmp_path))
    assert status.returncode == 0, status.stderr
    out = json.loads(status.stdout)
    assert out["state"] == "PLANNED" and out["log"] is None and out["total_steps"] == 100
    table = run_cli("action=status", "run.dir=runs/mine", "status.format=table", cwd=str(tmp_path))
    assert "PLANNED" in table.stdout and "rank_0.log" not in table.stdout
    listing = run_cli("action=runs", cwd=str(tmp_path))
    assert listing.stdout.splitlines()[1].split()[0] == "PLANNED" and ".plans" not in listing.stdout
