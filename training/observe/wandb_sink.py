"""Weights & Biases, only when the user installed it and asked for it (`train.wandb=true`); never required.

The W&B run id lives in run.dir/wandb.json, written once (temp name + rename): every attempt of the run (a
requeue, a resubmission, a manual resume) continues the same W&B run with resume="allow". W&B keeps one value per
step and ignores a step it already has, so the steps an interrupted attempt logged after its last checkpoint keep
their first values there (TensorBoard and metrics.jsonl purge them instead: training/observe/metrics.py).
No torch import: the launcher asks `wandb_problem` before it launches anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from typing import Any

from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths


def wandb_problem() -> str:
    """ "" when `import wandb` would work here, else what to do about it."""
    if importlib.util.find_spec("wandb") is not None:
        return ""
    return (
        "train.wandb=true but the `wandb` package is not installed in this environment: `pip install wandb` "
        "(and `wandb login`, or WANDB_MODE=offline), or leave train.wandb=false (TensorBoard files are always "
        "written to run.dir/tensorboard/)"
    )


def run_id(run_dir: str) -> str:
    """The W&B run id of this run directory: created on first use, the same for every later attempt."""
    path = RunPaths(run_dir).wandb
    try:
        with open(path) as f:
            return str(json.load(f)["id"])
    except (OSError, ValueError, KeyError):
        pass
    value = uuid.uuid4().hex[:16]
    write_atomic(path, json.dumps({"id": value}))
    return value


class WandbSink:
    """Rank 0's W&B run: numbers of every metrics row, at the row's step."""

    def __init__(self, run_dir: str, project: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(
            project=project,
            id=run_id(run_dir),
            resume="allow",
            dir=run_dir,
            name=os.path.basename(os.path.normpath(run_dir)),
            config=config,
        )

    def write(self, row: dict[str, Any]) -> None:
        values = {
            k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()
