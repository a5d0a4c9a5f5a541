#!/usr/bin/env bash
# Run the real preflight (NVML checks, bf16 matmul TFLOP/s per GPU, NCCL busbw) on a GPU machine.
#
#   bash bench/gpu_preflight.sh [RUN_DIR]        # a GPU machine: torch with CUDA, nvidia-ml-py
#   bash bench/gpu_preflight.sh --dry [RUN_DIR]  # the same code on CPU: 2 gloo ranks, NVML answered by the
#                                                # double (training/preflight/nvml_double.py; CI: tests/launcher/launch/test_gpu_paths_on_cpu.py)
#
# Needs torch and nvidia-ml-py; not Hydra (the config is built directly). The interpreter is the project's
# .venv (bench/gpu_check.sh --install-wheels makes one on a bare GPU machine), else PYTHON=... Expected values:
#   MATMUL_TFLOPS (e.g. 989 dense bf16 for H100 SXM; 0 = report only), BUSBW_INTRA_GBPS (e.g. 360),
#   NVLINKS_PER_GPU (18 on H100/H200 SXM), IB_HCAS (e.g. mlx5_0,mlx5_1; empty = none expected),
#   SIZES_MB (all-reduce sizes; on GPU a 256 MB one is added when they stop short: bus bandwidth needs it),
#   NVML_DOUBLE (--dry: a double spec file instead of the healthy 2-GPU one written into RUN_DIR).
# Prints the table, then one line per check; exits 4 when the node is bad, like meshrun.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RUN_DIR=${1:-${OUT:-/tmp}/gpu_preflight}
mkdir -p -- "$RUN_DIR"

# One interpreter for the prerequisites and the checks (torch imported once).
"$PYTHON" - "$RUN_DIR" "$DRY" <<'PY'
import json, os, sys, time
try:
    import torch
except ImportError:
    sys.exit("torch is not installed for this interpreter (set PYTHON=...)")
if sys.argv[2] != "1" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: nothing to check here (--dry runs it on CPU)")
try:
    import pynvml  # noqa: F401
except ImportError:
    sys.exit("nvidia-ml-py is missing: pip install nvidia-ml-py")
sys.path.insert(0, os.getcwd())
from training.contract.config import Config
from launcher.launch.preflight import run_local
from training.contract.rundir.config_files import write_config

run_dir, dry = sys.argv[1], sys.argv[2] == "1"
env = os.environ
cfg = Config(action="preflight")
cfg.run.dir = run_dir
cl = cfg.cluster
cl.name, cl.kind, cl.nodes = "gpu-bench", "local", 1
pf = cl.preflight
if dry:
    cl.device, cl.gpus_per_node, cl.gpu_memory_gb = "cpu", 2, 80.0
    double = env.get("NVML_DOUBLE") or os.path.join(run_dir, "nvml_double.json")
    if not env.get("NVML_DOUBLE"):
        with open(double, "w") as f:
            json.dump({"gpus": 2, "nodes": {"*": {"temperature": 40}}}, f)
    cl.health.nvml_double = os.path.abspath(double)
    pf.matmul_size = 256
else:
    cl.device = "cuda"
    cl.gpus_per_node = torch.cuda.device_count()
    cl.gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30  # GiB
pf.mode = "warn"
pf.matmul_tflops = float(env.get("MATMUL_TFLOPS", 0))
pf.busbw_intra_gbps = float(env.get("BUSBW_INTRA_GBPS", 0))
pf.nvlinks_per_gpu = int(env.get("NVLINKS_PER_GPU", 0))
pf.ib_hcas = [h for h in env.get("IB_HCAS", "").split(",") if h]
pf.collective_sizes_mb = [float(x) for x in env.get("SIZES_MB", "1,8" if dry else "8,64,256").split(",")]
write_config(cfg, run_dir)
t = time.time()
code = run_local(cfg, run_dir, timeout_s=float(env.get("TIMEOUT_S", 300)))
print(f"\nexit {code} after {time.time() - t:.1f} s; report {run_dir}/preflight.json")
data = json.load(open(os.path.join(run_dir, "preflight.json")))
for c in data["checks"]:
    if c["name"].startswith(("gpu.", "coll.", "version.")):
        print(f"{c['status']:5} {c['name']:24} {c['subject']:12} {json.dumps(c['found'])}")
sys.exit(code)
PY
