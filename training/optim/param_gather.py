"""zero=1: the updated shards all-gathered, before the step returns or while the next forward runs (as
Megatron's overlapped parameter gather and FSDP's per-unit all-gather do).

After the optimizer step each dp rank holds the new values of its own shard of the flat parameter buffer;
the other ranks' shards arrive by all-gather, in chunks of `width` elements of every shard. The chunks'
all-gathers start asynchronously (`start`); the optimizer either waits for all of them at once (`finish`)
or, once `watch` has ordered them by when the forward first needs them, lets each unit of the model wait
in a forward pre-hook only for the chunks that hold its parameters. The units are the model's:
`chunk.param_units()` lists its parts in forward order with the parameters read once each part's forward
has started (training/model/gpt.py: the embedding, each layer, the final norm with the head's weight), so
a layer waits before its forward, also when activation recomputation runs it again in the backward.
A parameter no unit lists is waited for when its chunk's forward starts (a module without param_units:
all of them).
At most `max_inflight` chunks are in flight at once (training/contract/precision.py PARAM_GATHER_INFLIGHT_BYTES): each
holds a receive buffer of dp pieces and a send copy, so all of them at once would be a second copy of every
weight beside the next forward's activations. Completing a chunk issues the next one in order. Where a
chunk is issued must not depend on the rank (a rank blocked on a chunk its peer has not issued yet, while
the peer waits on it in another collective, would deadlock), so each unit waits for every chunk holding
any of its parameters, its own rank's pieces included: the same positions on every dp rank. A process
group runs its collectives in issue order, so once the first chunks are in, later layers rarely wait. Anything else
that reads the parameters calls `finish` (the optimizer's state_dict and its next step do). Either way
the same chunks are copied into the same places: the values do not depend on when they are waited for.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch

from training.parallel import collectives as comm


class ParamGather:
    """The deferred all-gather of one optimizer's updated zero=1 shards."""

    def __init__(self, layout, group, width: int, max_inflight: int = 0):
        self.layout, self.group, self.width = layout, group, width
        self.max_inflight = max_inflight if max_inflight > 0 else len(range(0, layout.shard_size, width))
        """Chunks in flight at once (0: all of them)."""
        self.peak_bytes = 0
        """Most bytes of receive buffers and send copies held at once (tests and the memory check read it)."""
        self._held = 0
        self._next = 0
        self.starts = list(range(0, layout.shard_size, width))
        self.order = list(range(len(self.starts)))
        """Chunk indices in issue order: the same on every dp rank (computed from the model, not the rank)."""
        self.watching = False
        """True once watch() put the pre-hooks in place: only then may the gather be deferred."""
        self._pending: collections.deque[tuple[int, object, torch.Tensor, torch.Tensor]] = collections.deque()
        self._completed = 0
        self._index = {id(p): i for i, p in enumerate(layout.params)}

    def _chunks_of(self, params: Iterable[torch.nn.Parameter], skip_own: bool) -> set[int]:
        """Chunk indices holding any element of these parameters (skip_own: not counting this rank's shard)."""
        lay, size, width = self.layout, self.layout.shard_size, self.width
        out: set[int] = set()
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                continue
            start, end = lay.offsets[i], lay.offsets[i] + p.numel()
            for q in range(lay.dp):
                if skip_own and q == lay.dp_rank:
                    continue
                lo, hi = max(start, q * size), min(end, (q + 1) * size)
                if lo < hi:
                    out.update(range((lo - q * size) // width, (hi - 1 - q * size) // width + 1))
        return out

    def watch(self, chunks: list[torch.nn.Module]) -> None:
        """Order the chunks by first use in the forward and put a pre-hook on every unit that needs any."""
        units: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]] = []
        for chunk in chunks:
            declared = chunk.param_units() if hasattr(chunk, "param_units") else []
            listed = {id(p) for _, params in declared for p in params}
            units.append((chunk, [p for p in chunk.parameters() if id(p) not in listed]))
            units += declared
        first_use: dict[int, int] = {}
        for k, (_, params) in enumerate(units):
            for c in self._chunks_of(params, skip_own=False):
                first_use.setdefault(c, k)
        self.order = sorted(range(len(self.starts)), key=lambda c: first_use.get(c, len(units)))
        position = {c: k for k, c in enumerate(self.order)}
        for module, params in units:
            need = self._chunks_of(params, skip_own=False)  # rank-independent: see the module docstring
            if need:
                upto = max(position[c] for c in need)
                module.register_forward_pre_hook(lambda _module, _args, upto=upto: self.wait(upto))
        self.watching = True

    def start(self) -> None:
        """Launch every chunk's all-gather of the (just updated) shards, in issue order."""
        self.finish()
        assert self.layout.param_buffer is not None
        self._completed = self._next = 0
        self._top_up()

    def _top_up(self) -> None:
        """Issue chunks, in order, until max_inflight are in flight or none is left."""
        lay = self.layout
        buf = lay.param_buffer
        rows = buf.view(lay.dp, lay.shard_size)
        while len(self._pending) < self.max_inflight and self._next < len(self.order):
            c = self.order[self._next]
            self._next += 1
            s = self.starts[c]
            piece = rows[lay.dp_rank, s : s + self.width].clone()
            out = torch.empty(lay.dp * piece.numel(), dtype=buf.dtype, device=buf.device)
            work = comm.all_gather_single(out, piece, group=self.group, async_op=True)
            self._pending.append((c, work, out, piece))  # piece: alive until its collective is done
            self._held += (out.numel() + piece.numel()) * buf.element_size()
            self.peak_bytes = max(self.peak_bytes, self._held)

    def wait(self, upto: int) -> None:
        """Complete the chunks up to issue position `upto` (and those before it), each copied into place."""
        lay = self.layout
        while self._pending and self._completed <= upto:
            c, work, out, piece = self._pending.popleft()
            work.wait()
            s, n = self.starts[c], out.numel() // lay.dp
            rows = lay.param_buffer.view(lay.dp, lay.shard_size)
            rows[:, s : s + n].copy_(out.view(lay.dp, n))
            self._completed += 1
            self._held -= (out.numel() + piece.numel()) * out.element_size()
            del out, piece
            self._top_up()

    def finish(self) -> None:
        """Every chunk complete: the parameters hold the updated values."""
        self.wait(len(self.order))
