"""bench_engine.py section 4's statistic: a ratio over two consecutive lock-step rounds gives each side one step
that follows its own step and one that follows the other side's, so a cost that depends only on what ran just
before (threads still awake, or the other process's threads still spinning) cancels instead of deciding the
median."""

from __future__ import annotations

import importlib.util
import os
import statistics

from helpers import ROOT


def _bench_engine():
    spec = importlib.util.spec_from_file_location("bench_engine", os.path.join(ROOT, "bench", "bench_engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lockstep(rounds: int, base: dict[str, float], after_other: float) -> tuple[list[float], list[float]]:
    """Step times of the lock-step order (engine-plain, then plain-engine, ...) when a step costs `base` of its
    side, plus `after_other` when the step before it was the other side's."""
    times: dict[str, list[float]] = {"engine": [], "plain": []}
    previous = "engine"  # the first round's engine step follows the engine's own warm-up
    for r in range(rounds):
        for side in ("engine", "plain") if r % 2 == 0 else ("plain", "engine"):
            times[side].append(base[side] + (after_other if previous != side else 0.0))
            previous = side
    return times["engine"], times["plain"]


def test_two_round_ratio_cancels_what_ran_before():
    bench = _bench_engine()
    # The engine 10 % faster at a few milliseconds a step; a step after the other side's costs 4 ms more.
    engine, plain = _lockstep(30, {"engine": 0.0090, "plain": 0.0099}, after_other=0.004)
    per_round = [p / e for e, p in zip(engine, plain)]
    # One ratio per order, far apart: their median is decided by which cluster has one more round.
    assert max(per_round) > 1.3 and min(per_round) < 0.85
    ratios = bench.round_pair_ratios(engine, plain)
    assert len(ratios) == 15
    expected = (0.0099 * 2 + 0.004) / (0.0090 * 2 + 0.004)
    assert all(abs(r - expected) < 1e-12 for r in ratios)
    assert statistics.median(ratios) > 1.0


def test_two_round_ratio_pairs_rounds_in_order():
    bench = _bench_engine()
    engine = [1.0, 2.0, 3.0, 4.0]
    plain = [2.0, 2.0, 3.0, 5.0]
    assert bench.round_pair_ratios(engine, plain) == [4.0 / 3.0, 8.0 / 7.0]
