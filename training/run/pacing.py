"""Step pacing, for meshrun's own tests and benchmarks only (not a user key): a run that only has to stay alive until
something happens to it (a signal, a cancel, a lost node) on a machine it shares waits out the rest of each step
instead of spinning every core it has. Set through the environment of the ranks, e.g. `+cluster.env.MESHRUN_PACE_STEP_S=2`
on the command line (CONTRIBUTING.md); read here only, once per Trainer (training/run/loop.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

PACE_ENV = "MESHRUN_PACE_STEP_S"
"""The shortest wall time of a step in seconds; unset or 0: never waits."""


def pace_step_s(environ: Mapping[str, str] = os.environ) -> float:
    """The pacing the environment asks for (0.0 when unset); a value that is not a number >= 0 is an error that
    names the fix."""
    text = environ.get(PACE_ENV, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{PACE_ENV}={text!r} must be a number of seconds >= 0 (fix: {PACE_ENV}=0, or unset it)")
    return value
