"""prepare's progress bar on stderr: bytes read of the total, tokens/s and the time left.

Redrawn in place on a terminal (at most 10 times a second), one line every ~5 % otherwise (logs, CI).
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Progress over a known number of input bytes."""

    def __init__(self, total_bytes: int, enabled: bool = True, stream=None):
        self.total, self.enabled = max(1, total_bytes), enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.tokens = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_step = -1

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        frac = min(1.0, self.done / self.total)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        width = 24
        bar = "#" * int(width * frac) + "." * (width - int(width * frac))
        return (
            f"prepare [{bar}] {100 * frac:5.1f}% {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"{self.tokens:,} tokens {self.tokens / elapsed:,.0f} tokens/s ETA {_clock(eta)}"
        )

    def update(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens = tokens
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.done >= self.total:
                self.stream.write("\r" + self.line())
                self.stream.flush()
                self._last_draw = now
        else:
            step = int(20 * self.done / self.total)
            if step != self._last_step:
                self.stream.write(self.line() + "\n")
                self.stream.flush()
                self._last_step = step

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
