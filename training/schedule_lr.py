"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr, then flat at min_lr.

A pure function of the step, so a resumed run continues on exactly the same curve.
"""

from __future__ import annotations

import math

from training.config import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    warmup = max(0, train.warmup_steps)
    if step < warmup:
        # (step + 1) so the very first step already moves (step 0 at lr 0 would be a wasted step).
        return train.lr * (step + 1) / warmup
    decay = train.decay_steps if train.decay_steps is not None else max(1, train.steps - warmup)
    progress = min(1.0, (step - warmup) / max(1, decay))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * cosine
