"""`meshrun action=recommend` over GPT-3 175B on 128 DGX H100 nodes (thousands of layouts searched) against one
`meshrun action=plan` of the same model and cluster, both through the real CLI in fresh processes
(target: the search's wall time at most 8x the single plan's).

    .venv/bin/python bench/bench_recommend.py [--reps N]

The search plans every layout of tp x pp x vpp x cp x dp x micro-batch x sp x recompute x zero x offload that the
validator accepts, in one process: what it costs beyond one plan is the arithmetic of each layout (the launcher
imports no torch). This was a 20 s clock limit inside tests/launcher/recommend/test_recommend.py, which a loaded machine
broke; here both sides are measured the same way (fresh interpreter, alternated, medians) and the ratio is judged.
Exit 1 when the ratio misses the target or the search planned fewer than 5,000 layouts.
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

PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable

COMMON = [
    "model=gpt3_175b",
    "cluster=dgx_h100",
    "cluster.nodes=128",
    "parallel=korthikanti_175b",
    "parallel.global_batch=1536",
    "parallel.dp=null",
]
SEARCH = ["action=recommend", "recommend.probe=false"]
SINGLE = ["action=plan"]
TARGET_RATIO = 8.0
"""The target: the whole search in at most 8x the wall time of one plan of its configured layout."""
MIN_SEARCHED = 5000
"""The search must plan at least this many layouts (the space of the 175B case on 1,024 GPUs)."""


def run_cli(extra: list) -> dict:
    """One meshrun process: wall and CPU seconds, and recommend.json when it wrote one."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(
            [PYTHON, "-m", "launcher", *extra, *COMMON, f"run.dir={run_dir}"],
            cwd=tmp,
            env=dict(os.environ, PYTHONPATH=ROOT),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            raise SystemExit(f"meshrun {' '.join(extra)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        path = RunPaths(run_dir).recommend
        data = json.load(open(path)) if os.path.exists(path) else {}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "data": data}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="alternations of single plan and search (medians)")
    args = ap.parse_args()
    singles, searches = [], []
    for _ in range(args.reps):
        singles.append(run_cli(SINGLE))
        searches.append(run_cli(SEARCH))
    searched = searches[-1]["data"].get("searched", 0)
    med = {
        k: {f: statistics.median(r[f] for r in rs) for f in ("wall", "cpu")}
        for k, rs in (("single", singles), ("search", searches))
    }
    ratio = med["search"]["wall"] / med["single"]["wall"]
    cpu_ratio = med["search"]["cpu"] / med["single"]["cpu"]
    print(f"layouts searched {searched}; medians of {args.reps} alternating runs")
    print(f"{'':28} {'wall s':>8} {'cpu s':>8}")
    print(f"{'one meshrun action=plan':28} {med['single']['wall']:8.2f} {med['single']['cpu']:8.2f}")
    print(f"{'meshrun action=recommend':28} {med['search']['wall']:8.2f} {med['search']['cpu']:8.2f}")
    print(f"search / single plan: {ratio:.2f}x wall, {cpu_ratio:.2f}x cpu (target <= {TARGET_RATIO}x wall)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        json.dumps(
            {
                "bench": "recommend",
                "searched": searched,
                "single_wall_s": round(med["single"]["wall"], 3),
                "search_wall_s": round(med["search"]["wall"], 3),
                "ratio_wall": round(ratio, 3),
                "ratio_cpu": round(cpu_ratio, 3),
                "target": TARGET_RATIO,
            }
        )
    )
    return 0 if searched >= MIN_SEARCHED and ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
