"""The list of observers Trainer.run calls around each step (training/observe/observer.py's protocol), and the
three that belong to the run itself: the totals of the summary, the checkpoint's early import, the held-out loss.

The list's order is the order of their work after a step, collectives included (the same on every rank): the
step's trace and NVTX ranges close, the start-up timeline is written once, the held-out loss is measured, the
job-wide figures are gathered, and rank 0 writes the metrics row and the progress line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from training.observe.metrics import MetricsLog, StepSpread
from training.observe.moe_load import MoeLoad
from training.observe.nvtx import NvtxRanges
from training.observe.observer import Observer, StepObserver, StepRecord
from training.observe.profile import StepProfiler
from training.observe.progress import Progress, StepLines
from training.observe.slowdown import SlowdownWatch
from training.observe.startup import StartupEvent
from training.observe.straggler import IntervalWatch


@dataclass
class Totals(StepObserver):
    """What the run's summary needs: rates and MFUs after the first step, skipped updates, every loss."""

    total_steps: int
    rates: list[float] = field(default_factory=list)
    mfus: list[float] = field(default_factory=list)
    skipped: int = 0
    losses: list[float] = field(default_factory=list)

    def after_step(self, step: int, record: StepRecord) -> None:
        if step > 1 or self.total_steps == 1:  # the run's first step includes the warm-up
            self.rates.append(record.tokens_per_s)
            if record.mfu is not None:
                self.mfus.append(record.mfu)
        self.skipped += int(record.skipped is not None)
        self.losses.append(record.loss)


class CheckpointPrewarm(StepObserver):
    """After this attempt's first step: the save path's imports, in the background, not at a preemption signal."""

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def after_step(self, step: int, record: StepRecord) -> None:
        if record.first:
            self.checkpointer.prewarm()


class Evaluation(StepObserver):
    """train.eval_every: the held-out loss after the steps `record.eval_due` names (every rank takes part)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def after_step(self, step: int, record: StepRecord) -> None:
        if not record.eval_due:
            return
        clock = time.perf_counter()
        record.eval_loss = self.trainer.evaluate()
        self.trainer.eval_losses.append((step, record.eval_loss))
        record.eval_s = time.perf_counter() - clock


def build_observers(trainer, totals: Totals) -> tuple[list[Observer], IntervalWatch]:
    """The run's observers in the order they act after a step, and the interval watch (which may ask the run to
    stop for an unhealthy node). Built after the resume: rows and TensorBoard steps after the resumed checkpoint
    are purged (observe/metrics.py)."""
    cfg, run_dir, mesh, logger = trainer.cfg, trainer.run_dir, trainer.mesh, trainer.is_logger
    progress = Progress(cfg.train.steps, logger and cfg.train.progress, cfg.train.progress_every_s, trainer.state.step)
    metrics = MetricsLog(cfg, run_dir, trainer.state.step, logger)
    # Stragglers and node health (one gather per log interval), traces and memory snapshots.
    watch, profiler = IntervalWatch(cfg, run_dir, mesh), StepProfiler(cfg, run_dir, mesh)
    # NVTX ranges and the nsys capture range (train.nvtx, train.nsys); the whole job's slowdown (rank 0).
    nvtx = NvtxRanges(cfg, run_dir, mesh, trainer.chunks, trainer.optimizer)
    slowdown = SlowdownWatch(cfg, run_dir, logger)
    observers: list[Observer] = [profiler, nvtx, StartupEvent(run_dir, logger)]
    if trainer.checkpointer is not None:
        observers.append(CheckpointPrewarm(trainer.checkpointer))
    observers += [totals, Evaluation(trainer), slowdown, StepSpread(mesh.device), watch]
    observers += [MoeLoad(cfg, run_dir, mesh, trainer.chunks), metrics]
    observers.append(StepLines(progress, logger, trainer.compiled_layers, trainer.eval_losses))
    return observers, watch
