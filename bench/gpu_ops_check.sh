#!/usr/bin/env bash
# The operations checklist's GPU paths (issue 23), through the real CLI, on one GPU in about 3 minutes:
#
#   bash bench/gpu_ops_check.sh [RUN_DIR]
#
#  1. preflight with the real NVML and NCCL: the checklist's checks are present (nccl.transport, nccl.ib_settings,
#     version.nccl_min, version.cudnn, version.cuda_runtime, node.rdma_modules, node.read_ahead,
#     node.cgroup_memory) and none of version.* fails;
#  2. the real NVML Xid event set registers on the GPUs (training/observe/xid.py), or NVML says it is unsupported;
#  3. tiny model, 6 steps, train.nvtx=true and (when nsys is installed) train.nsys=true with profile_steps [3,4]:
#     the run completes, nsys writes run.dir/profile/nsys_rank0.nsys-rep, health.jsonl has utilisation samples;
#  4. gpt2_125m with a micro-batch far beyond the GPU (cluster.gpu_memory_gb set high so the planner lets it
#     through): a real CUDA out-of-memory error becomes the `oom` event (part activations) and exit 1.
# Prints one JSON object (the last line; also RUN_DIR/summary.json); exit 0 when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RUN_DIR=${1:-${OUT:-/tmp}/gpu_ops_check}
rm -rf -- "$RUN_DIR"
mkdir -p -- "$RUN_DIR"

"$PYTHON" - "$RUN_DIR" <<'PY'
import json, os, shutil, signal, subprocess, sys, time

run_dir = sys.argv[1]
py = os.environ.get("PYTHON") or sys.executable
summary = {"checks": {}}


def meshrun(name, args, timeout):
    """One meshrun command in its own process group (as bench/gpu_check.sh runs them): past `timeout` the group is
    killed and the step reports it (a TimeoutExpired escaping here wrote no summary and left the rank on the GPU)."""
    t = time.time()
    p = subprocess.Popen([py, "-m", "launcher", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err += f"\ngpu_ops_check: killed after {timeout} s (time limit of this step)"
    p.stdout, p.stderr = out, err
    with open(os.path.join(run_dir, f"{name}.log"), "w") as f:
        f.write(out + "\n--- stderr ---\n" + err)
    return p, time.time() - t


def check(name, ok, **found):
    summary["checks"][name] = {"ok": bool(ok), **found}


def events(d):
    path = os.path.join(d, "events.jsonl")
    return [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []


import torch  # noqa: E402 - sizes the GPU

mem_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
device = ["cluster=local", "cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.nodes=1",
          f"cluster.gpu_memory_gb={mem_gb:.1f}", "parallel=single", "data=synthetic"]
# 1. preflight
pf = os.path.join(run_dir, "preflight")
p, dt = meshrun("preflight", ["action=preflight", *device, "cluster.preflight.mode=warn", f"run.dir={pf}"], 300)
data = json.load(open(os.path.join(pf, "preflight.json"))) if os.path.exists(os.path.join(pf, "preflight.json")) else {}
names = {c["name"]: c for c in data.get("checks", [])}
want = ["nccl.transport", "nccl.ib_settings", "version.nccl_min", "version.cudnn", "version.cuda_runtime",
        "node.rdma_modules", "node.read_ahead", "node.cgroup_memory"]
failed = [n for n in want if names.get(n, {}).get("status") == "fail"]
check("preflight_checklist", p.returncode == 0 and all(n in names for n in want) and not failed,
      missing=[n for n in want if n not in names], failed=failed, seconds=round(dt, 1),
      found={n: names[n].get("found") for n in want if n in names})
# 2. Xid event set on the real NVML
sys.path.insert(0, os.getcwd())
from training.observe.xid import XidWatcher  # noqa: E402
from training.preflight.gpu_nvml import load_nvml  # noqa: E402

nvml, why = load_nvml()
if nvml is None:
    check("xid_event_set", False, reason=why)
else:
    w = XidWatcher(nvml, nvml.nvmlDeviceGetCount())
    polled = w.poll()
    check("xid_event_set", bool(w.gpus) or bool(w.unsupported), registered=w.gpus, unsupported=w.unsupported,
          pending=polled)
    w.close()
    nvml.nvmlShutdown()
# 3. NVTX + nsys + health sampling
nsys = shutil.which("nsys") is not None
tr = os.path.join(run_dir, "nvtx")
p, dt = meshrun("train_nvtx", ["model=tiny", *device, "train.steps=6", "train.nvtx=true",
                               f"train.nsys={'true' if nsys else 'false'}", "train.profile_steps=[3,4]",
                               "cluster.health.interval_s=0.5", f"run.dir={tr}"], 300)
report = os.path.join(tr, "profile", "nsys_rank0.nsys-rep")
health = os.path.join(tr, "health.jsonl")
util = [json.loads(x).get("utilization_pct") for x in open(health)] if os.path.exists(health) else []
check("nvtx_nsys", p.returncode == 0 and (os.path.exists(report) or not nsys), exit_code=p.returncode,
      nsys_installed=nsys, report=report if os.path.exists(report) else None, seconds=round(dt, 1))
check("health_samples", any(u is not None for u in util), samples=len(util),
      low_utilization=[e for e in events(tr) if e["event"] == "low_utilization"][:1])
# 4. a real CUDA OOM
oom = os.path.join(run_dir, "oom")
p, dt = meshrun("oom", ["model=gpt2_125m", *device, "cluster.gpu_memory_gb=100000", "model.seq_length=1024",
                        "parallel.micro_batch=512", "parallel.global_batch=512", "train.steps=1",
                        f"run.dir={oom}"], 300)
ev = [e for e in events(oom) if e["event"] == "oom"]
check("oom_explained", p.returncode == 1 and ev and ev[0]["part"] == "activations" and "overflowed" in p.stderr,
      exit_code=p.returncode, event=ev[0] if ev else None, seconds=round(dt, 1))
summary["ok"] = all(c["ok"] for c in summary["checks"].values())
with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
print(json.dumps(summary, default=str))
sys.exit(0 if summary["ok"] else 1)
PY
