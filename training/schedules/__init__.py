"""Micro-batch schedules: every way a rank runs one step's micro-batches through its model chunks.

`make_schedule` is the one place that picks one for a layout: `NoPipelineSchedule` (no_pipeline.py) at pp = 1,
else the pipeline-parallel ones (pipeline.py: gpipe, 1f1b, interleaved_1f1b, zb_h1). Each has the methods of
`Schedule`, which is all the training loop (training/run/loop.py) knows of them.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Schedule(Protocol):
    """What the loop calls on a micro-batch schedule."""

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate the grads of the step's mean loss; returns this rank's mean loss (detached, fp32)."""
        ...

    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean loss without building a graph (evaluation)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Fields the schedule adds to a metrics row (the pipeline's bubble_measured / bubble_planned)."""
        ...


def make_schedule(cfg, mesh, chunks, optimizer) -> Schedule:
    """The micro-batch schedule for this layout: NoPipelineSchedule, or pipeline.py's when pp > 1."""
    if mesh.pp == 1 and len(chunks) == 1:
        from training.schedules.no_pipeline import NoPipelineSchedule

        return NoPipelineSchedule(chunks, optimizer, mesh)
    from training.schedules.pipeline import make_pipeline_schedule

    return make_pipeline_schedule(cfg, mesh, chunks, optimizer)
