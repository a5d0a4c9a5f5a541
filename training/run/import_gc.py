"""Importing torch and the engine without the cyclic garbage collector, then freezing what the imports made.

Importing torch creates about 180,000 objects that live as long as the process. The collector, triggered by
allocation counts, scans them again and again while they are being created: about 0.3 s of CPU of a 1.7-1.9 s
import on this project's test machine (docs/PERFORMANCE.md, "Preemption path"), on the way to a rank's first
step (a cold rank's start, a warm agent's import before its first fork after a requeue). Collecting once at
the end would free only a few thousand objects for another 0.13 s, so it is skipped. `gc.freeze()` then moves
the imported objects to the permanent generation: later collections (in the rank's training, in every rank a
warm agent forks) no longer scan them, and a forked rank does not copy their pages by touching their headers.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Collector off inside; on exit (also on an error) everything tracked so far is frozen and the collector
    is back on if it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
