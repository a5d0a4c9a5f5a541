#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that bench/gpu_check.sh --install-wheels installs on a
# GPU machine that has CUDA torch but no index: the CLI's small dependencies (Hydra, OmegaConf, ANTLR's runtime,
# PyYAML, submitit and theirs), nvidia-ml-py and torchao (train.precision=fp8: gpu_check's fp8 step). Torch, numpy
# and the rest come from the GPU machine's own interpreter; PyYAML is fetched for each CPython from 3.10 to 3.13;
# torchao's wheel is one abi3 build for CPython 3.10 and newer (built against the torch release pyproject.toml's
# fp8 extra names).
#
#   bash bench/gpu_wheels.sh DIR      # then carry DIR with the run (a few MB)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: bash bench/gpu_wheels.sh DIR}
PY=${PYTHON:-.venv/bin/python}
mkdir -p -- "$DIR"
# Pure-Python: one wheel serves every interpreter. Versions inside pyproject.toml's ranges. `pip wheel`, not
# download: antlr4-python3-runtime 4.9.3 (the one omegaconf 2.3 accepts) is published as a source archive only.
"$PY" -m pip wheel -q --no-deps -w "$DIR" \
  'hydra-core>=1.3,<1.4' 'omegaconf>=2.3,<2.4' 'antlr4-python3-runtime==4.9.3' 'submitit>=1.5,<2' \
  cloudpickle typing_extensions packaging 'nvidia-ml-py>=12'
for v in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$DIR" PyYAML
done
# torchao: the pyproject fp8 extra's version; its compiled kernels are abi3 (cp310-abi3), so one wheel serves.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.10 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 -d "$DIR" 'torchao==0.18.*'
ls -- "$DIR"
