"""A 64-point `meshrun -m action=plan` sweep through the real CLI: against one `meshrun action=plan`
(target: the sweep's wall time at most 2.5x the single plan's) and against Hydra's basic sweeper.

    .venv/bin/python bench/bench_sweep_plan.py [--reps N]

The launcher imports no torch, so a point costs config composition plus microseconds of arithmetic.
Hydra's basic sweeper+launcher compose every point twice (~150 ms each); hydra_plugins/meshrun_sweep
composes once per set of group choices, copies configs by pickle and skips run_job's redundant copies
(_composer.py, _run_job.py). Both sweepers must give the same sweep.json rows.
The single plan and the sweep run alternately, N times each (the machine is shared: medians).
Exit 1 when the ratio misses the target or the rows differ.
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

OVERRIDES = [
    "action=plan",
    "model=gpt_1p3b",
    "cluster=dgx_h100",
    "cluster.nodes=8",
    "train.precision=bf16",
    "parallel.sp=false",
    "parallel.global_batch=512",
    "parallel.tp=1,2,4,8",
    "parallel.pp=1,2,4,8",
    "parallel.micro_batch=1,2,4,8",
]


BASIC = ["hydra/sweeper=basic", "hydra/launcher=basic"]
TARGET_RATIO = 2.5
"""The target: a 64-point plan sweep in at most 2.5x the wall time of one plan."""


def run_single() -> dict:
    """One `meshrun action=plan` of the sweep's first point, in a fresh process: wall and CPU seconds."""
    single = [o.split(",")[0] for o in OVERRIDES]
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(
            [PYTHON, "-m", "launcher", *single, f"run.dir={os.path.join(tmp, 'run')}"],
            cwd=tmp,
            env=dict(os.environ, PYTHONPATH=ROOT),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            raise SystemExit(f"single plan failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def run_sweep(extra: list) -> dict:
    """One sweep in a fresh process: wall and CPU seconds, and its sweep.json."""
    with tempfile.TemporaryDirectory() as tmp:
        sweep = os.path.join(tmp, "sweep")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(
            [PYTHON, "-m", "launcher", "-m", *OVERRIDES, *extra, f"hydra.sweep.dir={sweep}"],
            cwd=tmp,
            env=dict(os.environ, PYTHONPATH=ROOT),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if p.returncode != 0:
            raise SystemExit(f"sweep {' '.join(extra) or '(meshrun)'} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        data = json.load(open(RunPaths(sweep).sweep))
    return {"wall": wall, "cpu": cpu, "data": data}


def _rows(data: dict) -> list:
    """The summary rows without the per-run directory, for comparing two sweeps."""
    return [{k: v for k, v in r.items() if k != "run_dir"} for r in data["feasible"] + data["infeasible"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="alternations of single plan and sweep (medians)")
    args = ap.parse_args()
    singles, sweeps = [], []
    for _ in range(args.reps):
        singles.append(run_single())
        sweeps.append(run_sweep([]))
    base = run_sweep(BASIC)
    new = sweeps[-1]
    n = len(new["data"]["points"])
    med = {
        k: {f: statistics.median(r[f] for r in rs) for f in ("wall", "cpu")}
        for k, rs in (("single", singles), ("sweep", sweeps))
    }
    print(
        f"points {n} (feasible {len(new['data']['feasible'])}, infeasible {len(new['data']['infeasible'])}); "
        f"medians of {args.reps} alternating runs"
    )
    print(f"{'':28} {'wall s':>8} {'cpu s':>8} {'cpu ms/point':>13}")
    print(f"{'one meshrun action=plan':28} {med['single']['wall']:8.2f} {med['single']['cpu']:8.2f} {'':>13}")
    for name, r in (("hydra basic sweeper", base), ("meshrun sweeper (default)", med["sweep"])):
        print(f"{name:28} {r['wall']:8.2f} {r['cpu']:8.2f} {1000 * r['cpu'] / n:13.1f}")
    ratio = med["sweep"]["wall"] / med["single"]["wall"]
    cpu_ratio = med["sweep"]["cpu"] / med["single"]["cpu"]
    print(f"sweep / single plan: {ratio:.2f}x wall, {cpu_ratio:.2f}x cpu (target <= {TARGET_RATIO}x wall)")
    print(
        f"speed-up over the basic sweeper: {base['cpu'] / med['sweep']['cpu']:.1f}x cpu, "
        f"{base['wall'] / med['sweep']['wall']:.1f}x wall "
        f"(times include interpreter start; wall >> cpu means other processes share the cores)"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    same = _rows(new["data"]) == _rows(base["data"])
    print("sweep.json rows identical to the basic sweeper's:", same)
    print(
        json.dumps(
            {
                "bench": "sweep_plan",
                "points": n,
                "single_wall_s": round(med["single"]["wall"], 3),
                "sweep_wall_s": round(med["sweep"]["wall"], 3),
                "ratio_wall": round(ratio, 3),
                "ratio_cpu": round(cpu_ratio, 3),
                "target": TARGET_RATIO,
                "rows_identical": same,
            }
        )
    )
    return 0 if n == 64 and same and ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
