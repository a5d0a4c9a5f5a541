#!/usr/bin/env bash
# GPU readiness in one script: on one GPU, in under 8 minutes, through the real CLI.
#
#   bash bench/gpu_check.sh [RUN_DIR]        # a GPU machine with the project's .venv (torch with CUDA, nvidia-ml-py)
#   bash bench/gpu_check.sh --dry [RUN_DIR]  # the same steps on CPU: tiny model, few steps (CI: tests/launcher/launch/test_gpu_paths_on_cpu.py)
#   bash bench/gpu_check.sh --install-wheels DIR [--dry] [RUN_DIR]
#       a bare GPU machine: CUDA torch preinstalled in BASE_PYTHON (default python3), no package index. Makes
#       .venv with the system's site packages (so it sees that torch) and installs the small pure-Python
#       dependencies from DIR (wheels downloaded beforehand: bash bench/gpu_wheels.sh DIR), then checks.
#
# The interpreter is always the project's: PYTHON, else .venv/bin/python (never whatever python is on PATH);
# it must import this checkout's launcher and Hydra, or the script stops with exit 2 naming the fix.
# Steps (each one `meshrun` command, so the script exercises what users run):
#  1. preflight (bench/gpu_preflight.sh's checks: NVML, matmul rate, collectives); --dry: on CPU with NVML
#     answered by the double (training/preflight/nvml_double.py): every check computed.
#  2. the largest GPT preset that the planner says fits this GPU (llama3_8b, else gpt_1p3b; --dry: tiny),
#     bf16, 30 steps (--dry: fp32 on CPU, 4 steps), one rank: an NCCL process group (--dry: gloo).
#     MFU is training/run/loop.py's: model FLOPs / step time / this device's matmul rate (measured with warm-up at
#     a saturating size), at a useful batch (global_batch 8 of micro-batches of 1: the optimizer step is paid
#     once per 8 forward-backward passes, as in training) with the fused AdamW (train.fused_adamw left unset: the
#     CUDA default; at batch 1 with the unfused update the optimizer alone is ~40 % of the step: MFU ~0.3
#     expected; --dry: the CPU default, the unfused update). Goal: 0.5 <= MFU
#     <= 1 on GPU; --dry: 0 < MFU <= 1 (above 1 means a wrong peak), global_batch 2.
#     Every train run here sets train.checkpointing=false: nobody reads their checkpoints (three ~18 GB
#     on GPU, which a 64 GiB disk does not hold beside the image).
#  2b. the same model, batch and steps in fp8 (train.precision=fp8: torchao's float8 linears): tokens/s against
#     step 2's run (goal on a GPU: >= FP8_SPEEDUP_GOAL, default 1.0) and the mean loss within 5 % of it (--dry:
#     on CPU, where float8 is emulated, the ratio is reported and only the loss judged).
#  3. the same model in fp16 with dynamic loss scaling, a few steps: metrics carry loss_scale (--dry: step 6's
#     tiny_moe run is in fp16 and is this run too, one launch fewer).
#  4. memory: rank 0's model-state bytes (weights, grads, optimizer; training/optim/optimizer.py memory_report)
#     must equal plan.json's; activations saved for backward (training/observe/saved_bytes.py) within 10 % of
#     plan.json's; on GPU also the allocator's peak (after the first step) minus model states.
#  5. memory levers (bench/gpu_memory_levers.py, one rank): for zero 0-3, offload cpu/nvme and
#     recompute_num_layers, memory_report equals plan.json's bytes exactly, and on the GPU the allocator's gain
#     while building the Trainer equals the device part of it (within the allocator's rounding);
#     --dry: the accounting against the plan only, on CPU.
#  6. mixture of experts, one rank: a Mixtral-shaped MoE (8 SwiGLU experts, top-2, 4 layers of width 2048; --dry:
#     model=tiny_moe in fp16) trains a few steps forward and backward through router, experts and balance loss:
#     finite losses, metrics rows carrying moe_max_load (>= 1) and moe_aux_loss (> 0), and rank 0's model-state
#     bytes (every expert's) equal to plan.json's.
#  7. engine features (bench/gpu_engine_features.py, one rank): zero=3's gathered parameter bytes during steps
#     against plan.json's zero3_gathered (GPU: the allocator's peak against the plan's total), offload=cpu's
#     memory_report after steps against the plan (GPU: no optimizer state left on the device), and the
#     context-parallel ring kernels (cp 2 and 4 simulated on the one device) against float64 attention;
#     --dry: the same on CPU without the allocator figures.
# --dry runs the one-process steps (4's saved-activations probe, 5 and 7) in one process with torch imported
# once (bench/gpu_dry_steps.py), each judged on its own exit status and output as on a GPU.
# Runs write under a scratch folder, removed at the end when the script made it (a mktemp -d); one given as
# GPU_CHECK_WORK is the caller's and stays (tests/bench/test_gpu_check.py looks there for checkpoints: the
# train runs write none). RUN_DIR gets only the logs, plans, metrics and summaries. Each command has a time limit; one that
# runs past it is killed with its whole process group (its ranks too), so nothing stays on the GPU.
# Prints one JSON object (the last line); exit 0 when every check passed, 1 otherwise, 2 when it cannot start.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) DRY=1; shift ;;
    --install-wheels) WHEELS=${2:?--install-wheels needs a folder of wheels}; shift 2 ;;
    *) break ;;
  esac
done
if [ -n "$WHEELS" ]; then
  bash bench/gpu_venv.sh "$WHEELS" "${VENV:-.venv}" || exit 2
  PYTHON=${VENV:-.venv}/bin/python
fi
PYTHON=${PYTHON:-.venv/bin/python}
if [ ! -x "$PYTHON" ]; then
  echo "gpu_check: no project interpreter at $PYTHON: run 'make install', or on a GPU machine without a package" \
       "index 'bash bench/gpu_check.sh --install-wheels DIR' (DIR from bench/gpu_wheels.sh), or set PYTHON" >&2
  exit 2
fi
if ! "$PYTHON" - "$PWD" <<'PY'
import os, sys
root = sys.argv[1]
try:
    import hydra, omegaconf, meshrun_conf  # noqa: F401 - the CLI's config layer and its presets
    import launcher
except ImportError as exc:
    sys.exit(f"gpu_check: {sys.executable} cannot import {exc.name}: install the project into it "
             "(make install, or --install-wheels DIR)")
where = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))
if os.path.realpath(where) != os.path.realpath(root):
    sys.exit(f"gpu_check: {sys.executable} imports launcher from {where}, not from this checkout {root}")
PY
then
  exit 2
fi
RUN_DIR=${1:-${OUT:-/tmp}/gpu_check}
rm -rf -- "$RUN_DIR"
mkdir -p -- "$RUN_DIR"
if [ -n "${GPU_CHECK_WORK:-}" ]; then
  WORK=$GPU_CHECK_WORK
  mkdir -p -- "$WORK"
else
  WORK=$(mktemp -d)
  trap 'rm -rf -- "$WORK"' EXIT
fi
# The operations checklist's GPU paths (issue 23): preflight checks, Xid events, NVTX/nsys, OOM explained; --dry:
# its CPU twin (bench/gpu_ops_check.py), summary in RUN_DIR/ops/summary.json.
# GPU_OPS_CHECK=0 leaves it out (bench/gpu_first_run.sh runs it as a step of its own, last, when time is left).
if [ "${GPU_OPS_CHECK:-1}" != 0 ]; then
  OPS_MODE=()
  if [ "$DRY" = 1 ]; then OPS_MODE=(--dry); fi
  PYTHON="$PYTHON" bash bench/gpu_ops_check.sh "${OPS_MODE[@]}" "$RUN_DIR/ops" >&2 ||
    echo "gpu_ops_check failed: $RUN_DIR/ops" >&2
fi

"$PYTHON" - "$RUN_DIR" "$DRY" "$WORK" <<'PY'
import json, os, re, shutil, signal, subprocess, sys, time

run_dir, dry, work = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
py = sys.executable
summary = {"mode": "dry" if dry else "gpu", "python": py, "checks": {}}
KEEP = ("plan.json", "summary.json", "metrics.jsonl", "events.jsonl", "preflight.json", "config.yaml")
# GPU_CHECK_BUDGET_S: seconds for all the steps together (a lent GPU's time is counted): each step's limit is
# cut to what is left, so the summary is still written when the budget runs out.
DEADLINE = time.time() + float(os.environ.get("GPU_CHECK_BUDGET_S") or 1e9)


def limit(timeout):
    return max(5.0, min(timeout, DEADLINE - time.time() - 10))


def meshrun(name, args, timeout):
    """One meshrun command in its own process group; output to RUN_DIR/<name>.log. Past `timeout` the whole
    group (launcher and ranks) is killed: a rank left behind would hold the GPU for the next step."""
    t = time.time()
    timeout = limit(timeout)
    p = subprocess.Popen([py, "-m", "launcher", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The launcher's group and every rank's (each rank has a session of its own: the group alone left them).
        sys.path.insert(0, "bench")
        from gpu_ops_check import kill_tree

        kill_tree(p.pid)
        out, err = p.communicate()
        err += f"\ngpu_check: killed after {timeout} s (time limit of this step)"
    with open(os.path.join(run_dir, f"{name}.log"), "w") as f:
        f.write(out + "\n--- stderr ---\n" + err)
    p.stderr_text = err
    return p, time.time() - t


def keep(src, name):
    """The small files of a run (no checkpoints) into RUN_DIR/<name>/."""
    dst = os.path.join(run_dir, name)
    os.makedirs(dst, exist_ok=True)
    for f in KEEP:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


def load(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def check(name, ok, **found):
    summary["checks"][name] = {"ok": bool(ok), **found}


def tail(p):
    return (p.stderr_text.strip().splitlines() or [""])[-1][-300:]


def fp16_check(p, dt, fp16_dir, model):
    """Step 3: an fp16 run's metrics rows all carry the dynamic loss scale."""
    rows = []
    if os.path.exists(os.path.join(fp16_dir, "metrics.jsonl")):
        rows = [json.loads(line) for line in open(os.path.join(fp16_dir, "metrics.jsonl")) if line.strip()]
    scales = [r.get("loss_scale") for r in rows if "loss_scale" in r]
    check("fp16_loss_scaling", p.returncode == 0 and len(scales) == len(rows) > 0, exit_code=p.returncode,
          loss_scales=scales, model=model, seconds=round(dt, 1))


DRY_STEPS = {}


def bench_step(name, cmd, timeout):
    """One single-process step (saved_bytes, memory_levers, engine_features) as a CompletedProcess. On a GPU
    each runs in a fresh process (the allocator figures count from an empty device); --dry runs all three in
    one process (bench/gpu_dry_steps.py: torch imported once), each with its own arguments, exit status and
    output, started at the first of them."""
    if not dry:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=limit(timeout))
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 124, "", f"gpu_check: {name} ran out of time")
    if not DRY_STEPS:
        args = [os.path.join(work, "bf16"), os.path.join(run_dir, "memory_levers"),
                os.path.join(work, "engine_features")]
        try:
            p = subprocess.run([py, "bench/gpu_dry_steps.py", *args], capture_output=True, text=True,
                               timeout=limit(600))
            DRY_STEPS.update(json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {})
            why = (p.stderr.strip().splitlines() or [""])[-1][-300:]
        except subprocess.TimeoutExpired:
            why = "gpu_check: the dry steps ran out of time"
        except (ValueError, IndexError):
            why = "gpu_check: bench/gpu_dry_steps.py printed no JSON"
        DRY_STEPS.setdefault("error", why)
    r = DRY_STEPS.get(name) or {"rc": 1, "stdout": "", "stderr": DRY_STEPS["error"]}
    return subprocess.CompletedProcess(cmd, r["rc"], r["stdout"], r["stderr"])


if dry:
    device = ["cluster.device=cpu", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=4"]
    models, steps, fp16_steps, precision = ["tiny"], 4, 3, "fp32"
    double = os.path.join(work, "nvml_double.json")
    with open(double, "w") as f:
        json.dump({"gpus": 1, "nodes": {"*": {"temperature": 40}}}, f)
    pf_args = [f"cluster.health.nvml_double={double}", "cluster.preflight.matmul_size=256"]
else:
    import torch  # only to size the GPU

    mem_gb = torch.cuda.get_device_properties(0).total_memory / 2**30  # GiB, as cluster.gpu_memory_gb
    device = ["cluster.device=cuda", "cluster.gpus_per_node=1", f"cluster.gpu_memory_gb={mem_gb:.1f}"]
    models, steps, fp16_steps, precision = ["llama3_8b", "gpt_1p3b"], 30, 10, "bf16"
    pf_args = []
pf_dir = os.path.join(work, "preflight")
p, dt = meshrun("preflight", ["action=preflight", "cluster=local", *device, "cluster.preflight.mode=warn",
                              *pf_args, f"run.dir={pf_dir}"], 300)
keep(pf_dir, "preflight")
data = load(os.path.join(pf_dir, "preflight.json"), {})
names = {c["name"] for c in data.get("checks", [])}
bad = [c["name"] for c in data.get("checks", []) if c.get("status") == "fail"]
# Computed, not assumed: the NVML checks (real or double), the matmul probe and the collectives all reported.
needed = {"gpu.count", "gpu.driver", "gpu.ecc_uncorrected_volatile", "gpu.matmul", "version.torch"}
check("preflight", p.returncode == 0 and not bad and needed <= names, exit_code=p.returncode, failed=bad,
      missing=sorted(needed - names), checks=len(names), seconds=round(dt, 1))

common = ["cluster=local", *device, "cluster.nodes=1", "data=synthetic", "parallel.tp=1", "parallel.pp=1",
          "train.log_every=1"]
no_checkpoints = ["train.checkpointing=false"]  # nobody reads them; three ~18 GB on a GPU's 64 GiB disk
mfu_batch = 2 if dry else 8  # micro-batches of 1 per step: the optimizer step is paid once per mfu_batch passes
chosen, plan_errors = None, []
for model in models:  # the largest preset the planner fits on this GPU
    plan_dir = os.path.join(work, f"plan_{model}")
    p, _ = meshrun(f"plan_{model}", ["action=plan", f"model={model}", *common, f"train.precision={precision}",
                                     "parallel.micro_batch=1", f"parallel.global_batch={mfu_batch}",
                                     f"run.dir={plan_dir}"], 120)
    keep(plan_dir, f"plan_{model}")
    if p.returncode != 0:  # the planner failed: say so, not "does not fit"
        plan_errors.append(f"{model}: meshrun action=plan exited {p.returncode}: {tail(p)}")
        continue
    if load(os.path.join(plan_dir, "plan.json"), {}).get("fits"):
        chosen = model
        break
summary["model"] = chosen
if chosen is None:
    check("plan", False, reason="; ".join(plan_errors) or f"none of {models} fits", errors=plan_errors)
else:
    train_dir = os.path.join(work, "bf16")
    p, dt = meshrun("train_bf16", [f"model={chosen}", *common, *no_checkpoints, f"train.precision={precision}",
                                   "parallel.micro_batch=1", f"parallel.global_batch={mfu_batch}",
                                   f"train.steps={steps}", f"run.dir={train_dir}"], 420)
    keep(train_dir, "bf16")
    plan = load(os.path.join(train_dir, "plan.json"), {})
    s = load(os.path.join(train_dir, "summary.json"), {})
    mfu = s.get("mfu")
    # train.fused_adamw unset: config.json records what it resolved to (fused on cuda, unfused on cpu).
    fused = load(os.path.join(train_dir, "config.json"), {}).get("train", {}).get("fused_adamw")
    check("train", p.returncode == 0 and s.get("steps") == steps and fused is (not dry), exit_code=p.returncode,
          steps=s.get("steps"), fused_adamw=fused, tokens_per_s=s.get("tokens_per_s"), seconds=round(dt, 1))
    low = 0.0 if dry else 0.5
    check("mfu", mfu is not None and low < mfu <= 1.0 if dry else mfu is not None and low <= mfu <= 1.0,
          mfu=mfu, goal=[low, 1.0],
          note="against this device's matmul rate (training/run/loop.py measure_peak_flops); above 1: a wrong peak")
    m = re.search(r"model states \(bytes\): weights (\d+), grads (\d+), optimizer (\d+)", p.stderr_text)
    states = {k: int(v) for k, v in zip(("weights", "grads", "optimizer"), m.groups())} if m else {}
    want = {k: plan.get("memory_bytes", {}).get(k) for k in ("weights", "grads", "optimizer")}
    check("model_state_bytes", bool(states) and states == want, measured=states, plan=want)
    act_plan = plan.get("memory_bytes", {}).get("activations")
    probe = bench_step("saved_bytes", [py, "bench/saved_bytes.py", train_dir], 300)
    saved = json.loads(probe.stdout.strip().splitlines()[-1]).get("saved_activation_bytes") if (
        probe.returncode == 0 and probe.stdout.strip()) else None
    within = saved is not None and bool(act_plan) and abs(saved - act_plan) <= 0.1 * act_plan
    found = {"measured": saved, "plan": act_plan, "tolerance": 0.1,
             "note": "bytes saved for backward by one micro-batch (training/observe/saved_bytes.py)"}
    if probe.returncode != 0:
        found["error"] = (probe.stderr.strip().splitlines() or [""])[-1][-300:]
    if not dry:  # the allocator's view too: peak allocated after the first step, minus model states
        peak = (s.get("peak_memory_bytes_per_rank") or [0])[0]
        act = peak - sum(states.values()) if states and peak else None
        found["allocator_measured"] = act
        within = within and act is not None and abs(act - act_plan) <= 0.1 * act_plan
    check("activations", within, **found)
    # Reserved, not allocated (launcher/plan/memory.py reserved_check): the caching allocator's peak after the
    # first step must stay within the plan's total plus its fragmentation share, and fit the device with the
    # rest of the reserve. --dry: CPU has no caching allocator; its figure is the rank's peak RSS (the
    # interpreter included), checked against the device memory given to the plan only.
    from launcher.plan.memory import reserved_check

    reserved = (s.get("peak_reserved_bytes_per_rank") or [None])[0]
    if reserved is None or not plan:
        check("memory_reserved", False, reason="no peak_reserved_bytes_per_rank in summary.json or no plan.json")
    else:
        r = reserved_check(plan, reserved)
        check("memory_reserved", r["within_device"] and (dry or r["within_plan"]), **r)
    # FP8 (train.precision=fp8, torchao's float8 matmuls in the linears): the same model, batch and steps as the
    # run above; throughput against it and the loss gap. Goal on a GPU: not slower than bf16 (FP8_SPEEDUP_GOAL;
    # the FP8 GEMMs run at twice bf16's peak on Hopper, the casts cost memory bandwidth) and the mean loss within
    # 5 %. --dry: the CPU emulates float8 (slower than fp32 by far): the ratio is reported, only the loss judged.
    # A GPU without FP8 tensor cores (compute capability below 8.9: an A100) cannot run the step: it is skipped
    # with the reason (the engine would refuse it, training/model/fp8_apply.py), not failed.
    fp8_skip = ""
    if not dry:
        import torch

        cap = torch.cuda.get_device_capability(0)
        if tuple(cap) < (8, 9):
            fp8_skip = (f"{torch.cuda.get_device_name(0)} has compute capability {cap[0]}.{cap[1]}: no FP8 tensor "
                        f"cores (8.9 or newer: L4/L40, H100/H200, B200)")
    fp8_dir = os.path.join(work, "fp8")
    if fp8_skip:
        check("fp8", True, skipped=fp8_skip)
    else:
        p, dt = meshrun("train_fp8", [f"model={chosen}", *common, *no_checkpoints, "train.precision=fp8",
                                      "parallel.micro_batch=1", f"parallel.global_batch={mfu_batch}",
                                      "train.fused_adamw=true", f"train.steps={steps}", f"run.dir={fp8_dir}"], 420)
        keep(fp8_dir, "fp8")
        s8 = load(os.path.join(fp8_dir, "summary.json"), {})

        def losses_of(d):
            path = os.path.join(d, "metrics.jsonl")
            rows = [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []
            return [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]

        ref_losses, fp8_losses = losses_of(train_dir), losses_of(fp8_dir)
        gap = (abs(sum(fp8_losses) - sum(ref_losses)) / abs(sum(ref_losses))
               if ref_losses and len(fp8_losses) == len(ref_losses) else None)
        speedup = (s8.get("tokens_per_s") / s.get("tokens_per_s")
                   if s8.get("tokens_per_s") and s.get("tokens_per_s") else None)
        fp8_goal = 0.0 if dry else float(os.environ.get("FP8_SPEEDUP_GOAL", "1.0"))
        check("fp8", p.returncode == 0 and s8.get("steps") == steps and gap is not None and gap < 0.05
              and speedup is not None and speedup >= fp8_goal,
              exit_code=p.returncode, steps=s8.get("steps"), tokens_per_s=s8.get("tokens_per_s"),
              speedup_vs_reference=speedup, speedup_goal=fp8_goal, loss_gap=gap, loss_gap_goal=0.05,
              reference_precision=precision, mfu_fp8_plan=load(os.path.join(fp8_dir, "plan.json"), {}).get("mfu_fp8"),
              error="" if p.returncode == 0 else tail(p), seconds=round(dt, 1))
    if not dry:  # --dry: the MoE run below is the fp16 run too (one launch fewer)
        fp16_dir = os.path.join(work, "fp16")
        p, dt = meshrun("train_fp16", [f"model={chosen}", *common, *no_checkpoints, "train.precision=fp16",
                                       "parallel.micro_batch=1",
                                       "parallel.global_batch=1", f"train.steps={fp16_steps}",
                                       f"run.dir={fp16_dir}"], 300)
        keep(fp16_dir, "fp16")
        fp16_check(p, dt, fp16_dir, chosen)
moe_dir = os.path.join(work, "moe")
moe_model = ["model=tiny_moe"] if dry else [
    "model=tiny_moe", "model.hidden_size=2048", "model.num_attention_heads=16", "model.num_query_groups=4",
    "model.num_layers=4", "model.ffn_hidden_size=5632", "model.moe_ffn_hidden_size=5632", "model.num_experts=8",
    "model.seq_length=1024", "model.vocab_size=32000"]
moe_steps = 3 if dry else 10
moe_precision = "fp16" if dry else precision  # --dry: also step 3's fp16 run (dynamic loss scaling)
p, dt = meshrun("train_moe", [*moe_model, *common, *no_checkpoints, f"train.precision={moe_precision}",
                              "parallel.micro_batch=1",
                              "parallel.global_batch=1", f"train.steps={moe_steps}", f"run.dir={moe_dir}"], 300)
keep(moe_dir, "moe")
rows = []
if os.path.exists(os.path.join(moe_dir, "metrics.jsonl")):
    rows = [json.loads(line) for line in open(os.path.join(moe_dir, "metrics.jsonl")) if line.strip()]
loads = [r.get("moe_max_load") for r in rows]
aux = [r.get("moe_aux_loss") for r in rows]
finite = all(isinstance(r.get("loss"), (int, float)) and r["loss"] == r["loss"] and abs(r["loss"]) < 1e9 for r in rows)
m = re.search(r"model states \(bytes\): weights (\d+), grads (\d+), optimizer (\d+)", p.stderr_text)
states = {k: int(v) for k, v in zip(("weights", "grads", "optimizer"), m.groups())} if m else {}
want = {k: load(os.path.join(moe_dir, "plan.json"), {}).get("memory_bytes", {}).get(k)
        for k in ("weights", "grads", "optimizer")}
check("moe", p.returncode == 0 and len(rows) == moe_steps and finite
      and all(isinstance(v, (int, float)) and v >= 1.0 for v in loads)
      and all(isinstance(v, (int, float)) and v > 0 for v in aux) and bool(states) and states == want,
      exit_code=p.returncode, steps=len(rows), max_load=loads, aux_loss=aux, model_states=states, plan=want,
      seconds=round(dt, 1))
if dry:
    fp16_check(p, dt, moe_dir, "tiny_moe")
t = time.time()
lev = bench_step("memory_levers", [py, "bench/gpu_memory_levers.py", *(["--dry"] if dry else []),
                                   "--out", os.path.join(run_dir, "memory_levers")], 300)
with open(os.path.join(run_dir, "memory_levers.log"), "w") as f:
    f.write(lev.stdout + "\n--- stderr ---\n" + lev.stderr)
try:
    levers = json.loads(lev.stdout.strip().splitlines()[-1])
except (ValueError, IndexError):
    levers = {"ok": False, "checks": {}}
check("memory_levers", lev.returncode == 0 and levers.get("ok"), exit_code=lev.returncode,
      failed=[k for k, c in levers.get("checks", {}).items() if not c.get("ok")], seconds=round(time.time() - t, 1))
t = time.time()
feat = bench_step("engine_features", [py, "bench/gpu_engine_features.py", *(["--dry"] if dry else []),
                                     "--out", os.path.join(work, "engine_features")], 300)
with open(os.path.join(run_dir, "engine_features.log"), "w") as f:
    f.write(feat.stdout + "\n--- stderr ---\n" + feat.stderr)
try:
    features = json.loads(feat.stdout.strip().splitlines()[-1])
except (ValueError, IndexError):
    features = {"ok": False, "checks": {}}
check("engine_features", feat.returncode == 0 and features.get("ok"), exit_code=feat.returncode,
      failed=[k for k, c in features.get("checks", {}).items() if not c.get("ok")],
      checks=sorted(features.get("checks", {})), seconds=round(time.time() - t, 1))
summary["ok"] = all(c["ok"] for c in summary["checks"].values())
with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary))
sys.exit(0 if summary["ok"] else 1)
PY
