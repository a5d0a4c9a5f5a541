"""The flat main-gradient buffer: accumulation hooks and the bucketed data-parallel reduction.

One buffer per rank holds every local parameter's main grad in the FlatLayout order (fp32 for fp32/bf16,
fp16 for fp16). A post-accumulate-grad hook adds each micro-batch's grad into the parameter's view and
frees it, so no model-dtype grad outlives its backward. The dp reduction runs in buckets of
parallel.bucket_mb: zero=0 all-reduces the whole buffer, zero=1 reduce-scatters it so that this rank holds
the reduced grads of its own shard. Both average over dp.
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from training.optim.flat import FlatLayout


class GradBuffer:
    """Main grads of one rank's parameters, accumulated over micro-batches and reduced over dp."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, dp_group: Any, bucket_mb: float):
        self.layout = layout
        self.dp_group = dp_group
        self.buffer = torch.zeros(layout.total, dtype=dtype, device=layout.params[0].device)
        self.views: List[torch.Tensor] = [
            self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(layout.offsets, layout.params)]
        self.bucket_elems = max(1, int(bucket_mb * 2**20) // self.buffer.element_size())
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(layout.params)]

    def _make_hook(self, i: int):
        view = self.views[i]

        def hook(param: torch.Tensor) -> None:
            # Accumulate into the main grad (fp32 under bf16) and free the model-dtype grad at once.
            view.add_(param.grad)
            param.grad = None

        return hook

    def zero(self) -> None:
        """Start a new step: no accumulated grads."""
        self.buffer.zero_()
        for p in self.layout.params:
            p.grad = None

    def shard(self) -> torch.Tensor:
        """This rank's shard of the buffer (a view); after `reduce_dp` it holds the dp-averaged grads."""
        lay = self.layout
        return self.buffer[: lay.shard_size] if lay.zero == 0 else self.buffer[lay.shard_lo : lay.shard_hi]

    def reduce_dp(self) -> None:
        """Average over dp: all-reduce (zero=0) or reduce-scatter into this rank's shard (zero=1), bucketed."""
        lay = self.layout
        if lay.dp == 1:
            return
        inv = 1.0 / lay.dp
        if lay.zero == 0:
            for start in range(0, lay.numel, self.bucket_elems):
                bucket = self.buffer[start : start + self.bucket_elems]
                dist.all_reduce(bucket, group=self.dp_group)
                bucket.mul_(inv)
            return
        rows = self.buffer.view(lay.dp, lay.shard_size)
        width = max(1, self.bucket_elems // lay.dp)
        for start in range(0, lay.shard_size, width):
            send = rows[:, start : start + width].contiguous().view(-1)
            out = rows[lay.dp_rank, start : start + width]
            dist.reduce_scatter_single(out, send, group=self.dp_group)
            out.mul_(inv)

    def nbytes(self) -> int:
        """Bytes of the buffer (padding included)."""
        return self.buffer.numel() * self.buffer.element_size()
