"""The rehearsal of one run directory: every selected rank on meta (in worker processes), the checks, the
table, rehearsal.json. Exit codes: 0 all checks hold, EXIT_REHEARSAL_DEFECT a defect, EXIT_FAILED a rank the
engine could not run on meta, EXIT_INVALID an unreadable run directory (training/contract/exit_codes.py)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_OK, EXIT_REHEARSAL_DEFECT
from training.contract.rundir.files import write_atomic

REHEARSAL_FILE = "rehearsal.json"

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ notes on every fake group destroyed

_CFG: Any = None  # the worker processes' config (inherited through fork)
_RUN_DIR = ""


def _one(rank: int):
    from training.rehearse.runner import rehearse_rank

    # The engine's Trainer routes SIGTERM / SIGUSR2 to its stop flag (training/run/stop.py, signals.py); put
    # the handlers back, or a pool worker would ignore the pool's terminate.
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        return rehearse_rank(_CFG, _RUN_DIR, rank, emulate="nccl" if _CFG.cluster.device == "cuda" else "gloo")
    finally:
        if threading.current_thread() is threading.main_thread():
            for s, h in before.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)


def _progress(done: int, total: int, result, t0: float) -> None:
    state = "error" if result.error else "ok"
    print(
        f"rehearse: rank {result.rank} ({done}/{total}) {state}, {len(result.calls)} calls, "
        f"{result.seconds:.1f} s; {time.perf_counter() - t0:.0f} s so far",
        file=sys.stderr,
        flush=True,
    )


def rehearse(
    cfg, run_dir: str, ranks: list[int] | None = None, workers: int = 0, quiet: bool = False, dedup: bool = True
):
    """(rehearsal.json's dict, exit code); also writes RUN_DIR/rehearsal.json. dedup: run one rank of each
    coordinate class and derive the others' calls by relabelling (training/rehearse/dedup.py); False runs
    every selected rank."""
    global _CFG, _RUN_DIR
    from training.contract.config import derived_dp
    from training.rehearse import checks, report
    from training.rehearse import dedup as dd
    from training.rehearse import ranks as rank_sel
    from training.rehearse.memory import memory_defects
    from training.rehearse.runner import rehearsal_config

    t0 = time.perf_counter()
    p = cfg.parallel
    dp = derived_dp(cfg)
    world = p.tp * p.pp * p.cp * dp
    chosen, why = rank_sel.select(p.tp, p.pp, p.cp, dp, p.ep)
    if ranks is not None:
        chosen, why = sorted(ranks), {r: "asked" for r in ranks}
    _CFG, _RUN_DIR = rehearsal_config(cfg), run_dir
    members = dd.classes(chosen, p.tp, p.pp, p.cp, dp, p.ep) if dedup else {r: [] for r in chosen}
    runs = sorted(members)
    workers = max(1, min(workers or (os.cpu_count() or 1), len(runs)))
    results = []
    if workers == 1:
        for i, r in enumerate(runs):
            results.append(_one(r))
            if not quiet:
                _progress(i + 1, len(runs), results[-1], t0)
    else:
        pool = multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=8)
        try:
            for i, res in enumerate(pool.imap_unordered(_one, runs)):
                results.append(res)
                if not quiet:
                    _progress(i + 1, len(runs), res, t0)
            pool.close()  # the workers leave on their own once the queue is done
            pool.join()
        finally:
            pool.terminate()
    for rep in list(results):
        for r in members[rep.rank]:
            results.append(dd.derive_result(rep, r, p.tp, p.pp, p.cp, dp, p.ep))
            why[r] = f"{why.get(r, '')}; derived from rank {rep.rank}".lstrip("; ")
    t_checks = time.perf_counter()
    calls = {r.rank: r.calls for r in results if not r.error}
    device = cfg.cluster.device
    defects = checks.check_matching(calls, world) + checks.check_devices(calls, device)
    if not any(d.kind == "mismatch" for d in defects):  # a mismatch already explains the hang it causes
        defects += checks.check_deadlock(calls, world)
    plan = _read_json(os.path.join(run_dir, "plan.json"))
    defects += memory_defects(results, plan)
    check_s = time.perf_counter() - t_checks
    layout = {
        "world_size": world,
        "tp": p.tp,
        "pp": p.pp,
        "cp": p.cp,
        "dp": dp,
        "ep": p.ep,
        "zero": p.zero,
        "vpp": p.vpp,
        "device": device,
    }
    doc = report.to_json(layout, results, why, defects, plan, time.perf_counter() - t0)
    doc["engine_runs"] = len(runs)
    doc["check_seconds"] = round(check_s, 2)  # the checks' own share of `seconds` (bench/bench_rehearse.py)
    write_atomic(os.path.join(run_dir, REHEARSAL_FILE), json.dumps(doc, indent=1, default=str))
    if any(r.error for r in results):
        code = EXIT_FAILED
    elif defects:
        code = EXIT_REHEARSAL_DEFECT
    else:
        code = EXIT_OK
    return doc, code


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.rehearse")
    ap.add_argument("run_dir")
    ap.add_argument("--ranks", default="", help="comma-separated ranks (default: all, or representatives)")
    ap.add_argument("--workers", type=int, default=0, help="worker processes (default: the CPU count)")
    ap.add_argument(
        "--no-dedup",
        action="store_true",
        help="run every selected rank (default: one per coordinate class, the others derived by relabelling)",
    )
    args = ap.parse_args(argv)
    from training.contract.config import load_config
    from training.rehearse.report import table

    try:
        cfg = load_config(os.path.join(args.run_dir, "config.json"))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        print(f"error: cannot read {args.run_dir}/config.json: {exc}; run `meshrun action=rehearse`", file=sys.stderr)
        return EXIT_INVALID
    cfg.run.dir = os.path.abspath(args.run_dir)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()] or None
    dedup = not args.no_dedup and os.environ.get("MESHRUN_REHEARSE_DEDUP", "1") != "0"
    doc, code = rehearse(cfg, cfg.run.dir, ranks, args.workers, dedup=dedup)
    print(table(doc))
    print(f"rehearsal.json: {os.path.join(cfg.run.dir, REHEARSAL_FILE)}")
    return code
