"""ZeRO-2 main grads: only this rank's shard is kept; every other gradient byte is bucket-sized staging.

The flat layout is zero=1's (training/optim/flat.py): data-parallel rank q owns [q S, (q + 1) S). A bucket is
a contiguous range of ONE owner's shard (at most parallel.bucket_mb). During backward each parameter's
`.grad` (autograd's, model dtype) is added into the staging tensor of every bucket it touches and freed at
once (post-accumulate-grad hook); a bucket whose parameters have all delivered is reduced (dist.reduce, a
sum) to its owner asynchronously while backward goes on, and the owner adds the result into its shard of the
main grads. With gradient accumulation a bucket is reduced once per round of deliveries (once per
micro-batch on a plain schedule): this is what keeps the full-size grads from living through the step
(ZeRO-2 trades m reductions for the memory; docs/FORMULAS.md counts the volume). The sum over dp is
linear, so the shard holds the same sums as zero=1's reduce-scatter, in another summation order.

Model-parallel finalisation happens after the dp reduction, on the shard (sums commute):
- sequence-parallel parameters: their segments of the shard are all-reduced over tp (every tp rank has the
  same flat layout, hence the same shard ranges);
- the tied embedding at pp > 1: the first and the last stage lay it out at different flat offsets, so its
  reduced grad is assembled transiently (an all-reduce over dp of the disjoint segments), summed over the
  embedding group, and each rank keeps its own segment.
Staging is transient (at most MAX_INFLIGHT reductions in flight plus the buckets being filled); the bytes
this buffer holds between steps are the shard's, `nbytes`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch

from training.optim.flat import FlatLayout
from training.optim.grad_buffer import reduce_dtype
from training.parallel import collectives as comm


class ShardedGradBuffer:
    """Main grads of this rank's shard (zero=2), fed by per-bucket reductions during backward."""

    MAX_INFLIGHT = 4
    """Bucket reductions in flight before the oldest is awaited (bounds the staging memory)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, dp_group: Any, bucket_mb: float, overlap: bool = True):
        self.layout, self.dp_group, self.dtype = layout, dp_group, dtype
        device = layout.params[0].device
        self.main = torch.zeros(layout.shard_size, dtype=dtype, device=device)
        """This rank's shard of the main grads (after `reduce_dp`: the dp-averaged sums)."""
        self.bucket_elems = max(1, int(bucket_mb * 2**20) // self.main.element_size())
        self.overlap = overlap
        self.launched_in_backward = 0
        """Buckets reduced while grads were still being produced (counted over the run)."""
        S = layout.shard_size
        self._buckets: list[tuple[int, int, int]] = []  # (flat lo, flat hi, owner)
        for q in range(layout.dp):
            for s in range(0, S, self.bucket_elems):
                lo, hi = q * S + s, min(q * S + min(s + self.bucket_elems, S), layout.numel)
                if lo < hi:
                    self._buckets.append((lo, hi, q))
        self._param_buckets: list[list[int]] = [[] for _ in layout.params]
        self._members: list[int] = []
        for b, (lo, hi, _) in enumerate(self._buckets):
            n = 0
            for i, (o, p) in enumerate(zip(layout.offsets, layout.params)):
                if o < hi and o + p.numel() > lo:
                    self._param_buckets[i].append(b)
                    n += 1
            self._members.append(n)
        self._staging: list[torch.Tensor | None] = [None] * len(self._buckets)
        self._delivered: list[set[int]] = [set() for _ in self._buckets]
        self._inflight: collections.deque[tuple[int, Any, torch.Tensor]] = collections.deque()
        self._in_backward = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(layout.params)]

    # ----- accumulation ------------------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._in_backward = True
            self._stage(i, param)

        return hook

    def _stage(self, i: int, param: torch.Tensor) -> None:
        """Add parameter i's `.grad` into its buckets' staging, free it, and launch the buckets now complete."""
        start = self.layout.offsets[i]
        g = param.grad.detach().reshape(-1)
        for b in self._param_buckets[i]:
            lo, hi, _ = self._buckets[b]
            a, z = max(lo, start), min(hi, start + g.numel())
            if self._staging[b] is None:
                # fp16 main grads are summed over dp in fp32 (training/optim/grad_buffer.py REDUCE_DTYPE): the
                # staging is transient, the shard keeps its dtype.
                self._staging[b] = torch.zeros(hi - lo, dtype=reduce_dtype(self.dtype), device=self.main.device)
            self._staging[b][a - lo : z - lo].add_(g[a - start : z - start])
            self._delivered[b].add(i)
            if len(self._delivered[b]) == self._members[b]:
                self._launch(b)
                if not self.overlap:  # parallel.overlap_grad_reduce=false: each reduction blocks backward
                    self.wait()
        param.grad = None  # the full-size grad lives only until it is staged

    def _launch(self, b: int) -> None:
        """Reduce bucket b's staging to its owner (async) and start a new round of deliveries."""
        staging = self._staging[b]
        self._staging[b], self._delivered[b] = None, set()
        if staging is None:
            return
        lo, hi, owner = self._buckets[b]
        lay = self.layout
        if lay.dp == 1:
            self.main[lo - lay.shard_lo : hi - lay.shard_lo].add_(staging)
            return
        if self._in_backward:
            self.launched_in_backward += 1
        work = comm.reduce(staging, dst=comm.global_rank(self.dp_group, owner), group=self.dp_group, async_op=True)
        self._inflight.append((b, work, staging))
        while len(self._inflight) > self.MAX_INFLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        b, work, staging = self._inflight.popleft()
        work.wait()
        lo, hi, owner = self._buckets[b]
        if owner == self.layout.dp_rank:  # only the owner's copy is the sum
            if staging.dtype != self.main.dtype:  # fp16: averaged in fp32 before it meets the fp16 shard
                staging.mul_(1.0 / self.layout.dp)
            self.main[lo - self.layout.shard_lo : hi - self.layout.shard_lo].add_(staging)

    def wait(self) -> None:
        """Every launched reduction is complete and added into the shard."""
        while self._inflight:
            self._complete_oldest()

    def expect(self, num_micro_batches: int) -> None:
        """Kept for the optimizer's interface: buckets launch on their deliveries, whatever the count."""

    def defer(self, param_indices: Iterable[int]) -> None:
        """Nothing waits: model-parallel sums run on the reduced shard (`finalize`)."""

    def zero(self) -> None:
        """Start a new step: empty shard, no staging, no grads on the parameters."""
        self.wait()
        self.main.zero_()
        self._staging = [None] * len(self._buckets)
        self._delivered = [set() for _ in self._buckets]
        self._in_backward = False
        for p in self.layout.params:
            p.grad = None

    def settle(self) -> None:
        """After the last backward: a `.grad` set by other code (no hook ran) is staged too, then every
        partly filled bucket is reduced (unused parameters contribute zero)."""
        for i, p in enumerate(self.layout.params):
            if p.grad is not None:
                self._stage(i, p)
        self._in_backward = False
        for b in range(len(self._buckets)):
            if self._staging[b] is not None:
                self._launch(b)

    def reduce_dp(self) -> None:
        """Finish the dp reduction and average over dp: `main` then holds this rank's reduced shard."""
        self.settle()
        self.wait()
        if self.layout.dp > 1 and reduce_dtype(self.main.dtype) == self.main.dtype:  # fp16: averaged per bucket
            self.main.mul_(1.0 / self.layout.dp)

    def shard(self) -> torch.Tensor:
        return self.main

    def nbytes(self) -> int:
        """Bytes held between steps: the shard of main grads."""
        return self.main.numel() * self.main.element_size()

    # ----- model-parallel finalisation on the shard ------------------------------------------------
    def finalize(self, sync, mesh) -> None:
        """The model-parallel sums (sp over tp, tied embedding over the pipeline ends) of the reduced shard."""
        lay = self.layout
        segs: dict[int, list] = {}
        for s in lay.segments:
            segs.setdefault(s.param_index, []).append(s)
        if sync.sp_params and mesh.tp > 1:
            parts = [self.main[s.shard_start : s.shard_end] for i in sync.sp_params for s in segs.get(i, [])]
            if parts:
                flat = torch.cat(parts)
                comm.all_reduce_op(flat, group=mesh.tp_group)
                pos = 0
                for t in parts:
                    t.copy_(flat[pos : pos + t.numel()])
                    pos += t.numel()
            # No segments here means none on the other tp ranks either (same layout): no collective.
        i = sync.tied_index
        if i is not None and (mesh.is_first_stage or mesh.is_last_stage):
            full = torch.zeros(lay.params[i].numel(), dtype=self.dtype, device=self.main.device)
            for s in segs.get(i, []):
                full[s.param_start : s.param_start + s.shard_end - s.shard_start] = self.main[
                    s.shard_start : s.shard_end
                ]
            if lay.dp > 1:
                comm.all_reduce_op(full, group=self.dp_group)  # disjoint segments: the sum assembles them
            comm.all_reduce_op(full, group=mesh.embedding_group)
            for s in segs.get(i, []):
                self.main[s.shard_start : s.shard_end] = full[
                    s.param_start : s.param_start + s.shard_end - s.shard_start
                ]
