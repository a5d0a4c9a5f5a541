"""bench/gpu_check.sh --dry: the GPU readiness script runs its real steps on CPU (tiny model, few steps), so
it cannot rot between the runs on a GPU machine: one JSON summary, every check present and passing, the
rank's model-state bytes equal to plan.json's, fp16 metrics carrying the loss scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_dry_steps  # noqa: E402
import gpu_engine_features as gef  # noqa: E402
import gpu_ops_check  # noqa: E402


def _last_json(log_path):
    """The JSON object a step printed last (its stdout comes before the log's stderr part)."""
    stdout = log_path.read_text().split("\n--- stderr ---\n")[0]
    return json.loads(stdout.strip().splitlines()[-1])


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
    project = os.path.join(ROOT, ".venv", "bin", "python")
    # Without the checkout's .venv (a fresh clone tested from its own environment) the script is told which
    # interpreter through PYTHON, as the contract says; PATH's first python is never the one used either way.
    expected = project if os.path.exists(project) else sys.executable
    if expected != project:
        env["PYTHON"] = sys.executable
    env["PATH"] = f"{other}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "scratch"  # the runs' own folders: given, so the script leaves it for the checks below
    env["GPU_CHECK_WORK"] = str(work)
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
        "fp8",
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
    # The fp8 step (issue 45): tiny in fp8 beside the fp32 run, throughput ratio and loss gap computed.
    fp8 = checks["fp8"]
    assert fp8["steps"] == 4 and fp8["speedup_vs_reference"] > 0 and 0 <= fp8["loss_gap"] < 0.05
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    # Every --dry check computed, none assumed (issue 30/31): the preflight ran on the NVML double, MFU is
    # bounded by 1, the activations were measured (saved-tensor bytes) against the plan.
    assert os.path.abspath(summary["python"]) == expected  # not resolved:
    # every venv's python links to the same base binary
    assert checks["preflight"]["missing"] == [] and checks["preflight"]["checks"] >= 10
    assert checks["mfu"]["goal"] == [0.0, 1.0]
    act = checks["activations"]
    assert act["measured"] > 0 and abs(act["measured"] - act["plan"]) <= 0.1 * act["plan"]
    assert not list(run_dir.rglob("checkpoints"))  # RUN_DIR gets no checkpoints
    # Nor does the scratch folder where the runs wrote (train.checkpointing=false: the GPU's 64 GiB disk does
    # not hold three ~18 GB saves): the train, fp8, fp16 and moe runs are there, without a checkpoint file.
    runs = {d.name for d in work.iterdir() if (d / "summary.json").exists()}
    assert {"bf16", "fp8", "moe"} <= runs, runs
    saved = [f for f in work.rglob("*") if f.is_file() and "checkpoints" in f.relative_to(work).parts]
    assert not saved, saved[:5]
    # train.fused_adamw unset resolved with the device: the CPU default, the unfused update.
    assert checks["train"]["fused_adamw"] is False
    # The mixture-of-experts step (issue 26): tiny_moe forward and backward, its rows and model states computed.
    moe = checks["moe"]
    assert moe["steps"] == 3 and all(v >= 1.0 for v in moe["max_load"]) and all(v > 0 for v in moe["aux_loss"])
    assert moe["model_states"] == moe["plan"] and moe["model_states"]["weights"] > 0
    reserved = checks["memory_reserved"]  # issue 31 (d): computed from summary.json and plan.json
    assert reserved["reserved"] > 0 and reserved["within_device"] and reserved["device_limit"] == 4 * 2**30
    # bench/gpu_engine_features.py --dry (step 7; moved here from tests/bench/test_gpu_engine_features.py so
    # it runs once): every check computed, none hard-wired.
    features = _last_json(run_dir / "engine_features.log")
    fchecks = features["checks"]
    assert features["mode"] == "dry" and features["ok"]
    assert set(fchecks) == {"zero3", "offload_cpu", "cp_ring_numerics", "cp_ring_numerics_bf16"}
    assert checks["engine_features"]["checks"] == sorted(fchecks)
    z3 = fchecks["zero3"]
    assert 0 < z3["peak_gathered_bytes"] <= z3["plan_zero3_gathered"]
    off = fchecks["offload_cpu"]
    assert off["measured"] == off["plan"] and off["measured"]["host_offload"] > 0
    errs = fchecks["cp_ring_numerics"]["relative_max_errors"]
    assert set(errs) == {"cp2", "cp4"}
    assert all(0 < e <= gef.CP_TOLERANCE for case in errs.values() for e in case.values()), errs
    bf16 = fchecks["cp_ring_numerics_bf16"]  # the blocks in 16 bits (on a GPU: the CUDA flash kernel)
    assert bf16["kernel"] == "cpu_flash" and set(bf16["relative_max_errors"]) == {"cp2", "cp4"}
    assert all(0 < e <= gef.CP_TOLERANCE_BF16 for case in bf16["relative_max_errors"].values() for e in case.values())
    # bench/gpu_memory_levers.py --dry (step 5): every lever's accounting equals the plan's, computed.
    levers = _last_json(run_dir / "memory_levers.log")
    assert levers["mode"] == "dry" and levers["ok"] and len(levers["checks"]) == 7
    for name, c in levers["checks"].items():
        assert c["measured"] == c["plan"] and c["measured"]["weights"] > 0, name
    # bench/gpu_ops_check.sh --dry (issue 43; bench/gpu_first_run.sh DRY=1 runs it too): every check computed on
    # CPU, what CPU cannot show named as such.
    ops = json.loads((run_dir / "ops" / "summary.json").read_text())
    ochecks = ops["checks"]
    assert ops["mode"] == "dry" and ops["ok"], ochecks
    assert set(ochecks) == {"preflight_checklist", "xid_event_set", "nvtx_nsys", "health_samples", "oom_explained"}
    pre = ochecks["preflight_checklist"]
    assert pre["missing"] == [] and set(pre["found"]) | set(pre["not_on_cpu"]) == set(gpu_ops_check.CHECKLIST)
    assert ochecks["xid_event_set"]["pending"] == [list(gpu_ops_check.DRY_XID)]
    assert ochecks["nvtx_nsys"]["nvtx_counted"]["counts"]["optimizer"] == 4
    assert ochecks["health_samples"]["samples"] > 0
    oom = ochecks["oom_explained"]
    assert oom["exit_code"] == 1 and oom["event"]["part"] == "activations" and oom["simulated"]


def test_dry_steps_keep_each_steps_failure_its_own():
    """The shared --dry process must not turn one step's failure into a pass or into the others' failure: an
    exception or a non-zero exit is that step's exit status, its output stays apart, and a passing step that
    follows still passes."""

    def raises():
        print("half a line")
        raise RuntimeError("boom in the step")

    def exits():
        sys.exit(3)

    def passes():
        print('{"ok": true}')
        return 0

    failed, exited, ok = (gpu_dry_steps._step(f, ["x"]) for f in (raises, exits, passes))
    assert failed["rc"] == 1 and "RuntimeError: boom in the step" in failed["stderr"]
    assert failed["stdout"] == "half a line\n"
    assert exited["rc"] == 3
    assert ok == {"rc": 0, "stdout": '{"ok": true}\n', "stderr": ""}
    assert sys.argv[0] != "x"  # the caller's argv is restored


def test_ops_check_kills_a_hung_step_with_its_ranks(tmp_path):
    """The GPU review's R19: a timed-out bench/gpu_ops_check.sh step must not leave its rank on the GPU. A stand-in
    step hangs as a launcher over a hung rank does: it starts its "rank" in a session of its own (as
    launcher/launch/local.py does, so killing the step's process group alone leaves it), both ignore SIGTERM, and
    the rank holds the step's output pipe. Past the limit, run_step kills both, returns, and its log says so."""
    pid_file = tmp_path / "rank.pid"
    stand_in = tmp_path / "hung_launcher.py"
    stand_in.write_text(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "hang = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'\n"
        "rank = subprocess.Popen([sys.executable, '-c', hang], start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(rank.pid))\n"
        "print('rank started', flush=True)\n"
        "time.sleep(600)\n"
    )
    t = time.time()
    step = gpu_ops_check.run_step(str(tmp_path), "hung", [sys.executable, str(stand_in), str(pid_file)], 3.0)
    took = time.time() - t
    rank = int(pid_file.read_text())
    assert step.timed_out and step.returncode == -9 and took < 3.0 + gpu_ops_check.KILL_WAIT_S
    assert rank in step.kill["killed"] and step.kill["left"] == []
    assert not gpu_ops_check.alive(rank)
    log = (tmp_path / "hung.log").read_text()
    assert "rank started" in log and "gpu_ops_check: killed after 3 s" in log
