"""Learning-rate schedules (train.lr_schedule): linear warm-up, then one of

  cosine        cosine decay from lr to min_lr over decay_steps, then flat at min_lr
  linear        linear decay from lr to min_lr over decay_steps, then flat at min_lr
  constant      lr after warm-up
  wsd           warmup-stable-decay: lr until the last train.decay_fraction of the horizon, then linear down to
                min_lr at the horizon's last step
  inverse_sqrt  lr x sqrt(max(1, warmup) / (step + 1)), never below min_lr

The formulas with their published sources are in docs/FORMULAS.md ("Learning-rate schedules"). Each is a pure
function of the step and the configuration, so a resumed or early-stopped run continues on exactly the same
curve; `lr_curve` gives the whole planned curve (the report draws it under the logged values). No torch.
"""

from __future__ import annotations

import math
from typing import Protocol

SCHEDULES = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")
"""The schedules, in the order train.lr_schedule's choices list them (training/contract/config.py builds its
LrSchedule from this tuple)."""


class ScheduleKeys(Protocol):
    """The keys of train (training/contract/config.py TrainConfig) a schedule reads; a protocol, so that the
    config module can import SCHEDULES from here without a circle."""

    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int | None
    decay_fraction: float

    @property
    def lr_schedule(self) -> object: ...


def _horizon(train: ScheduleKeys, warmup: int) -> int:
    """Steps after warm-up that the decay spans: decay_steps, or until train.steps."""
    return train.decay_steps if train.decay_steps is not None else max(1, train.steps - warmup)


def lr_at(step: int, train: ScheduleKeys) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    warmup = max(0, train.warmup_steps)
    kind = str(train.lr_schedule)
    if step < warmup:
        # (step + 1) so the very first step already moves (step 0 at lr 0 would be a wasted step).
        return train.lr * (step + 1) / warmup
    if kind == "constant":
        return train.lr
    if kind == "inverse_sqrt":
        return max(train.min_lr, train.lr * math.sqrt(max(1, warmup) / (step + 1)))
    decay = max(1, _horizon(train, warmup))
    since = step - warmup
    if kind == "wsd":
        # The decay phase is the last decay_fraction of the horizon (at least one step when the fraction > 0).
        d = max(1, math.ceil(train.decay_fraction * decay)) if train.decay_fraction > 0 else 0
        stable = decay - d
        if since < stable:
            return train.lr
        # Counted so the last step of the horizon runs at min_lr: the point of the decay is to end annealed.
        progress = min(1.0, (since - stable + 1) / max(1, d))
        return train.lr - (train.lr - train.min_lr) * progress
    progress = min(1.0, since / decay)
    if kind == "linear":
        return train.lr - (train.lr - train.min_lr) * progress
    if kind != "cosine":
        raise ValueError(f"train.lr_schedule={kind!r}: use one of {', '.join(SCHEDULES)}")
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * cosine


def schedule_problems(train: ScheduleKeys) -> list[tuple[str, str, str]]:
    """(key, what is wrong, fix) for each bad schedule key: the launcher and the engine both check these."""
    out = []
    if not 0.0 <= train.decay_fraction <= 1.0:
        out.append(
            (
                "train.decay_fraction",
                f"must be in [0, 1] (the share of the decay horizon spent decaying under "
                f"lr_schedule=wsd), got {train.decay_fraction}",
                "train.decay_fraction=0.2",
            )
        )
    if train.decay_steps is not None and train.decay_steps < 1:
        out.append(
            (
                "train.decay_steps",
                f"must be >= 1, got {train.decay_steps}",
                "train.decay_steps=null (decay until train.steps)",
            )
        )
    if str(train.lr_schedule) not in SCHEDULES:
        out.append(
            (
                "train.lr_schedule",
                f"unknown schedule {str(train.lr_schedule)!r}",
                f"train.lr_schedule=one of {'|'.join(SCHEDULES)}",
            )
        )
    return out


def lr_curve(train: ScheduleKeys) -> list[float]:
    """The learning rate of every step 0 .. train.steps - 1 (what metrics.jsonl's `lr` of step n + 1 is)."""
    return [lr_at(s, train) for s in range(train.steps)]
