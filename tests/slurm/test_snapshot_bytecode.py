"""Issue 28: the code snapshot a Slurm job runs (launcher/slurm/snapshot.py) carries its modules' bytecode, so a process
of any attempt imports them without compiling, also under PYTHONDONTWRITEBYTECODE (which forbids writing bytecode)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from launcher.slurm.snapshot import code_dir, take_snapshot


def test_snapshot_modules_are_imported_from_bytecode_written_at_submission(tmp_path):
    take_snapshot(str(tmp_path))
    code = code_dir(str(tmp_path))
    sources = [
        os.path.join(root, name)
        for package in ("launcher", "training")
        for root, _, names in os.walk(os.path.join(code, package))
        for name in names
        if name.endswith(".py")
    ]
    assert sources and all(os.path.exists(importlib.util.cache_from_source(src)) for src in sources)
    env = {**os.environ, "PYTHONPATH": code, "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(
        [sys.executable, "-v", "-c", "import launcher.slurm.driver, training.contract.config as c; print(c.__file__)"],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == os.path.join(code, "training", "contract", "config.py")
    pyc = importlib.util.cache_from_source(os.path.join(code, "training", "contract", "config.py"))
    assert f"code object from '{pyc}'" in res.stderr  # read from the snapshot's bytecode, not compiled
