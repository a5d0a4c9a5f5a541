#!/usr/bin/env bash
# Make the project's venv on a GPU machine that has CUDA torch installed and no package index:
#
#   bash bench/gpu_venv.sh WHEELS [VENV]      # BASE_PYTHON: the interpreter with CUDA torch (default python3)
#
# The venv is created with the system's site packages, so it uses BASE_PYTHON's torch, numpy and
# nvidia-ml-py as they are (a pip install of torch would fetch the multi-GB CUDA build, or fail offline); when
# BASE_PYTHON is itself a venv, whose packages --system-site-packages does not reach, a .pth file adds its
# site-packages. The wheels in WHEELS (bench/gpu_wheels.sh) are installed without an index and without
# dependency resolution; the project itself is this checkout, on the path by a .pth file (no build step), and
# its conf/ linked in as the package meshrun_conf, as the editable install maps it.
# Exit 2, naming the fix, when BASE_PYTHON has no torch or an import the checks need is still missing.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:?usage: bash bench/gpu_venv.sh WHEELS [VENV]}
VENV=${2:-.venv}
BASE=${BASE_PYTHON:-python3}
if ! "$BASE" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
  echo "gpu_venv: $BASE has no torch: set BASE_PYTHON to the interpreter with CUDA torch" >&2
  exit 2
fi
if [ ! -d "$WHEELS" ]; then
  echo "gpu_venv: no wheel folder $WHEELS: make it with 'bash bench/gpu_wheels.sh $WHEELS' and carry it" >&2
  exit 2
fi
"$BASE" -m venv --system-site-packages --without-pip "$VENV"
PY=$VENV/bin/python
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# BASE's own site-packages when it is a venv (sys.prefix != sys.base_prefix): not reachable otherwise.
"$BASE" - "$SITE/meshrun-base-site.pth" <<'PY'
import site, sys
paths = site.getsitepackages() if sys.prefix != sys.base_prefix else []
with open(sys.argv[1], "w") as f:
    f.write("".join(p + "\n" for p in paths))
PY
echo "$PWD" > "$SITE/meshrun-checkout.pth"
# The presets: pyproject.toml installs conf/ as the package meshrun_conf (the CLI reads pkg://meshrun_conf).
ln -sfn -- "$PWD/conf" "$SITE/meshrun_conf"
# BASE's pip installs into the venv's site-packages (--target): the venv itself has no pip (no ensurepip
# needed). By distribution name from the folder, so pip picks the wheel that fits this interpreter (PyYAML).
names=$(cd -- "$WHEELS" && ls -- *.whl 2>/dev/null | sed 's/-.*//' | sort -u || true)
if [ -n "$names" ]; then
  if ! "$BASE" -m pip --version >/dev/null 2>&1; then
    echo "gpu_venv: $BASE has no pip to install the wheels with" >&2
    exit 2
  fi
  # shellcheck disable=SC2086 - one word per distribution name
  "$BASE" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$SITE" --upgrade \
    --disable-pip-version-check --no-warn-script-location $names
fi
"$PY" - <<'PY'
import importlib, sys
need = {"torch": "BASE_PYTHON's torch", "hydra": "hydra-core", "omegaconf": "omegaconf",
        "antlr4": "antlr4-python3-runtime", "yaml": "PyYAML", "submitit": "submitit", "pynvml": "nvidia-ml-py",
        "numpy": "numpy", "torchao.float8": "torchao (train.precision=fp8)",
        "launcher.cli.app": "this checkout", "training.main": "this checkout",
        "meshrun_conf": "this checkout's conf/"}
missing = []
for mod, pkg in need.items():
    try:
        importlib.import_module(mod)
    except ImportError as exc:
        missing.append(f"{mod} ({pkg}: {exc})")
if missing:
    sys.exit("gpu_venv: still missing after the install: " + "; ".join(missing)
             + ": add the wheel to the folder (bench/gpu_wheels.sh) or install it into BASE_PYTHON")
import torch
print(f"gpu_venv: {sys.executable}: torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()})")
PY
