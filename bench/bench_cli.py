"""CLI latency: `meshrun --help`, `action=keys`, `action=status` and `action=logs` each answer in under TARGET_S of
wall time, measured beside `python -c "import hydra"` (the floor any Hydra app pays) in the same rounds.

Each round runs every command once as a fresh process (the installed console script), the order rotated per
round; reported: the median wall time of each over ROUNDS rounds and its ratio to the import-hydra floor.
Exits 1 when a command's median misses TARGET_S. `--write` replaces this bench's table in docs/PERFORMANCE.md
(between its markers): the measured figures live there, one current table, history in git.

    .venv/bin/python bench/bench_cli.py [--rounds 7] [--write]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from training.contract.rundir.paths import RunPaths  # noqa: E402

BEGIN, END = "<!-- bench_cli.py: begin -->", "<!-- bench_cli.py: end -->"


def _meshrun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "meshrun")
    return here if os.path.exists(here) else shutil.which("meshrun") or "meshrun"


def _commands(run_dir: str) -> dict[str, list[str]]:
    m = _meshrun()
    return {
        'python -c "import hydra"': [sys.executable, "-c", "import hydra"],
        "meshrun --help": [m, "--help"],
        "meshrun action=keys": [m, "action=keys"],
        "meshrun action=status run.dir=D": [m, "action=status", f"run.dir={run_dir}"],
        "meshrun action=logs run.dir=D logs.tail=5": [m, "action=logs", f"run.dir={run_dir}", "logs.tail=5"],
    }


def _prepare(tmp: str) -> str:
    """A planned run with a rank log: what status and logs read."""
    run_dir = os.path.join(tmp, "run")
    p = subprocess.run([_meshrun(), "action=plan", f"run.dir={run_dir}"], capture_output=True, text=True, cwd=tmp)
    if p.returncode != 0:
        sys.exit(f"bench_cli: the plan failed: {p.stderr[-2000:]}")
    os.makedirs(RunPaths(run_dir).logs, exist_ok=True)
    with open(RunPaths(run_dir).rank_log(0), "w") as f:
        f.writelines(f"[####....] {i}/100 loss 5.0\n" for i in range(100))
    return run_dir


def _time(argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench_cli: {' '.join(argv)} exited {p.returncode}: {p.stderr[-2000:]}")
    return wall


def measure(rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        commands = _commands(_prepare(tmp))
        names = list(commands)
        for name in names:  # warm-up: the page cache and bytecode, once each
            _time(commands[name], tmp)
        walls: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                walls[name].append(_time(commands[name], tmp))
    return {n: statistics.median(w) for n, w in walls.items()}


def table(medians: dict[str, float], rounds: int) -> str:
    floor = medians['python -c "import hydra"']
    load = os.getloadavg()[0]
    rows = [
        f"Median wall time of {rounds} rounds, each command a fresh process, the order rotated per round; load "
        f"average {load:.1f} at the end (`bench/bench_cli.py`).",
        "",
        "| command | target | median wall | / import hydra |",
        "|---|---|---|---|",
    ]
    for name, wall in medians.items():
        target = "-" if "import hydra" in name else f"< {TARGET_S} s"
        rows.append(f"| `{name}` | {target} | {wall:.3f} s | {wall / floor:.2f} |")
    return "\n".join(rows)


def write(text: str) -> None:
    path = os.path.join(ROOT, "docs", "PERFORMANCE.md")
    with open(path) as f:
        doc = f.read()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END) :]
    else:
        doc = doc.rstrip() + "\n\n### CLI latency\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true", help="replace this bench's table in docs/PERFORMANCE.md")
    args = ap.parse_args()
    medians = measure(args.rounds)
    text = table(medians, args.rounds)
    print(text)
    if args.write:
        write(text)
    missed = [n for n, w in medians.items() if "import hydra" not in n and w >= TARGET_S]
    if missed:
        print(f"bench_cli: missed the {TARGET_S} s target: {', '.join(missed)}", file=sys.stderr)
        return 1
    print(f"bench_cli: every command under {TARGET_S} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
