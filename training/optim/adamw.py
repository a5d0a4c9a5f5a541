"""AdamW on this rank's flat shard: fp32 moments and, for 16-bit weights, an fp32 master copy.

The update is torch.optim.AdamW's single-tensor algorithm with the same operation order, applied
elementwise to the whole shard at once; weight decay applies only to the segments that take it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from training.optim.flat import FlatLayout


class ShardedAdamW:
    """Adam moments (and the fp32 master weights when the parameters are not fp32) of one shard."""

    STATES = ("exp_avg", "exp_avg_sq", "master")
    """Names of the per-element state tensors (master only exists for 16-bit weights)."""

    def __init__(self, layout: FlatLayout, beta1: float, beta2: float, eps: float, weight_decay: float):
        self.layout = layout
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        device = layout.params[0].device
        self.master: Optional[torch.Tensor] = None
        if any(p.dtype != torch.float32 for p in layout.params):
            self.master = layout.read_shard()
        self.exp_avg = torch.zeros(layout.shard_size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(layout.shard_size, dtype=torch.float32, device=device)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The state tensors that exist, by name."""
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            out["master"] = self.master
        return out

    def weights(self) -> torch.Tensor:
        """The fp32 values to update: the master copy, or (fp32 params) a fresh read of the parameters."""
        return self.master if self.master is not None else self.layout.read_shard()

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: float, step: int) -> None:
        """One AdamW step number `step` (1-based) of the shard `w` with grads `g`, in place."""
        if self.weight_decay:
            for s in self.layout.segments:
                if s.decay:
                    w[s.shard_start : s.shard_end].mul_(1 - lr * self.weight_decay)
        self.exp_avg.lerp_(g, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        bc1 = 1 - self.beta1 ** step
        bc2 = 1 - self.beta2 ** step
        denom = (self.exp_avg_sq.sqrt() / (bc2 ** 0.5)).add_(self.eps)
        w.addcdiv_(self.exp_avg, denom, value=-lr / bc1)

    def refresh_master(self, param_indices: List[int]) -> None:
        """Set the master copy of these parameters from their current values (a checkpoint without masters)."""
        if self.master is None:
            return
        wanted = set(param_indices)
        for s in self.layout.segments:
            if s.param_index in wanted:
                self.layout.read_segment(s, self.master)

    def nbytes(self) -> int:
        """Bytes of the state tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
