"""Ending a process that has torch loaded without the interpreter's finalisation (a rank after a completed run
or a stop, a warm agent when its allocation ends)."""

from __future__ import annotations

import os
import sys


def exit_without_finalising(code: int) -> None:
    """End the process as Python would, minus the interpreter's finalisation (after a completed run or a stop).

    With torch loaded, tearing the interpreter down (every module's objects, libtorch's static destructors)
    takes a second or more per process after its work is done (docs/PERFORMANCE.md, "Slurm turnaround"), and a
    requeued job waits for the slowest process of the allocation (each rank, each node's warm agent) to end
    before it can restart. Everything that finalisation could still do for us is done here first, in Python's
    own order: non-daemon threads are joined (a checkpoint writer), atexit handlers run (a W&B run is
    finished), and stdout/stderr are flushed. What is skipped frees memory the kernel reclaims anyway."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        # What the interpreter's own exit runs first: threading's exit hooks (an idle executor's workers are
        # told to stop; joined without that they would wait for work forever), then every non-daemon thread.
        shutdown()
    else:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
