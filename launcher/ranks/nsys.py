"""train.nsys=true: the `nsys profile` prefix of the ranks in train.nsys_ranks (locally and in each Slurm task).

The capture range is the CUDA profiler API: the engine calls cudaProfilerStart before the first step of
train.profile_steps and cudaProfilerStop after the last (training/observe/nvtx.py), so the report holds only
those steps, with the NVTX ranges of train.nvtx. No torch here.
"""

from __future__ import annotations

import os
import shutil
import sys

from training.contract.config import Config
from training.contract.rundir.paths import RunPaths


def nsys_prefix(cfg: Config, rank: int, run_dir: str) -> list[str]:
    """The argv prefix for this global rank, or [] (train.nsys off, rank not chosen, nsys missing: said on stderr)."""
    if not cfg.train.nsys or rank not in list(cfg.train.nsys_ranks):
        return []
    if not shutil.which("nsys"):
        print(f"warning: train.nsys=true but nsys is not on PATH here: rank {rank} runs without it", file=sys.stderr)
        return []
    os.makedirs(RunPaths(run_dir).profile, exist_ok=True)
    return [
        "nsys",
        "profile",
        "--trace=cuda,nvtx,osrt",
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        "--force-overwrite=true",
        "--output",
        RunPaths(run_dir).nsys_report(rank),
    ]
