"""action=prepare when one of its worker processes dies (launcher/data/prepare/__init__.py's pool): the prepare ends
with a clear DataError naming the dead worker and the fix instead of waiting forever for its result, and the
output folder holds nothing (no dataset, no temporary files). The worker is killed for real (os._exit in the
spawned worker, injected by a sitecustomize that only the pool's spawned processes act on)."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT

import launcher.data.prepare as lp
from launcher.data.prepare.config import PrepareConfig
from training.data import DataError

DIE_ON_MARKER = """import sys
if "--multiprocessing-fork" in sys.argv:
    import os
    import launcher.data.prepare.worker as worker

    _real = worker.process

    def process(item):
        if b"KILL-THIS-WORKER" in str(item).encode():
            os._exit(9)  # dies without a word, as an OOM-killed worker does
        return _real(item)

    worker.process = process
"""


def test_a_dead_worker_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(DIE_ON_MARKER)
    monkeypatch.setenv("PYTHONPATH", f"{inject}{os.pathsep}{ROOT}")  # the spawned workers' environment
    inputs = []
    for i in range(6):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(("KILL-THIS-WORKER " if i == 3 else "") + f"document {i} " * 50 + "\n")
        inputs.append(str(path))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"a prepare worker process died .*nothing was written.*prepare\.workers"):
        lp.prepare(PrepareConfig(inputs=inputs, output=str(out / "ds"), progress=False, workers=2))
    assert not out.exists() or sorted(os.listdir(out)) == []
    # The same inputs without the dying worker prepare fine (the failure was the worker, not the data).
    monkeypatch.setenv("PYTHONPATH", ROOT)
    lp.prepare(PrepareConfig(inputs=inputs, output=str(out / "ds"), progress=False, workers=2))
    assert sorted(os.listdir(out)) == ["ds.bin", "ds.idx", "ds.json"]
