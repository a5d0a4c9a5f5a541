"""bench/gpu_check.sh --dry: the GPU readiness script runs its real steps on CPU (tiny model, few steps), so
it cannot rot between the runs on a GPU machine: one JSON summary, every check present and passing, the
rank's model-state bytes equal to plan.json's, fp16 metrics carrying the loss scale."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import ROOT


@pytest.mark.slow  # the dry check trains a tiny model (about 2 minutes of make check before)
def test_gpu_check_dry_runs_every_step_and_prints_one_json(tmp_path):
    run_dir = tmp_path / "gpu check"  # a space: every path in the script is quoted
    # Another interpreter first on PATH (issue 30): the script must still run the project's venv python.
    other = tmp_path / "other bin"
    other.mkdir()
    for name in ("python", "python3"):
        (other / name).write_text("#!/bin/sh\necho 'not the project interpreter' >&2\nexit 97\n")
        (other / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{other}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--dry", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "dry" and summary["model"] == "tiny" and summary["ok"] is True
    checks = summary["checks"]
    assert set(checks) == {
        "preflight",
        "train",
        "mfu",
        "model_state_bytes",
        "activations",
        "fp16_loss_scaling",
        "memory_levers",
        "moe",
        "engine_features",
        "memory_reserved",
    }
    assert all(c["ok"] for c in checks.values()), checks
    assert checks["train"]["steps"] == 4 and checks["train"]["tokens_per_s"] > 0
    states = checks["model_state_bytes"]
    assert states["measured"] == states["plan"] and states["measured"]["weights"] > 0
    assert 0 < checks["mfu"]["mfu"] < 1
    assert len(checks["fp16_loss_scaling"]["loss_scales"]) == 3
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    # Every --dry check computed, none assumed (issue 30/31): the preflight ran on the NVML double, MFU is
    # bounded by 1, the activations were measured (saved-tensor bytes) against the plan.
    assert os.path.abspath(summary["python"]) == os.path.join(ROOT, ".venv", "bin", "python")  # not resolved:
    # every venv's python links to the same base binary
    assert checks["preflight"]["missing"] == [] and checks["preflight"]["checks"] >= 10
    assert checks["mfu"]["goal"] == [0.0, 1.0]
    act = checks["activations"]
    assert act["measured"] > 0 and abs(act["measured"] - act["plan"]) <= 0.1 * act["plan"]
    assert not list(run_dir.rglob("checkpoints"))  # checkpoints stay in the scratch folder
    # The mixture-of-experts step (issue 26): tiny_moe forward and backward, its rows and model states computed.
    moe = checks["moe"]
    assert moe["steps"] == 3 and all(v >= 1.0 for v in moe["max_load"]) and all(v > 0 for v in moe["aux_loss"])
    assert moe["model_states"] == moe["plan"] and moe["model_states"]["weights"] > 0
    reserved = checks["memory_reserved"]  # issue 31 (d): computed from summary.json and plan.json
    assert reserved["reserved"] > 0 and reserved["within_device"] and reserved["device_limit"] == 4 * 2**30
