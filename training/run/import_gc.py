"""Importing torch and the engine without the cyclic garbage collector, then freezing what the imports made.

Importing torch creates well over a hundred thousand objects that live as long as the process. The collector,
triggered by allocation counts, scans them again and again while they are being created, a sixth of the
import's CPU (docs/PERFORMANCE.md, "Preemption path"), on the way to a rank's first step (a cold rank's start,
a warm agent's import before its first fork after a requeue). A collection at the end would free only a few
thousand objects at the cost of another full scan, so there is none. `gc.freeze()` then moves the imported
objects to the permanent generation: later collections (in the rank's training, in every rank a warm agent
forks) no longer scan them, and a forked rank does not copy their pages by touching their headers.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
