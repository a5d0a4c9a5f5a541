"""`meshrun action=rehearse` speed on this machine: the wall clock of a whole rehearsal (plan, every rank on
meta, the checks, rehearsal.json) against its target, for two layouts:
- every rank of a 64-GPU llama3_8b layout (tp 4 x pp 2 x dp 8, ZeRO-1, dgx_h100): target under 120 s;
- representative mode of a 1,024-GPU llama3_70b layout (tp 8 x pp 2 x dp 64, ZeRO-1, 128 dgx_h100 nodes): target
  under 180 s.
Each rehearsal must also pass (exit 0): a defect or a rank the engine cannot run fails the bench too.
The rehearsal uses every core (one worker process each); the target is for a 2-core machine.

Usage: python bench/bench_rehearse.py [--only 8b|70b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from training.contract.rundir.paths import RunPaths  # noqa: E402

MESHRUN = [sys.executable, "-m", "launcher"]

CASES = {
    "8b": (
        120.0,
        [
            "model=llama3_8b",
            "cluster=dgx_h100",
            "cluster.nodes=8",
            "parallel.tp=4",
            "parallel.sp=true",
            "parallel.pp=2",
            "parallel.dp=8",
            "parallel.zero=1",
            "parallel.micro_batch=1",
            "parallel.global_batch=64",
            "train.precision=bf16",
        ],
    ),
    "70b": (
        180.0,
        [
            "model=llama3_70b",
            "parallel=tp8_pp2",
            "cluster=dgx_h100",
            "cluster.nodes=128",
            "parallel.dp=64",
            "parallel.zero=1",
            "parallel.micro_batch=1",
            "parallel.global_batch=512",
            "train.precision=bf16",
        ],
    ),
}


def run(name: str, target: float, overrides) -> bool:
    run_dir = tempfile.mkdtemp(prefix=f"bench-rehearse-{name}-")
    t0 = time.perf_counter()
    p = subprocess.run(
        MESHRUN + ["action=rehearse", f"run.dir={run_dir}"] + overrides,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.perf_counter() - t0
    ranks = "?"
    try:
        with open(RunPaths(run_dir).rehearsal) as f:
            doc = json.load(f)
        ranks = f"{doc['rehearsed_ranks']} of {doc['layout']['world_size']} ranks, checks {doc['check_seconds']} s"
    except (OSError, ValueError):
        pass
    ok = p.returncode == 0 and wall < target
    print(
        f"{name}: {wall:.1f} s for {ranks} (target < {target:.0f} s), exit {p.returncode} -> {'ok' if ok else 'MISS'}"
    )
    if p.returncode != 0:
        print(p.stdout[-3000:] + p.stderr[-3000:])
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(CASES), default="")
    args = ap.parse_args()
    results = [run(n, *CASES[n]) for n in sorted(CASES) if not args.only or n == args.only]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
