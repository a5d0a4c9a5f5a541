#!/usr/bin/env bash
# meshrun's first GPU run, prepared as one command for a lent GPU machine (one GPU, CUDA torch preinstalled,
# no package index), within 15 minutes of device time:
#
#   bash bench/gpu_first_run.sh [WHEELS]   # WHEELS: wheels/ by default, made beforehand (bash bench/gpu_wheels.sh
#                                          # wheels) and carried with the run; results under $OUT
#   DRY=1 BASE_PYTHON=.venv/bin/python bash bench/gpu_first_run.sh wheels   # the same flow on CPU (--dry steps)
#
# The venv is .venv-gpu (VENV=...), never the developer's .venv.
# 1. the machine: nvidia-smi, the base interpreter's torch / CUDA / NCCL;
# 2. .venv from the carried wheels (bench/gpu_venv.sh: system site packages, so the preinstalled CUDA torch);
# 3. bench/gpu_preflight.sh: NVML checks, bf16 matmul TFLOP/s at 8192^3, all-reduce sweep up to 256 MB;
# 4. bench/gpu_check.sh: plan, bf16 training with MFU, model-state and activation bytes against the plan,
#    fp16 loss scaling.
# 5. bench/gpu_ops_check.sh (issue 23's GPU paths), when under 500 s are used; DRY=1: always, its --dry twin
#    (every check on CPU). GPU_OPS_BUDGET_S=165 keeps its own steps inside the step's limit (summary written,
#    a timed-out step killed with its ranks by the script itself rather than cut off from outside).
# Each step has its own time limit (install 120 s, preflight 150 s, gpu_check 420 s with GPU_CHECK_BUDGET_S=400
# so that its summary is still written, ops_check 180 s: at most 870 s, under 15 minutes of device time with
# the machine's start) and is reported whatever the others did; exit 0 when all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-wheels}
OUT=${OUT:-/tmp/gpu_first_run}
mkdir -p -- "$OUT"
BASE_PYTHON=${BASE_PYTHON:-python3}
export BASE_PYTHON
status=0
step() {  # name, seconds, command...: run with a time limit, log to $OUT/<name>.log, report one line
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "step $name: exit $rc after $((SECONDS - t0)) s (log: $OUT/$name.log)"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

{ nvidia-smi || true; } >"$OUT/machine.txt" 2>&1
"$BASE_PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available',
torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)" \
  >>"$OUT/machine.txt" 2>&1
tail -n 1 "$OUT/machine.txt"

VENV=${VENV:-.venv-gpu}
DRY=${DRY:-0}
MODE=()
[ "$DRY" = 1 ] && MODE=(--dry)
rm -rf -- "$VENV"
step install 120 bash bench/gpu_venv.sh "$WHEELS" "$VENV" || { echo "no usable $VENV: stopping"; exit 2; }
case "$VENV" in /*) PYTHON=$VENV/bin/python ;; *) PYTHON=$PWD/$VENV/bin/python ;; esac
export PYTHON

step preflight 150 bash bench/gpu_preflight.sh "${MODE[@]}" "$OUT/preflight"
grep -E '^(ok|warn|fail) ' "$OUT/preflight.log" || tail -n 20 "$OUT/preflight.log"

GPU_CHECK_WORK=$(mktemp -d) GPU_CHECK_BUDGET_S=400 GPU_OPS_CHECK=0 \
  step gpu_check 420 bash bench/gpu_check.sh "${MODE[@]}" "$OUT/gpu_check"
"$PYTHON" - "$OUT/gpu_check/summary.json" <<'PY' || tail -n 30 "$OUT/gpu_check.log"
import json, sys
s = json.load(open(sys.argv[1]))
print(f"gpu_check: model {s.get('model')}, ok {s.get('ok')}")
for name, c in s["checks"].items():
    rest = {k: v for k, v in c.items() if k != "ok"}
    print(f"  {'ok  ' if c['ok'] else 'FAIL'} {name}: {json.dumps(rest)[:400]}")
PY
# The operations checklist's GPU paths (issue 23, about 3 minutes) only when the budget still allows them; DRY=1
# always (on CPU, no device time counted).
if [ "$DRY" = 1 ] || [ "$SECONDS" -lt 500 ]; then
  GPU_OPS_BUDGET_S=165 step ops_check 180 bash bench/gpu_ops_check.sh "${MODE[@]}" "$OUT/ops_check"
  tail -n 1 "$OUT/ops_check.log"
else
  echo "step ops_check: skipped (${SECONDS} s used of the budget)"
fi
echo "first run: ${SECONDS} s in all"
exit "$status"
