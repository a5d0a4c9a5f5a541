"""A 64-point `meshrun -m action=plan` sweep through the real CLI: meshrun's sweeper vs Hydra's basic one.

    .venv/bin/python bench/bench_sweep_plan.py

The launcher imports no torch, so a point costs config composition plus microseconds of arithmetic.
Hydra's basic sweeper+launcher compose every point twice (~150 ms each); hydra_plugins/meshrun_sweep
composes once per set of group choices. Both runs must give the same sweep.json rows.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable

OVERRIDES = [
    "action=plan", "model=gpt_1p3b", "cluster=dgx_h100", "cluster.nodes=8", "train.precision=bf16",
    "parallel.sp=false", "parallel.global_batch=512",
    "parallel.tp=1,2,4,8", "parallel.pp=1,2,4,8", "parallel.micro_batch=1,2,4,8",
]


BASIC = ["hydra/sweeper=basic", "hydra/launcher=basic"]


def run_sweep(extra: list) -> dict:
    """One sweep in a fresh process: wall and CPU seconds, and its sweep.json."""
    with tempfile.TemporaryDirectory() as tmp:
        sweep = os.path.join(tmp, "sweep")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run([PYTHON, "-m", "launcher", "-m", *OVERRIDES, *extra, f"hydra.sweep.dir={sweep}"],
                           cwd=tmp, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if p.returncode != 0:
            raise SystemExit(f"sweep {' '.join(extra) or '(meshrun)'} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        data = json.load(open(os.path.join(sweep, "sweep.json")))
    return {"wall": wall, "cpu": cpu, "data": data}


def _rows(data: dict) -> list:
    """The summary rows without the per-run directory, for comparing two sweeps."""
    return [{k: v for k, v in r.items() if k != "run_dir"} for r in data["feasible"] + data["infeasible"]]


def main() -> int:
    new = run_sweep([])
    base = run_sweep(BASIC)
    n = len(new["data"]["points"])
    print(f"points {n} (feasible {len(new['data']['feasible'])}, infeasible {len(new['data']['infeasible'])})")
    print(f"{'':28} {'wall s':>8} {'cpu s':>8} {'cpu ms/point':>13}")
    for name, r in (("hydra basic sweeper", base), ("meshrun sweeper (default)", new)):
        print(f"{name:28} {r['wall']:8.2f} {r['cpu']:8.2f} {1000 * r['cpu'] / n:13.1f}")
    print(f"speed-up: {base['cpu'] / new['cpu']:.1f}x cpu, {base['wall'] / new['wall']:.1f}x wall "
          f"(times include interpreter start; wall >> cpu means other processes share the cores)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    same = _rows(new["data"]) == _rows(base["data"])
    print("sweep.json rows identical to the basic sweeper's:", same)
    return 0 if n == 64 and same else 1


if __name__ == "__main__":
    sys.exit(main())
