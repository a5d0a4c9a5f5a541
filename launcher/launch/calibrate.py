"""recommend.calibrate=true: run the top candidates for a few steps here and compare their measured step times
with the predicted ones (Spearman rank correlation).

Each candidate runs through the normal local path (launcher/launch/gate.py's plan_or_reject, then
launcher/launch/local.py's run_ranks) into run.dir/calibrate/NN, on synthetic data (throughput does not depend on the
token values), with no periodic checkpoint; its measured step time is the median step_time_s of metrics.jsonl
without the first (warm-up) step.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from launcher.plan.estimate import fmt_seconds
from training.contract.config import Config, DataConfig, RecommendConfig
from training.contract.exit_codes import EXIT_OK
from training.contract.rundir.metrics import read_rows
from training.contract.rundir.paths import RunPaths


def ranks_of(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation: Pearson's correlation of the ranks; None for fewer than 2 pairs or no spread."""
    if len(a) < 2:
        return None
    ra, rb = ranks_of(a), ranks_of(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else None


def choose(cands: list[Any], count: int, min_gap: float) -> list[Any]:
    """The fastest candidates, each predicted at least min_gap slower than the previous one chosen."""
    out: list[Any] = []
    for c in cands:
        if not out or c.step_s >= out[-1].step_s * (1 + min_gap):
            out.append(c)
        if len(out) == count:
            break
    return out


def measured_step_s(run_dir: str) -> float | None:
    """Median step_time_s of the run's metrics.jsonl without the first step; None without two steps."""
    rows = read_rows(run_dir)
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and "loss" in r][1:]
    return statistics.median(times) if times else None


def _run_config(cfg: Config, cand_cfg: Config, run_dir: str, steps: int) -> Config:
    t = replace(
        cfg.train,
        steps=steps,
        warmup_steps=min(cfg.train.warmup_steps, 1),
        checkpoint_every=0,
        checkpointing=False,  # no save, and no background import of the save path inside the measured steps
        checkpoint_every_min="0",
        exit_interval=0,
        exit_after_min=0.0,
        eval_every=0,
        log_every=1,
        progress=False,
        resume="none",
        init_from="",
    )
    return replace(
        cand_cfg,
        action="train",
        train=t,
        data=DataConfig(kind="synthetic"),
        run=replace(cfg.run, dir=run_dir),
        resolved=replace(cand_cfg.resolved, checkpoint_every_min=None),
    )


def _run_once(cfg: Config, c: Any, sub: str, steps: int):
    """(exit code or None when the plan refused it, median step seconds or None) of one calibration run."""
    from launcher.launch.gate import plan_or_reject
    from launcher.launch.local import run_ranks

    run_cfg = _run_config(cfg, c.cfg, sub, steps)
    with contextlib.redirect_stdout(io.StringIO()):  # the plan table of every run would drown the ranking
        try:
            planned = plan_or_reject(run_cfg, sub)
        except SystemExit:
            planned = {"status": "invalid"}
    code = run_ranks(run_cfg, sub) if planned.get("status") == "ok" else None
    return code, (measured_step_s(sub) if code == EXIT_OK else None)


def calibrate(cfg: Config, run_dir: str, cands: list[Any], rc: RecommendConfig) -> dict[str, Any]:
    """Run the chosen candidates; set each one's measured_step_s; print and return the comparison.

    Outside load on a shared machine arrives in bursts that can slow one whole run: each candidate runs in
    recommend.calibrate_passes passes (calibrate_steps / passes steps each, at least 3), the order reversed in every other pass so
    that a burst does not hit the same end of the list twice, and its measured step time is the lower of its passes'
    medians (load only ever slows a run down). Pass k > 0 runs into calibrate/NN_k."""
    chosen = choose(cands, rc.calibrate_count, rc.calibrate_min_gap)
    passes = rc.calibrate_passes
    steps = max(3, -(-rc.calibrate_steps // passes))
    print(
        f"  calibrating {len(chosen)} candidates ({passes} pass{'es' if passes > 1 else ''} of {steps} steps each) under {run_dir}/calibrate/",
        file=sys.stderr,
    )
    found: list[list[float]] = [[] for _ in chosen]
    codes: list[Any] = [None] * len(chosen)
    for k in range(passes):
        order = list(range(len(chosen))) if k % 2 == 0 else list(reversed(range(len(chosen))))
        for i in order:
            if k > 0 and codes[i] != EXIT_OK:
                continue  # a candidate that failed once is not run again
            sub = os.path.join(RunPaths(run_dir).calibrate, f"{i:02d}" + (f"_{k}" if k else ""))
            codes[i], t = _run_once(cfg, chosen[i], sub, steps)
            if t is not None:
                found[i].append(t)
    runs = []
    for i, c in enumerate(chosen):
        code = codes[i]
        c.measured_step_s = min(found[i]) if found[i] and code == EXIT_OK else None
        runs.append(
            {
                "rank": c.rank,
                "layout": c.short(),
                "overrides": c.overrides(),
                "run_dir": os.path.join(RunPaths(run_dir).calibrate, f"{i:02d}"),
                "predicted_step_s": c.step_s,
                "measured_step_s": c.measured_step_s,
                "measured_passes_s": found[i],
                "exit_code": code,
            }
        )
        print(
            f"  [{i + 1}/{len(chosen)}] {c.short()}: predicted {fmt_seconds(c.step_s)}, measured "
            + (fmt_seconds(c.measured_step_s) if c.measured_step_s is not None else f"nothing (exit {code})"),
            file=sys.stderr,
        )
    done = [r for r in runs if r["measured_step_s"] is not None]
    rho = spearman([r["predicted_step_s"] for r in done], [r["measured_step_s"] for r in done])
    by_measured = sorted(done, key=lambda r: r["measured_step_s"])
    print("  calibration (fastest measured first):")
    for r in by_measured:
        print(
            f"    #{r['rank']:<4} {r['layout']:<40} predicted {fmt_seconds(r['predicted_step_s']):>9}  "
            f"measured {fmt_seconds(r['measured_step_s']):>9}"
        )
    print(
        "  Spearman rank correlation, predicted vs measured step time: "
        + (f"{rho:.3f} over {len(done)} layouts" if rho is not None else "n/a (fewer than 2 runs measured)")
    )
    return {
        "runs": runs,
        "spearman": rho,
        "measured_order": [r["rank"] for r in by_measured],
        "recommended": by_measured[0]["overrides"] if by_measured else None,
    }


def run_recommend(cfg: Config, run_dir: str) -> dict[str, Any]:
    """meshrun action=recommend (launcher/cli/actions.py): launcher/recommend/recommend.py's ranking, calibrated
    here when recommend.calibrate=true. The entry is here so that recommend.py, whose search parallel=auto and elastic
    re-plans import (launcher/slurm/elastic.py), does not import this module's launch path (an import circle)."""
    from launcher.recommend.recommend import run_recommend as rank

    return rank(cfg, run_dir, calibrate=calibrate)
