#!/usr/bin/env bash
# GPU readiness in one script: on one GPU, in under 8 minutes, through the real CLI.
#
#   bash bench/gpu_check.sh [RUN_DIR]        # a GPU machine (torch with CUDA, nvidia-ml-py)
#   bash bench/gpu_check.sh --dry [RUN_DIR]  # the same steps on CPU: tiny model, few steps (CI: tests/test_gpu_check.py)
#
# Steps (each one `meshrun` command, so the script exercises what users run):
#  1. preflight with the real NVML (bench/gpu_preflight.sh's checks: driver, matmul rate, NCCL); --dry: skipped.
#  2. the largest GPT preset that the planner says fits this GPU (llama3_8b, else gpt_1p3b; --dry: tiny),
#     bf16, 30 steps (--dry: fp32 on CPU, 4 steps), one rank: an NCCL process group (--dry: gloo).
#     MFU is training/loop.py's: model FLOPs / step time / this GPU's measured bf16 matmul rate. Goal >= 0.5.
#  3. the same model in fp16 with dynamic loss scaling, a few steps: metrics carry loss_scale.
#  4. memory: rank 0's model-state bytes (weights, grads, optimizer; training/optim/optimizer.py memory_report)
#     must equal plan.json's; activations measured (peak allocated minus model states) within 10 % of the plan.
#     --dry: model states checked, activations reported only (CPU peak is the process RSS, not activations).
#  5. memory levers (bench/gpu_memory_levers.py, one rank): for zero 0-3, offload cpu/nvme and
#     recompute_num_layers, memory_report equals plan.json's bytes exactly, and on the GPU the allocator's gain
#     while building the Trainer equals the device part of it (within the allocator's rounding);
#     --dry: the accounting against the plan only, on CPU.
# Prints one JSON object (the last line); exit 0 when every check passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RUN_DIR=${1:-${OUT:-/tmp}/gpu_check}
rm -rf -- "$RUN_DIR"
mkdir -p -- "$RUN_DIR"
START=$(date +%s)
# The operations checklist's GPU paths (issue 23): preflight checks, Xid events, NVTX/nsys, OOM explained.
if [ "$DRY" = 0 ]; then bash bench/gpu_ops_check.sh "$RUN_DIR/ops" >&2 || echo "gpu_ops_check failed: $RUN_DIR/ops" >&2; fi

"$PYTHON" - "$RUN_DIR" "$DRY" <<'PY'
import json, os, re, subprocess, sys, time

run_dir, dry = sys.argv[1], sys.argv[2] == "1"
py = os.environ.get("PYTHON") or sys.executable
summary = {"mode": "dry" if dry else "gpu", "checks": {}}


def meshrun(name, args, timeout):
    """One meshrun command; its output goes to RUN_DIR/<name>.log."""
    t = time.time()
    p = subprocess.run([py, "-m", "launcher", *args], capture_output=True, text=True, timeout=timeout)
    with open(os.path.join(run_dir, f"{name}.log"), "w") as f:
        f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
    return p, time.time() - t


def check(name, ok, **found):
    summary["checks"][name] = {"ok": bool(ok), **found}


if dry:
    device = ["cluster.device=cpu", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=4"]
    models, steps, fp16_steps, precision = ["tiny"], 4, 3, "fp32"
    check("preflight", True, skipped="--dry: no GPU, no NVML")
else:
    import torch  # noqa: F401 - only to size the GPU

    mem_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    device = ["cluster.device=cuda", "cluster.gpus_per_node=1", f"cluster.gpu_memory_gb={mem_gb:.1f}"]
    models, steps, fp16_steps, precision = ["llama3_8b", "gpt_1p3b"], 30, 10, "bf16"
    p, dt = meshrun("preflight", ["action=preflight", "cluster=local", *device, "cluster.preflight.mode=warn",
                                  f"run.dir={run_dir}/preflight"], 300)
    report = os.path.join(run_dir, "preflight", "preflight.json")
    data = json.load(open(report)) if os.path.exists(report) else {}
    bad = [c["name"] for c in data.get("checks", []) if c.get("status") == "fail"]
    check("preflight", p.returncode == 0 and data, exit_code=p.returncode, failed=bad, seconds=round(dt, 1))

common = ["cluster=local", *device, "cluster.nodes=1", "data=synthetic", "parallel.tp=1", "parallel.pp=1",
          "train.log_every=1"]
chosen = None
for model in models:  # the largest preset the planner fits on this GPU
    plan_dir = os.path.join(run_dir, f"plan_{model}")
    p, _ = meshrun(f"plan_{model}", ["action=plan", f"model={model}", *common, f"train.precision={precision}",
                                     "parallel.micro_batch=1", "parallel.global_batch=1", f"run.dir={plan_dir}"], 120)
    if p.returncode == 0 and json.load(open(os.path.join(plan_dir, "plan.json"))).get("fits"):
        chosen = model
        break
summary["model"] = chosen
if chosen is None:
    check("plan", False, reason=f"none of {models} fits")
else:
    train_dir = os.path.join(run_dir, "bf16")
    p, dt = meshrun("train_bf16", [f"model={chosen}", *common, f"train.precision={precision}",
                                   "parallel.micro_batch=1", "parallel.global_batch=1", f"train.steps={steps}",
                                   f"run.dir={train_dir}"], 420)
    plan = json.load(open(os.path.join(train_dir, "plan.json"))) if os.path.exists(
        os.path.join(train_dir, "plan.json")) else {}
    s = json.load(open(os.path.join(train_dir, "summary.json"))) if os.path.exists(
        os.path.join(train_dir, "summary.json")) else {}
    mfu = s.get("mfu")
    check("train", p.returncode == 0 and s.get("steps") == steps, exit_code=p.returncode, steps=s.get("steps"),
          tokens_per_s=s.get("tokens_per_s"), seconds=round(dt, 1))
    check("mfu", dry or (mfu is not None and mfu >= 0.5), mfu=mfu, goal=0.5,
          note="against the measured matmul rate of this device (training/loop.py measure_peak_flops)")
    m = re.search(r"model states \(bytes\): weights (\d+), grads (\d+), optimizer (\d+)", p.stderr)
    states = {k: int(v) for k, v in zip(("weights", "grads", "optimizer"), m.groups())} if m else {}
    want = {k: plan.get("memory_bytes", {}).get(k) for k in ("weights", "grads", "optimizer")}
    check("model_state_bytes", bool(states) and states == want, measured=states, plan=want)
    peak = (s.get("peak_memory_bytes_per_rank") or [0])[0]
    act_plan = plan.get("memory_bytes", {}).get("activations")
    act = peak - sum(states.values()) if states and peak else None
    within = act is not None and act_plan and abs(act - act_plan) <= 0.1 * act_plan
    check("activations", dry or within, measured=act, plan=act_plan, tolerance=0.1,
          note="--dry: CPU peak is the process RSS, reported only" if dry else "peak allocated - model states")
    fp16_dir = os.path.join(run_dir, "fp16")
    p, dt = meshrun("train_fp16", [f"model={chosen}", *common, "train.precision=fp16", "parallel.micro_batch=1",
                                   "parallel.global_batch=1", f"train.steps={fp16_steps}", f"run.dir={fp16_dir}"],
                    300)
    rows = []
    if os.path.exists(os.path.join(fp16_dir, "metrics.jsonl")):
        rows = [json.loads(line) for line in open(os.path.join(fp16_dir, "metrics.jsonl")) if line.strip()]
    scales = [r.get("loss_scale") for r in rows if "loss_scale" in r]
    check("fp16_loss_scaling", p.returncode == 0 and len(scales) == len(rows) > 0, exit_code=p.returncode,
          loss_scales=scales, seconds=round(dt, 1))
t = time.time()
lev = subprocess.run([py, "bench/gpu_memory_levers.py", *(["--dry"] if dry else []),
                      "--out", os.path.join(run_dir, "memory_levers")], capture_output=True, text=True, timeout=300)
with open(os.path.join(run_dir, "memory_levers.log"), "w") as f:
    f.write(lev.stdout + "\n--- stderr ---\n" + lev.stderr)
try:
    levers = json.loads(lev.stdout.strip().splitlines()[-1])
except (ValueError, IndexError):
    levers = {"ok": False, "checks": {}}
check("memory_levers", lev.returncode == 0 and levers.get("ok"), exit_code=lev.returncode,
      failed=[k for k, c in levers.get("checks", {}).items() if not c.get("ok")], seconds=round(time.time() - t, 1))
summary["ok"] = all(c["ok"] for c in summary["checks"].values())
with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary))
sys.exit(0 if summary["ok"] else 1)
PY
