"""Warm rank starts of a local launch (cluster.warm_start, launcher/ranks/warm/local.py): CPU seconds and wall
time of a whole local `meshrun` run with a warm agent forking the ranks against the same run with every rank
started cold (cluster.warm_start=false), alternated.

Each side is the real launcher (`python -m launcher`) on the default config with --ranks local ranks
(cluster.gpus_per_node; the default layout: tp=2, dp derived) and train.steps=--steps, in a fresh run directory
each time. CPU seconds: the launcher and every process under it (ranks, agent), from this process's children's
resource usage. `--rounds` rounds, each runs both sides, the order alternating from round to round. Reported: each side's runs, the medians
and the median of the per-round ratios warm / cold for CPU and wall. Target: CPU ratio <= --target (default
0.8: the ranks no longer pay a Python start and torch's import each). Exits 1 on a miss; the last line is the
figures as one JSON object.
Usage: python bench/bench_local_warm.py [--ranks 4] [--steps 3] [--rounds 3] [--target 0.8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from training.contract.rundir.paths import RunPaths  # noqa: E402


def _run(run_dir: str, ranks: int, steps: int, warm: bool) -> dict:
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "cluster=local",
        f"cluster.gpus_per_node={ranks}",
        f"train.steps={steps}",
        "train.progress=false",
        "train.tensorboard=false",
        f"cluster.warm_start={str(warm).lower()}",
        f"run.dir={run_dir}",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        sys.exit(f"{'warm' if warm else 'cold'} run failed ({res.returncode}): {res.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(RunPaths(run_dir).events) as f:
        events = [json.loads(line) for line in f if line.strip()]
    forked = [ev.get("warm_ranks") for ev in events if ev.get("event") == "ranks_started"]
    if warm and forked != [list(range(ranks))]:
        sys.exit(f"the warm run's ranks were not all forked: {forked}")
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.8)
    args = ap.parse_args()
    runs: dict = {"warm": [], "cold": []}
    ratios: dict = {"cpu": [], "wall": []}
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["warm", "cold"] if i % 2 == 0 else ["cold", "warm"]
            got = {}
            for side in order:
                got[side] = _run(os.path.join(tmp, f"{side}{i}"), args.ranks, args.steps, side == "warm")
                runs[side].append(got[side])
                print(f"round {i + 1} {side}: {got[side]['cpu_s']:.2f} CPU s, {got[side]['wall_s']:.2f} s wall")
            for key in ratios:
                ratios[key].append(got["warm"][f"{key}_s"] / got["cold"][f"{key}_s"])
    figures = {
        "ranks": args.ranks,
        "steps": args.steps,
        "warm": runs["warm"],
        "cold": runs["cold"],
        "median_cpu_s": {s: statistics.median(r["cpu_s"] for r in runs[s]) for s in runs},
        "median_wall_s": {s: statistics.median(r["wall_s"] for r in runs[s]) for s in runs},
        "cpu_ratio": round(statistics.median(ratios["cpu"]), 3),
        "wall_ratio": round(statistics.median(ratios["wall"]), 3),
        "load_average_end": round(os.getloadavg()[0], 1),
        "target_cpu_ratio": args.target,
    }
    print(
        f"warm / cold: CPU {figures['cpu_ratio']:.2f}x, wall {figures['wall_ratio']:.2f}x (target CPU <= {args.target})"
    )
    print(json.dumps(figures))
    return 0 if figures["cpu_ratio"] <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
