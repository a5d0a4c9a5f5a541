#!/usr/bin/env bash
# Run the real preflight (NVML checks, bf16 matmul TFLOP/s per GPU, NCCL busbw) on a GPU machine.
#
#   bash bench/gpu_preflight.sh [RUN_DIR]        # PYTHON=... to pick an interpreter with CUDA torch
#
# Needs torch with CUDA and nvidia-ml-py; not Hydra (the config is built directly), so a bare GPU
# box with `pip install torch nvidia-ml-py` is enough. Expected values come from env:
#   MATMUL_TFLOPS (e.g. 989 dense bf16 for H100 SXM; 0 = report only), BUSBW_INTRA_GBPS (e.g. 360),
#   NVLINKS_PER_GPU (18 on H100/H200 SXM), IB_HCAS (e.g. mlx5_0,mlx5_1; empty = none expected).
# Prints the table, then a one-line summary per GPU; exits 4 when the node is bad, like meshrun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RUN_DIR=${1:-${OUT:-/tmp}/gpu_preflight}
mkdir -p "$RUN_DIR"

"$PYTHON" - "$RUN_DIR" <<'PY'
import os, sys
try:
    import torch
except ImportError:
    sys.exit("torch is not installed for this interpreter (set PYTHON=...)")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: nothing to check here")
try:
    import pynvml  # noqa: F401
except ImportError:
    sys.exit("nvidia-ml-py is missing: pip install nvidia-ml-py")
PY

"$PYTHON" - "$RUN_DIR" <<'PY'
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from training.config import Config
from launcher.preflight import run_local

run_dir = sys.argv[1]
env = os.environ
cfg = Config(action="preflight")
cfg.run.dir = run_dir
cl = cfg.cluster
cl.name, cl.kind, cl.nodes, cl.device = "gpu-bench", "local", 1, "cuda"
cl.gpus_per_node = torch.cuda.device_count()
cl.gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
pf = cl.preflight
pf.mode = "warn"
pf.matmul_tflops = float(env.get("MATMUL_TFLOPS", 0))
pf.busbw_intra_gbps = float(env.get("BUSBW_INTRA_GBPS", 0))
pf.nvlinks_per_gpu = int(env.get("NVLINKS_PER_GPU", 0))
pf.ib_hcas = [h for h in env.get("IB_HCAS", "").split(",") if h]
pf.collective_sizes_mb = [float(x) for x in env.get("SIZES_MB", "8,64,256").split(",")]
from training.config import save_config
save_config(cfg, os.path.join(run_dir, "config.json"))
t = time.time()
code = run_local(cfg, run_dir, timeout_s=float(env.get("TIMEOUT_S", 300)))
print(f"\nexit {code} after {time.time() - t:.1f} s; report {run_dir}/preflight.json")
data = json.load(open(os.path.join(run_dir, "preflight.json")))
for c in data["checks"]:
    if c["name"] in ("gpu.matmul", "gpu.straggler", "gpu.driver", "gpu.cuda_driver", "gpu.temperature",
                     "gpu.pcie", "gpu.nvlink", "coll.all_reduce", "version.nccl", "version.torch"):
        print(f"{c['status']:5} {c['name']:16} {c['subject']:12} {json.dumps(c['found'])}")
sys.exit(code)
PY
