"""Stop requests by signal: SIGUSR2 (Slurm's warning before the time limit) or SIGTERM (preemption).

The handler only sets a flag (async-signal safe); the loop asks at each step boundary, and the answer is
agreed over all ranks with one all-reduce (MAX), so every rank saves the same step together even when
the signal reached only some of them.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

_received: dict[str, str | None] = {"name": None}
_lock = threading.Lock()


def _handler(signum, _frame) -> None:
    _received["name"] = signal.Signals(signum).name


def install(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """Route the stop signals to the flag (main thread only, as Python requires)."""
    for sig in signals:
        signal.signal(sig, _handler)


def ignore(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """After the final (or stopping) checkpoint: ignore the stop signals from now on. SIG_IGN because
    Python puts its own handlers back to the default action (terminate) while the interpreter shuts
    down, so a late Slurm signal would otherwise kill a rank that ended cleanly (exit 0/3 -> failure)."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def received() -> str | None:
    """Name of the stop signal this process got ("SIGUSR2"), or None."""
    return _received["name"]


def clear() -> None:
    with _lock:
        _received["name"] = None
