"""A rank started by a local launcher stops when that launcher dies (pure Python, Linux).

The ranks hold the run directory's lock (they inherit it), so ranks that outlived a launcher killed with -9
kept the run locked under a pid that no longer exists, and a relaunch was refused. Each rank therefore asks
the kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG): SIGTERM is the rank's own stop path
(training/run/signals.py: it saves the step just trained and exits 3), after which the lock is free
and a relaunch takes it over (`lock_taken_over`). The rank's output went to the launcher through a pipe that
is gone with it: writes to a closed pipe are dropped from then on instead of raising in the stop path.
A warm rank (launcher/ranks/warm/local.py) is the child of the launch's warm agent, not of the launcher: its
death signal then follows the agent (which outlives its ranks unless it is killed), and the launcher's death
reaches it through the agent's connection, which SIGTERMs the rank when the launcher's end closes
(training/run/warm_agent.py); the check below still catches a launcher that died before the rank got here.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import sys

LAUNCHER_PID_ENV = "MESHRUN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


class _DropWhenClosed(io.TextIOBase):
    """A text stream that writes to `stream` until its reader is gone (EPIPE), then discards."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if self._stream is not None:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ValueError):
                self._stream = None
        return len(text)

    def flush(self):
        if self._stream is not None:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                self._stream = None

    def fileno(self):
        return self._stream.fileno() if self._stream is not None else os.open(os.devnull, os.O_WRONLY)

    def isatty(self):
        return False

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")


def follow_launcher() -> None:
    """In a rank: SIGTERM when the local launcher that started it dies (no-op elsewhere)."""
    pid = os.environ.get(LAUNCHER_PID_ENV, "")
    if not pid.isdigit() or not sys.platform.startswith("linux"):
        return
    sys.stdout, sys.stderr = _DropWhenClosed(sys.stdout), _DropWhenClosed(sys.stderr)
    try:
        # Fires when this process's parent dies: the launcher, or a wrapper it started the rank under (nsys).
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == int(pid):
        return
    # A wrapper (nsys) or the warm agent between us, or the launcher died before the request took effect: is it
    # still there?
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
