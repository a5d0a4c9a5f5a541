"""Oracles the planner's tests compare against, apart from the planner (launcher/plan/): the published formulas
written the way their papers state them, and a Monte Carlo of checkpoint goodput. Used by tests only."""

from __future__ import annotations

import random
from fractions import Fraction


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int, setting: str) -> Fraction:
    """The six closed forms of Korthikanti et al. 2022 Table 2 (bytes per layer), exact, for the tests."""
    F = Fraction
    if setting == "none":
        return s * b * h * (34 + F(5 * a * s, h))
    if setting == "tp":
        return s * b * h * (10 + F(24, t) + F(5 * a * s, h * t))
    if setting == "tp_sp":
        return F(s * b * h, t) * (34 + F(5 * a * s, h))
    if setting == "tp_selective":
        return s * b * h * (10 + F(24, t))
    if setting == "tp_sp_selective":
        return F(34 * s * b * h, t)
    if setting == "full":
        return F(2 * s * b * h)
    raise ValueError(setting)


def narayanan_params(L: int, h: int, V: int, s: int) -> float:
    """Narayanan et al. 2021, eq. for GPT with learned positions and tied embeddings."""
    return 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def simulate_goodput(
    interval_s: float, save_s: float, restart_s: float, mtbf_s: float, work_s: float, seed: int = 0
) -> float:
    """Monte Carlo of the same job: exponential failures (also during saves and restarts), each failure costs the
    restart and the work since the last complete checkpoint; returns work_s / the wall time it took."""
    rng = random.Random(seed)
    wall, done = 0.0, 0.0
    while done < work_s:
        segment = min(interval_s, work_s - done)
        need = segment + (save_s if done + segment < work_s else 0.0)  # the last segment needs no save
        while True:
            fail_in = rng.expovariate(1.0 / mtbf_s)
            if fail_in >= need:
                wall += need
                done += segment
                break
            wall += fail_in  # the segment's work is lost; restart, which may fail too
            while True:
                fail_in = rng.expovariate(1.0 / mtbf_s)
                if fail_in >= restart_s:
                    wall += restart_s
                    break
                wall += fail_in
    return work_s / wall
