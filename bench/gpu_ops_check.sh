#!/usr/bin/env bash
# The operations checklist's GPU paths (issue 23), through the real CLI, on one GPU in about 3 minutes:
#
#   bash bench/gpu_ops_check.sh [RUN_DIR]
#   bash bench/gpu_ops_check.sh --dry [RUN_DIR]   # every check on CPU: tiny sizes, NVML answered by the double
#                                                 # (training/preflight/nvml_double.py); bench/gpu_check.sh --dry
#                                                 # and bench/gpu_first_run.sh DRY=1 run it
#
#  1. preflight with the real NVML and NCCL: the checklist's checks are present (nccl.transport, nccl.ib_settings,
#     version.nccl_min, version.cudnn, version.cuda_runtime, node.rdma_modules, node.read_ahead,
#     node.cgroup_memory) and none of version.* fails;
#  2. the real NVML Xid event set registers on the GPUs (training/observe/xid.py), or NVML says it is unsupported;
#  3. tiny model, 6 steps, train.nvtx=true and (when nsys is installed) train.nsys=true with profile_steps [3,4]:
#     the run completes, nsys writes run.dir/profile/nsys_rank0.nsys-rep, health.jsonl has utilisation samples;
#  4. gpt2_125m with a micro-batch far beyond the GPU (cluster.gpu_memory_gb set high so the planner lets it
#     through): a real CUDA out-of-memory error becomes the `oom` event (part activations) and exit 1; --dry
#     cannot fill a device: the rank raises its CPU allocator's refusal as torch.OutOfMemoryError, and the
#     check's `simulated` field says so.
# What --dry does instead at each step, and the time limit of each (GPU_OPS_STEP_TIMEOUT_S, default 300 s; past it
# the step's whole process tree, ranks included, is killed), are in bench/gpu_ops_check.py.
# Prints one JSON object (the last line; also RUN_DIR/summary.json); exit 0 when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=()
if [ "${1:-}" = "--dry" ]; then DRY=(--dry); shift; fi
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHON
RUN_DIR=${1:-${OUT:-/tmp}/gpu_ops_check}
rm -rf -- "$RUN_DIR"
mkdir -p -- "$RUN_DIR"
exec "$PYTHON" bench/gpu_ops_check.py "${DRY[@]}" "$RUN_DIR"
