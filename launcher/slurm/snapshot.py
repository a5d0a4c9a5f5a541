"""The code a Slurm job runs: a copy of meshrun's packages taken at submission (run_dir/code).

A requeued attempt starts hours after the submission; importing the live checkout then would run whatever
was edited since. So the submission copies the packages as they are installed (launcher, training,
hydra_plugins, and the Hydra config tree as meshrun_conf) into run_dir/code, the batch script puts that
directory first on PYTHONPATH (with PYTHONSAFEPATH=1, so that Python >= 3.11 does not put the submission's
working directory, often the checkout itself, ahead of it), and every attempt, resubmissions included,
imports from there. code/snapshot.json records the source and, when it is a git checkout, the commit and
whether the copied packages had uncommitted changes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
from typing import Any

from launcher.ranks.processes import PROJECT_ROOT
from training.contract.rundir.files import replace_dir

CODE_DIR = "code"
PACKAGES = ("launcher", "training", "hydra_plugins")
CONF_PACKAGE = "meshrun_conf"
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


def code_dir(base: str) -> str:
    return os.path.join(base, CODE_DIR)


def _conf_source() -> str | None:
    spec = importlib.util.find_spec(CONF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def _git(args: list[str]) -> str | None:
    try:
        res = subprocess.run(["git", "-C", PROJECT_ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """{"commit": sha, "dirty": bool} when the packages come from a git checkout, else {}."""
    commit = _git(["rev-parse", "HEAD"])
    if not commit:
        return {}
    status = _git(["status", "--porcelain", "--", *PACKAGES, "conf"])
    return {"commit": commit, "dirty": bool(status)}


def _compile(tmp: str, target: str) -> None:
    """Write the copied modules' bytecode (__pycache__) now, at submission: every process of every attempt (the
    prologue, each rank's wrapper and rank, the epilogue) then imports them without compiling, also where the
    environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE, common in container images), which otherwise
    made each of them compile the modules it imports, on the way from a requeue back to training
    (docs/PERFORMANCE.md, "Preemption path"). Paths in the bytecode name the snapshot's final place (target).
    A module that does not compile is left to fail at import, as it would without this."""
    import compileall

    compileall.compile_dir(tmp, ddir=target, quiet=2, workers=1)


def take_snapshot(base: str) -> dict[str, Any]:
    """Copy the packages into base/code (replacing an older snapshot: the run lock guarantees that no job of
    this run is alive) and return what snapshot.json records."""
    target = code_dir(base)
    tmp = f"{target}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    copied = []
    for name in PACKAGES:
        src = os.path.join(PROJECT_ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(tmp, name), ignore=_IGNORE)
            copied.append(name)
    conf = _conf_source()
    if conf:
        shutil.copytree(conf, os.path.join(tmp, CONF_PACKAGE), ignore=_IGNORE)
        copied.append(CONF_PACKAGE)
    _compile(tmp, target)
    info = {"created": time.time(), "source": PROJECT_ROOT, "packages": copied, "path": target, **git_info()}
    with open(os.path.join(tmp, "snapshot.json"), "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
    replace_dir(tmp, target)
    return info
