"""TensorBoard event files in run.dir/tensorboard/, written by rank 0 through torch.utils.tensorboard.

One run across attempts: an attempt that resumes from the checkpoint of step S opens its writer with
purge_step=S+1, so TensorBoard hides what an earlier attempt logged after that checkpoint (it was lost with the
attempt) and every step shows once. Each attempt adds its own event file; readers (TensorBoard,
tensorboard's EventAccumulator) apply the purge when they read the directory in order.
"""

from __future__ import annotations

import math
import os
from typing import Any

from training.contract.rundir.paths import RunPaths

TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "step_time_max_s": "perf/step_time_slowest_rank_s",
    "step_time_min_s": "perf/step_time_fastest_rank_s",
    "peak_memory_bytes": "memory/peak_bytes_max_over_ranks",
}
"""metrics.jsonl key -> TensorBoard tag; any other number in a row goes to `metrics/<key>`."""

NOT_PLOTTED = {"step", "time", "attempt", "consumed_samples", "slowest_rank", "fastest_rank"}


def tag_of(key: str) -> str:
    return TAGS.get(key, f"metrics/{key}")


def has_events(log_dir: str) -> bool:
    try:
        return any(name.startswith("events.out.tfevents") for name in os.listdir(log_dir))
    except OSError:
        return False


class TensorBoardSink:
    """Scalars of each metrics row at its step (wall time: the row's `time`).

    The writer is made with the first row, after the first step: a (re)started rank would otherwise import
    TensorBoard before its first step (docs/PERFORMANCE.md, "Preemption path")."""

    def __init__(self, run_dir: str, resumed_step: int):
        self.log_dir = RunPaths(run_dir).tensorboard
        # Steps after the checkpoint this attempt resumed from were logged by an attempt that is gone (decided
        # now, before this attempt's own events file exists).
        self.purge: int | None = resumed_step + 1 if has_events(self.log_dir) else None
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge, flush_secs=30)
        return self._writer

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key in NOT_PLOTTED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value) or key in ("loss", "eval_loss"):  # a non-finite loss is worth seeing
                self.writer.add_scalar(tag_of(key), value, step, walltime=row.get("time"))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
