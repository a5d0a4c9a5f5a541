"""Issue 28: a resume reads its checkpoint without torch.distributed.checkpoint (training/checkpoint/lean_read.py).

On the stand-in model of tests/helpers/checkpoint.py (every tensor a known function of name and position), in one
spawn of 2 gloo ranks:
- a checkpoint saved by one process is loaded at dp=2 zero=1 (each rank its ZeRO shard, the weights replicated):
  exact, and DCP is never imported on that path;
- a checkpoint saved at tp=2 is loaded at tp=2, at tp=1 x dp=2 zero=1 and at zero=0, once through the lean reader
  and once through DCP (what a checkpoint the lean reader does not handle goes through): exact both ways.
"""

from __future__ import annotations

import os
import sys

from helpers.checkpoint import load_check, save_worker
from helpers.dist import run_distributed

LAYOUTS = [(2, 1, 0), (1, 2, 1), (1, 2, 0)]


def _worker(one_process_run: str, tp2_run: str):
    from training.checkpoint import lean_read
    from training.checkpoint.manager import CheckpointManager

    paths = []
    for name in ("_load_lean", "_load_dcp"):
        real = getattr(CheckpointManager, name)

        def counted(self, *a, _real=real, _name=name, **k):
            paths.append(_name)
            return _real(self, *a, **k)

        setattr(CheckpointManager, name, counted)
    out = {}
    load_check(one_process_run, 1, 2, 1)
    out["dcp_imported_by_lean_resume"] = "torch.distributed.checkpoint" in sys.modules
    save_worker(tp2_run, 2, 1, 0, destroy=False)
    for tp, dp, zero in LAYOUTS:
        load_check(tp2_run, tp, dp, zero)
    real_supported = lean_read.supported
    lean_read.supported = lambda *a, **k: False
    try:
        for tp, dp, zero in LAYOUTS:
            mesh = load_check(tp2_run, tp, dp, zero)
    finally:
        lean_read.supported = real_supported
    mesh.destroy()
    out["paths"] = paths
    return out


def test_resume_reads_without_dcp_and_matches_dcp_at_every_layout(tmp_path):
    one_process_run, tp2_run = str(tmp_path / "one"), str(tmp_path / "tp2")
    os.makedirs(tp2_run)
    save_worker(one_process_run, 1, 1, 0)
    results = run_distributed(_worker, 2, args=(one_process_run, tp2_run), timeout_s=240, fresh=True)
    for r in results:
        assert r["dcp_imported_by_lean_resume"] is False
        assert r["paths"] == ["_load_lean"] * (1 + len(LAYOUTS)) + ["_load_dcp"] * len(LAYOUTS), r["paths"]
