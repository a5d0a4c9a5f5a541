"""Oracles and helpers the engine's tests use, apart from the engine: code the optimizer does differently (it
finalises sequence-parallel grads itself, training/optim/model_parallel.py). Used by tests only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from training.optim.model_parallel import allreduce_flat


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], group: Any) -> None:
    """Sum over tp the `.grad` of every `sequence_parallel` parameter (for code without the optimizer)."""
    allreduce_flat([p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None], group)
