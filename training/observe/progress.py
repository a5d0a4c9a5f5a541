"""Rank 0's progress on stderr (no torch, no tqdm).

On a terminal: a bar redrawn in place every step, with elapsed time and the time left. Rank 0's stderr is the
local launcher's pipe, not the terminal: the launcher says that its own stderr is one (TTY_ENV), copies the redraws
there and writes the run's log as plain lines (launcher/ranks/processes.py: PlainLines). Without one (a Slurm log,
a pipe, `wait=true` streaming that log): one plain line every `train.progress_every_s` seconds, plus the first
and the last step, so a long run's log grows with wall time rather than with steps, and a short one still shows
its start and end.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO

from training.observe.observer import StepObserver, StepRecord


def format_duration(seconds: float | None) -> str:
    """`1:02:03`, `4:05` or `?` (unknown)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


TTY_ENV = "MESHRUN_PROGRESS_TTY"
"""Set to 1 by the local launcher for rank 0 when the launcher's stderr is a terminal."""


class Progress:
    """Call update(step, text) after every step; start_step is where this attempt began (a resume)."""

    WIDTH = 24

    def __init__(
        self,
        total: int,
        enabled: bool,
        every_s: float = 30.0,
        start_step: int = 0,
        stream: IO[str] | None = None,
        clock=time.monotonic,
    ):
        self.total, self.enabled, self.every_s = total, enabled, max(0.0, float(every_s))
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) or os.environ.get(TTY_ENV) == "1"
        self.clock = clock
        self.start_step = start_step
        self.t0 = clock()
        self.last_line: float | None = None

    def eta_s(self, step: int) -> float | None:
        """Seconds left at this attempt's mean pace so far; None before its first step."""
        done = step - self.start_step
        if done <= 0:
            return None
        return (self.clock() - self.t0) / done * max(0, self.total - step)

    def line(self, step: int, text: str) -> str:
        done = int(self.WIDTH * step / max(1, self.total))
        elapsed = self.clock() - self.t0
        return (
            f"[{'#' * done}{'.' * (self.WIDTH - done)}] {step}/{self.total} {text} "
            f"[{format_duration(elapsed)} elapsed, {format_duration(self.eta_s(step))} left]"
        )

    def note(self, text: str) -> None:
        """A line that must show when it happens (an evaluation): on a terminal it replaces the bar's line (the
        next update draws the bar again below it); elsewhere a plain line."""
        if not self.enabled:
            return
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        last = step >= self.total
        if self.tty:
            self.stream.write("\r" + self.line(step, text) + ("\n" if last else ""))
        elif self.last_line is None or last or now - self.last_line >= self.every_s:
            self.stream.write(self.line(step, text) + "\n")
            self.last_line = now
        else:
            return
        self.stream.flush()


class StepLines(StepObserver):
    """Rank 0's lines of each step, as the loop's observer (observe/observer.py): a skipped update said at once,
    an evaluation as it happens, and the progress line (with the last held-out loss of `eval_losses`)."""

    def __init__(self, progress: Progress, is_logger: bool, compiled_layers: int, eval_losses: list):
        self.progress, self.is_logger = progress, is_logger
        self.compiled_layers, self.eval_losses = compiled_layers, eval_losses

    def after_step(self, step: int, record: StepRecord) -> None:
        if not self.is_logger:
            return
        if record.skipped is not None:
            print(
                f"\nstep {step}: {record.skipped} (loss {record.loss}, grad norm {record.grad_norm}); "
                f"update skipped" + (f", loss scale -> {record.loss_scale:g}" if record.loss_scale else ""),
                file=sys.stderr,
            )
        if record.eval_loss is not None:  # as it happens, not only in the next progress line
            self.progress.note(f"step {step}: eval loss {record.eval_loss:.4f} ({record.eval_s or 0.0:.1f} s)")
        shown_eval = f" eval {self.eval_losses[-1][1]:.4f}" if self.eval_losses else ""
        shown_compile = (
            f" (compiled {self.compiled_layers} layers in {record.compile_s:.1f} s)"
            if record.compile_s is not None
            else ""
        )
        text = f"loss {record.loss:.4f}{shown_eval} lr {record.lr:.2e} {record.tokens_per_s:,.0f} tok/s{shown_compile}"
        self.progress.update(step, text)
