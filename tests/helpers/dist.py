"""The multi-process tests' entry to training/run/local_ranks.py.

    results = run_distributed(fn, world_size=4, args=(...,), timeout_s=120)

What the tests add to the harness: MESHRUN_TEST_START=spawn starts every test's ranks in fresh interpreters instead
of forks of the preloaded forkserver (a check that no test leans on what the forkserver imported).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from training.run.local_ranks import run_ranks


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    threads: int = 1,
    fresh: bool = False,
) -> list[Any]:
    """fn(*args) on world_size ranks (training/run/local_ranks.py run_ranks); fresh, or MESHRUN_TEST_START=spawn:
    ranks in new interpreters that have imported nothing yet."""
    fresh = fresh or os.environ.get("MESHRUN_TEST_START", "forkserver") == "spawn"
    return run_ranks(fn, world_size, args=args, timeout_s=timeout_s, threads=threads, fresh=fresh)
