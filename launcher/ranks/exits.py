"""How a rank's end is read from outside it (pure Python, no torch): the error line of its output, whether it has
installed a handler for a stop signal yet (before it has, SIGUSR2 would kill it), and which of an attempt's failed
ranks caused the failure (the rest are its consequences). Both launchers read their ranks' ends this way: the
Slurm epilogue's requeue decision (launcher/slurm/requeue.py) and the local launcher (launcher/launch/local.py)."""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from training.contract.exit_codes import EXIT_NODE_BAD

_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)|error|fatal)\b.*", re.I)
"""What names an error: "ValueError: ...", "torch.distributed.DistBackendError: ...", "error: ..."."""
_FRAME_LINE = re.compile(r'^(?:File "|Traceback \(|\^+$|~+)')


def last_error_line(text: str) -> str:
    """The error a rank ended with, as its first meaningful line: the last line that names an exception or an
    error ("ValueError: ...", "error: ..."), never a traceback's frame or source line (`return func(*args,
    **kwargs)` is a wrapper's frame, not the error); "" when the output names none."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    for line in reversed(lines):
        if _FRAME_LINE.match(line):
            continue
        if _EXCEPTION_LINE.match(line) or ("Error: " in line and not line.startswith(("return ", "raise "))):
            return line[:500]
    return ""


def catches(pid: int, signum: int) -> bool:
    """Whether process pid has a handler installed for signum (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


@dataclass
class Failure:
    """One rank that failed (or never reported)."""

    rank: int
    """Global rank."""
    node: str
    """Node it ran on."""
    exit_code: int | None
    """Its exit code (negative: killed by that signal); None when it never reported (node lost)."""
    reason: str
    """What the rank printed last, or why it is counted as failed."""


def terminated_by_srun(rec: dict) -> bool:
    """Ended by SIGTERM: what srun (--kill-on-bad-exit) sends every other task once one has ended. A SIGKILL
    stays evidence (the OOM killer, an operator), as does any other signal."""
    return rec.get("exit_code") == -int(signal.SIGTERM)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def failure_of(rec: dict) -> Failure:
    """The failure a rank record tells: a signal death says which signal first (what its log printed last is
    not why it died), anything else the rank's error, never empty."""
    code = rec.get("exit_code")
    error = rec.get("error") or ""
    if isinstance(code, int) and code < 0:
        reason = f"killed by {_signal_name(-code)}" + (f" (its last error line: {error})" if error else "")
    elif code == EXIT_NODE_BAD:
        reason = error or "preflight found this node bad"
    else:
        reason = error or f"exited with code {code} without an error message"
    return Failure(int(rec["rank"]), rec.get("node", "?"), code, reason)


# A peer's error that only says another rank went away: a consequence of the cause, never the cause.
_CONSEQUENCE = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashed|watchdog|Broken pipe|"
    r"NCCL communicator was aborted|ProcessGroup.*(?:abort|timed out)|Timed out|DistNetworkError|"
    r"recvBytes|Socket Timeout|peer .* (?:closed|gone)",
    re.IGNORECASE,
)


def root_cause(failed: Sequence[dict]) -> dict:
    """Of the ranks that failed in an attempt, the one that caused it: the first to die by a signal other than
    srun's SIGTERM (SIGKILL, the OOM killer, SIGSEGV), warm-started ranks included; else the first whose error is
    not a collective's consequence (a peer's gloo "Connection closed by peer", an NCCL watchdog timeout); else
    the first to end. Ordered by each record's end time."""
    ordered = sorted(failed, key=lambda rec: float(rec.get("ended") or 0.0))
    for pick in (
        lambda rec: isinstance(rec.get("exit_code"), int) and rec["exit_code"] < 0 and not terminated_by_srun(rec),
        lambda rec: not _CONSEQUENCE.search(rec.get("error") or "") and not terminated_by_srun(rec),
    ):
        chosen = [rec for rec in ordered if pick(rec)]
        if chosen:
            return chosen[0]
    return ordered[0]
