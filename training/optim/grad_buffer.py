"""The flat main-gradient buffer: accumulation hooks and the bucketed data-parallel reduction.

One buffer per rank holds every local parameter's main grad in the FlatLayout order (fp32 for fp32/bf16,
fp16 for fp16). Where the main grad has the parameter's dtype (fp32, fp16), the parameter's `.grad` IS its
view of the buffer: autograd accumulates into it in place, with no hook and no copy (the buffer is zeroed
once per step). Otherwise (bf16 weights, fp32 main grads) a post-accumulate-grad hook puts each
micro-batch's grad into the view and frees it, so no model-dtype grad outlives its backward: the first
micro-batch of a step copies (no zero-fill needed), the later ones add. The dp reduction runs in buckets of parallel.bucket_mb:
zero=0 all-reduces the buffer, zero=1 reduce-scatters it so that this rank holds the reduced grads of its
own shard. Both average over dp.

Overlap (parallel.overlap_grad_reduce): once the step's number of micro-batches is known (`expect`), a
parameter is final after that many hooks; a bucket whose parameters are all final starts its collective
asynchronously at once, while backward goes on with earlier layers (backward produces grads in reverse
flat order, so the last buckets fill first). `reduce_dp` starts what is left and waits for everything
before the optimizer reads the grads. Buckets holding a parameter that still needs a model-parallel
reduction first (`defer`: sequence-parallel and tied-embedding grads, training/optim/model_parallel.py)
wait for `reduce_dp`, so the sums are taken in the same order as without overlap. zero=0: the buckets and
collectives are the same either way. zero=1: a reduce-scatter bucket spans a slice of every rank's shard (the
first layers as well as the last), so with overlap each bucket is instead a contiguous range of one rank's
shard, reduced (dist.reduce) to that rank; the same elements are summed, so at dp=2 (a + b = b + a) the
grads are bit-identical to the reduce-scatter's, and at dp > 2 they may differ in the last bit (the
backend's summation order). tests/engine/test_perf_paths.py checks both at dp=2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from training.optim.flat import FlatLayout
from training.parallel import collectives as comm
from training.parallel.collectives import reduce_scatter_single


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the dp reduction sums in: fp32 for fp16 main grads. A dp sum of loss-scaled fp16 grads
    overflows at 65,504 although their average fits, and rounds at every partial sum; in fp32 it rounds once,
    when the average is written back. The fp16 buffer (2 B per parameter, ZeRO's accounting) is kept; the
    fp32 copy lives only while its bucket is reduced (parallel.bucket_mb)."""
    return torch.float32 if dtype == torch.float16 else dtype


class GradBuffer:
    """Main grads of one rank's parameters, accumulated over micro-batches and reduced over dp."""

    MAX_WIDE_INFLIGHT = 4
    """fp16: buckets whose fp32 copies may be in flight at once (older ones are completed first), so the
    copies stay a few buckets, not an fp32 copy of every grad, when backward launches them all (overlap)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, dp_group: Any, bucket_mb: float, overlap: bool = True):
        self.layout = layout
        self.dp_group = dp_group
        # Zero once: the padding (zero=1) is never written; parameter ranges are overwritten every step.
        self.buffer = torch.zeros(layout.total, dtype=dtype, device=layout.params[0].device)
        self.views: list[torch.Tensor] = [
            self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(layout.offsets, layout.params)
        ]
        self.bucket_elems = max(1, int(bucket_mb * 2**20) // self.buffer.element_size())
        # Autograd accumulates straight into the view where the dtypes agree.
        self.direct = [p.dtype == dtype for p in layout.params]
        self.overlap = overlap and layout.dp > 1
        # zero=1 with overlap: each bucket is a contiguous range of ONE rank's shard, reduced to that rank, so
        # it is complete as soon as its own parameters are (a reduce-scatter bucket spans every rank's shard,
        # i.e. the first and the last layers, and could only start when backward ends).
        self.reduce_to_owner = self.overlap and layout.zero == 1
        self._owners: list[int] = []
        self._buckets = self._bucket_ranges()
        # Which buckets each parameter touches, and how many parameters each bucket waits for.
        self._param_buckets: list[list[int]] = [[] for _ in layout.params]
        self._bucket_params: list[list[int]] = []
        for b, ranges in enumerate(self._buckets):
            members = sorted({i for lo, hi in ranges for i in self._params_in(lo, hi)})
            self._bucket_params.append(members)
            for i in members:
                self._param_buckets[i].append(b)
        self._deferred_buckets: set = set()
        self.launched_in_backward = 0
        """Buckets started while grads were still being produced (counted over the run; tests read it)."""
        self._counts = [0] * len(layout.params)
        self._expected: int | None = None
        self._pending = [len(m) for m in self._bucket_params]
        self._launched: list[tuple[Any, ...] | None] = [None] * len(self._buckets)
        self._wide: list[int] = []  # launched buckets holding an fp32 copy, oldest first
        self._done: set = set()  # buckets reduced this step (completed early to bound the fp32 copies)
        # Hooks only where they have work: moving a grad of another dtype, or counting grads for the overlap.
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(layout.params)
            if self.overlap or not self.direct[i]
        ]
        self._attach()

    def _attach(self) -> None:
        """Point each direct parameter's .grad at its view (again, if something replaced or cleared it)."""
        for p, view, direct in zip(self.layout.params, self.views, self.direct):
            if direct:
                g = p.grad
                if g is None or g.data_ptr() != view.data_ptr():
                    p.grad = view

    # ----- layout of the buckets ---------------------------------------------------------------------
    def _bucket_ranges(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the flat ranges it reduces (one for zero=0; one per dp rank's shard for zero=1)."""
        lay = self.layout
        if lay.dp == 1:
            return []
        if lay.zero == 0:
            return [[(s, min(s + self.bucket_elems, lay.numel))] for s in range(0, lay.numel, self.bucket_elems)]
        if self.reduce_to_owner:
            out = []
            for q in range(lay.dp):
                for s in range(0, lay.shard_size, self.bucket_elems):
                    out.append(
                        [(q * lay.shard_size + s, q * lay.shard_size + min(s + self.bucket_elems, lay.shard_size))]
                    )
                    self._owners.append(q)
            return out
        width = self._width()
        return [
            [(q * lay.shard_size + s, q * lay.shard_size + min(s + width, lay.shard_size)) for q in range(lay.dp)]
            for s in range(0, lay.shard_size, width)
        ]

    def _width(self) -> int:
        return max(1, self.bucket_elems // self.layout.dp)

    def _params_in(self, lo: int, hi: int) -> Iterable[int]:
        lay = self.layout
        for i, (o, p) in enumerate(zip(lay.offsets, lay.params)):
            if o < hi and o + p.numel() > lo:
                yield i

    # ----- accumulation ------------------------------------------------------------------------------
    def _make_hook(self, i: int):
        view, direct = self.views[i], self.direct[i]

        def hook(param: torch.Tensor) -> None:
            if not direct:
                # Into the main grad (fp32 under bf16), and free the model-dtype grad at once.
                if self._counts[i] == 0:
                    view.copy_(param.grad)
                else:
                    view.add_(param.grad)
                param.grad = None
            self._counts[i] += 1
            if self._expected is not None and self._counts[i] == self._expected:
                self._param_final(i)
            elif self._expected is not None and self._counts[i] > self._expected:
                raise RuntimeError(
                    f"parameter {self.layout.names[i]} got more grads than the {self._expected} "
                    f"micro-batches announced for this step (optimizer.zero_grad / scale_loss)"
                )

        return hook

    def _param_final(self, i: int) -> None:
        for b in self._param_buckets[i]:
            self._pending[b] -= 1
            if self._pending[b] == 0 and self.overlap and b not in self._deferred_buckets:
                self._launch(b)

    def expect(self, num_micro_batches: int) -> None:
        """This step runs `num_micro_batches` backward passes: a parameter is final after that many grads."""
        self._expected = int(num_micro_batches)

    def defer(self, param_indices: Iterable[int]) -> None:
        """These parameters need a model-parallel reduction before dp: their buckets wait for `reduce_dp`."""
        for i in param_indices:
            self._deferred_buckets.update(self._param_buckets[i])

    def zero(self) -> None:
        """Start a new step: no accumulated grads (the next grad of each parameter overwrites its view)."""
        self.wait()
        self._done = set()
        self._counts = [0] * len(self.layout.params)
        self._pending = [len(m) for m in self._bucket_params]
        self._expected = None
        if any(self.direct):
            self.buffer.zero_()
        for p, direct in zip(self.layout.params, self.direct):
            if not direct:
                p.grad = None
        self._attach()

    def settle(self) -> None:
        """After the last backward of the step: a parameter without a grad (unused) gets a zero main grad,
        not last step's values. When no hook ran this step, the caller wrote the views itself: left as they are.
        A direct parameter whose .grad something replaced (e.g. a module's zero_grad) hands it over here."""
        for p, view, direct in zip(self.layout.params, self.views, self.direct):
            if direct:
                g = p.grad
                if g is not None and g.data_ptr() != view.data_ptr():
                    view.add_(g)
                    p.grad = view
        if not any(c > 0 for c in self._counts):
            return
        for i, c in enumerate(self._counts):
            if c == 0:
                if not self.direct[i]:  # a direct view was zeroed by `zero`
                    self.views[i].zero_()
                self._counts[i] = self._expected or 1

    def shard(self) -> torch.Tensor:
        """This rank's shard of the buffer (a view); after `reduce_dp` it holds the dp-averaged grads."""
        lay = self.layout
        return self.buffer[: lay.shard_size] if lay.zero == 0 else self.buffer[lay.shard_lo : lay.shard_hi]

    # ----- the dp reduction --------------------------------------------------------------------------
    def _launch(self, b: int) -> None:
        if self._expected is not None and any(c < self._expected for c in self._counts):
            self.launched_in_backward += 1  # some grads still to come: this bucket overlaps the backward
        lay = self.layout
        wide = reduce_dtype(self.buffer.dtype)
        if wide != self.buffer.dtype:
            self._wide.append(b)
            while len(self._wide) > self.MAX_WIDE_INFLIGHT:
                self._complete(self._wide.pop(0))
        if lay.zero == 0:
            lo, hi = self._buckets[b][0]
            bucket = self.buffer[lo:hi]
            summed = bucket.to(wide)  # the bucket itself unless fp16
            work = comm.all_reduce_op(summed, group=self.dp_group, async_op=True)
            self._launched[b] = (work, summed, bucket)
            return
        if self.reduce_to_owner:
            lo, hi = self._buckets[b][0]
            owner = self._owners[b]
            bucket = self.buffer[lo:hi]
            summed = bucket.to(wide)
            work = comm.reduce(summed, dst=comm.global_rank(self.dp_group, owner), group=self.dp_group, async_op=True)
            # Only the owner's copy is the sum (and only it is read): the others are left as they are.
            self._launched[b] = (work, summed, bucket) if owner == lay.dp_rank else (work, None, summed)
            return
        start = self._buckets[b][0][0]
        rows = self.buffer.view(lay.dp, lay.shard_size)
        width = self._width()
        send = rows[:, start : start + width].to(wide).contiguous().view(-1)  # kept alive until the wait
        out = rows[lay.dp_rank, start : start + width]
        summed = out if wide == out.dtype else torch.empty(out.shape, dtype=wide, device=out.device)
        work = reduce_scatter_single(summed, send, group=self.dp_group, async_op=True)
        self._launched[b] = (work, summed, out, send)

    def reduce_dp(self) -> None:
        """Average over dp: all-reduce (zero=0) or reduce-scatter into this rank's shard (zero=1), bucketed;
        starts the buckets the backward did not, then waits for all of them."""
        # A bucket holding an unused parameter never became complete, so it was not launched early.
        self.settle()
        if self.layout.dp == 1:
            return
        for b in range(len(self._buckets)):
            if self._launched[b] is None and b not in self._done:
                self._launch(b)
        self.wait()
        self._done = set()

    def wait(self) -> None:
        """Wait for the launched buckets and average them over dp (nothing launched: nothing to do)."""
        for b in range(len(self._launched)):
            self._complete(b)
        self._wide = []

    def _complete(self, b: int) -> None:
        """Wait for bucket b's collective (if launched and not complete yet) and average it over dp."""
        item = self._launched[b]
        if item is None:
            return
        # (work, the sum or None, where it goes (the same tensor unless summed in fp32), kept alive...)
        work, result, dest = item[0], item[1], item[2]
        work.wait()
        if result is not None:
            result.mul_(1.0 / self.layout.dp)
            if dest is not None and dest.data_ptr() != result.data_ptr():
                dest.copy_(result)
        self._launched[b] = None
        self._done.add(b)

    def nbytes(self) -> int:
        """Bytes of the buffer (padding included)."""
        return self.buffer.numel() * self.buffer.element_size()
