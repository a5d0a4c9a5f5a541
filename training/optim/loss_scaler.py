"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, as in Megatron-LM); a constant 1 otherwise.

The loss is multiplied by the scale before backward so that small fp16 grads do not flush to zero; the
grads are divided by it before use. A step with non-finite grads is skipped and halves the scale (not
below train.min_loss_scale); train.loss_scale_window finite steps in a row double it.
"""

from __future__ import annotations


class LossScaler:
    """The loss scale and its growth/backoff state."""

    def __init__(self, enabled: bool, init: float, minimum: float, window: int):
        self.enabled = enabled
        self.scale = float(init) if enabled else 1.0
        self.minimum, self.window = minimum, window
        self.good_steps = 0

    def backoff(self) -> None:
        """After a skipped step: halve the scale (fp16 only)."""
        if self.enabled:
            self.scale = max(self.minimum, self.scale / 2)
            self.good_steps = 0

    def grow(self) -> None:
        """After an applied step: double the scale once `window` steps in a row were finite."""
        if self.enabled:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0

    def reported(self) -> float | None:
        """The scale for metrics: a number under fp16, None when scaling is off."""
        return self.scale if self.enabled else None

    def state_dict(self) -> dict[str, float]:
        return {"loss_scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # Only fp16 scales its loss: a scale saved by an fp16 run must not scale a bf16 run's loss.
        if self.enabled:
            self.scale = float(state["loss_scale"])
            self.good_steps = int(state["good_steps"])
