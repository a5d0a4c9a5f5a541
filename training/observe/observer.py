"""The protocol of the loop's observers, and the record of one step they are handed.

Trainer.run (training/run/loop.py) holds one list of observers and calls, in list order, `before_step(step)`
right before the timed step, `after_step(step, record)` after it, and `close()` (in reverse order) when the
loop ends. `step` counts from 1 (the step that runs, then the step that ran). An observer watches: it changes
neither the model nor the run's position. An observer whose figures need a collective runs it only on steps
with `record.logged`, which every rank agrees on, so every rank issues the same collectives in list order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StepRecord:
    """One optimizer step as the loop saw it; observers add job-wide figures to `fields`."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    """Wall time of the step (the optimizer's update included; the batch assembly and the pacing not)."""
    tokens_per_s: float
    consumed_samples: int
    compute_s: float
    """This rank's forward and backward alone (what the straggler check compares)."""
    first: bool
    """This attempt's first step: it carries the start-up work (allocations, compilation, imports)."""
    logged: bool
    """A metrics row is written for this step; the same on every rank (it depends on agreed values only)."""
    eval_due: bool = False
    """train.eval_every measures the held-out loss after this step."""
    mfu: float | None = None
    loss_scale: float | None = None
    skipped: str | None = None
    """Why the update was skipped ("nonfinite_loss", "nonfinite_grad"), or None when it was applied."""
    compile_s: float | None = None
    """train.compile: the seconds the first step spent compiling the layers (that step only)."""
    schedule: dict[str, Any] = field(default_factory=dict)
    """The micro-batch schedule's own fields on a logged step (the pipeline's bubble shares)."""
    eval_loss: float | None = None
    eval_s: float | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    """Job-wide figures of a logged step (step-time spread, peak memory, health, MoE load), in the order the
    observers gathered them."""


class Observer(Protocol):
    """What the loop calls on each of its observers."""

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class StepObserver:
    """A base with nothing to do: an observer overrides the calls it needs."""

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, record: StepRecord) -> None:
        pass

    def close(self) -> None:
        pass
