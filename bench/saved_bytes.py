"""Bytes autograd saves for backward in one micro-batch's forward of a run's model, for bench/gpu_check.sh: the
activation memory the planner estimates (launcher/plan/memory.py), measured on any device, independent of the
allocator, by the engine's counter (training/observe/saved_bytes.py).

Usage: python bench/saved_bytes.py RUN_DIR     # one process; prints {"saved_activation_bytes": N, ...}

RUN_DIR's config.json must name a one-rank layout (tp = pp = cp = 1; dp is taken as 1). The measurement runs in a
scratch copy of the run's config and plan: it writes nothing into the run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    from training.contract.config import load_config
    from training.contract.rundir.paths import RunPaths
    from training.observe.saved_bytes import saved_activation_bytes
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/saved_bytes.py RUN_DIR", file=sys.stderr)
        return 2
    src = argv[0]
    cfg = load_config(RunPaths(src).config)
    if cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp != 1:
        print("saved_bytes measures a one-rank layout (tp = pp = cp = 1)", file=sys.stderr)
        return 2
    cfg.parallel.dp = 1
    with tempfile.TemporaryDirectory() as tmp:
        for path in (RunPaths(src).config, RunPaths(src).plan):
            if os.path.exists(path):
                shutil.copy(path, tmp)
        device = "cuda" if str(cfg.cluster.device) == "cuda" else "cpu"
        # No checkpointer: a process that only builds a Trainer keeps SIGTERM's default (training/run/loop.py).
        trainer = Trainer(cfg, tmp, ProcessMesh.single(device), checkpointing=False)
        n = saved_activation_bytes(trainer)
    print(
        json.dumps(
            {
                "saved_activation_bytes": n,
                "micro_batch": cfg.parallel.micro_batch,
                "precision": str(cfg.train.precision),
                "device": str(cfg.cluster.device),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
