"""`meshrun action=plan` as a user types it: plan.json on success; exit 2, a clear message and nothing
written (but Hydra's log) on bad input; a `-m` sweep closes with one table and sweep.json.

The installed command in a fresh interpreter once (test_plan_writes_plan_json, a subprocess); every other
command runs in this process through the same entry point (tests/helpers/cli.py), without ~2 s of start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.cli import meshrun

PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable


def meshrun_subprocess(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [PYTHON, "-m", "launcher", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_plan_writes_plan_json(tmp_path):
    """The smoke test of the real command: a fresh interpreter, `python -m launcher`."""
    run = tmp_path / "run"
    p = meshrun_subprocess("action=plan", f"run.dir={run}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "GiB" in p.stdout or "MiB" in p.stdout
    plan = json.loads((run / "plan.json").read_text())
    for key in (
        "world_size",
        "tp",
        "pp",
        "dp",
        "cp",
        "vpp",
        "micro_batch",
        "global_batch",
        "grad_accum",
        "num_microbatches",
        "params_total",
        "params_per_gpu",
        "memory_bytes",
        "bubble_ratio",
        "bubble_idle_fraction",
        "model_flops_per_step",
        "hardware_flops_per_step",
        "tokens_per_step",
        "gpu_memory_bytes",
        "fits",
    ):
        assert key in plan, key
    assert set(plan["memory_bytes"]) >= {
        "weights",
        "grads",
        "optimizer",
        "activations",
        "activations_per_layer",
        "pipeline_messages",
        "total",
    }
    assert all(isinstance(v, int) for v in plan["memory_bytes"].values())
    assert (plan["tp"], plan["dp"], plan["grad_accum"]) == (2, 2, 2)  # the embedded default: tp2 sp dp2
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["parallel"]["tp"] == 2 and cfg["action"] == "plan"
    import yaml  # the resolved config for people, as docs/USER_CONTRACTS.md's run directory lists it

    assert yaml.safe_load((run / "config.yaml").read_text()) == cfg


BAD = {
    "typo_key": (["model.hiden_size=10"], "hiden_size"),
    "tp3_32_heads": (
        [
            "model=llama3_8b",
            "parallel.tp=3",
            "parallel.sp=false",
            "cluster.gpus_per_node=3",
            "parallel.dp=1",
            "cluster.gpu_memory_gb=1000",
        ],
        "divisible by tp=3",
    ),
    "global_batch": (["parallel.global_batch=10"], "global_batch 10 is not divisible"),
    "unknown_preset": (["model=gpt5"], "gpt5"),
    "negative_size": (["model.num_layers=-4"], "model.num_layers: must be a positive integer"),
    "no_fit": (["model=gpt3_175b", "parallel=single"], "DOES NOT FIT"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_and_writes_nothing(tmp_path, case):
    overrides, expect = BAD[case]
    run = tmp_path / "run"
    p = meshrun("action=plan", f"run.dir={run}", *overrides, cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert expect in p.stderr, p.stderr
    left = set(os.listdir(run)) if run.exists() else set()
    assert left <= {"app.log"}, left


def test_no_fit_names_the_fixes(tmp_path):
    p = meshrun("action=plan", f"run.dir={tmp_path / 'run'}", "model=gpt3_175b", "parallel=single", cwd=tmp_path)
    assert p.returncode == 2
    assert "fix:" in p.stderr and "recompute" in p.stderr and "GiB" in p.stderr


def test_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    p = meshrun(
        "-m",
        "action=plan",
        "parallel.tp=1,2",
        "parallel.pp=1,2,4",
        "parallel.sp=false",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert "sweep summary: 5 feasible, 1 infeasible" in p.stdout, p.stdout
    data = json.loads((sweep / "sweep.json").read_text())
    assert len(data["points"]) == 6
    feasible = data["feasible"]
    # Ranked by predicted step time, then by memory headroom (most first).
    heads = [(r["predicted_step_s"], -r["headroom_bytes"]) for r in feasible]
    assert heads == sorted(heads)
    assert all(r["reason"] for r in data["infeasible"])
    for r in feasible:
        assert os.path.exists(os.path.join(r["run_dir"], "plan.json"))


def test_status_prints_one_json_object_or_exits_2(tmp_path):
    missing = tmp_path / "no_such_run"
    p = meshrun("action=status", f"run.dir={missing}", cwd=tmp_path)
    # Hydra creates run.dir before the task runs: the check must not be fooled by that.
    assert p.returncode == 2 and "not a meshrun run directory" in p.stderr and p.stdout == "", p
    run = tmp_path / "run"
    assert meshrun("action=plan", f"run.dir={run}", cwd=tmp_path).returncode == 0
    p = meshrun("action=status", f"run.dir={run}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    status = json.loads(p.stdout)  # the whole of stdout is one JSON object
    assert set(status) >= {"state", "job_id", "attempt", "last_step", "excluded_nodes"}
