"""A 64-point `meshrun -m action=plan` sweep through the real CLI: wall time and time per point.

    .venv/bin/python bench/bench_sweep_plan.py

The launcher imports no torch, so a point costs Hydra's composition plus microseconds of arithmetic.
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


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        sweep = os.path.join(tmp, "sweep")
        t0 = time.perf_counter()
        p = subprocess.run([PYTHON, "-m", "launcher", "-m", *OVERRIDES, f"hydra.sweep.dir={sweep}"],
                           cwd=tmp, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = ru.ru_utime + ru.ru_stime
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-3000:])
            return 1
        data = json.load(open(os.path.join(sweep, "sweep.json")))
    n = len(data["points"])
    print(f"points {n} (feasible {len(data['feasible'])}, infeasible {len(data['infeasible'])})")
    print(f"wall {wall:.2f} s for the whole sweep incl. interpreter start, {1000 * wall / n:.1f} ms per point")
    print(f"cpu {cpu:.2f} s ({1000 * cpu / n:.1f} ms per point; wall >> cpu means other processes share the cores)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0 if n == 64 else 1


if __name__ == "__main__":
    sys.exit(main())
