"""The optimizer and its parts: flat layout, gradient buffer, model-parallel grad finalisation, loss
scaler and sharded AdamW; `DistributedOptimizer` (optimizer.py) is the one object the loop uses."""

from training.optim.optimizer import SCALARS, DistributedOptimizer, ParamShard, StepResult

__all__ = ["DistributedOptimizer", "ParamShard", "SCALARS", "StepResult"]
