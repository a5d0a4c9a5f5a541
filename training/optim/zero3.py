"""ZeRO-3: parameters sharded over dp like the optimizer state, gathered per unit just in time.

The flat layout is zero=1's (training/optim/flat.py): data-parallel rank q owns the flat range [q S, (q + 1) S)
of its model chunks' parameters (the TP-local values: tp shards first, dp shards what tp left). Between uses
a rank holds only `shard` (its S values in the model dtype); the optimizer, the main grads (zero=2's
ShardedGradBuffer) and the checkpoints see exactly the zero=1/2 layout.

A unit is a part of a chunk that reads its parameters once its forward starts (GPTChunk.param_units: the
embedding, each layer, the final norm with the output layer). Each parameter has a storage of its own that
is allocated (resized) when a unit holding it is gathered and released (resized to 0) when no gathered unit
holds it; the parameter object, and every tensor autograd saved of it, keep pointing at that storage, so a
re-gather before backward restores what backward reads (nothing writes through the parameter, so its version
counter does not move). A gather broadcasts, from each owner whose shard intersects the unit, that owner's
part of the unit in one message: a unit inside one shard costs one broadcast of its own size.

Schedule of a chunk's units u_0..u_n (forward order):
- forward pre-hook of u_k: gather u_k (waiting for its prefetch), start gathering u_{k+1};
- forward post-hook: release u_k (zero3_reshard_after_forward; never the chunk's last unit when it holds the
  head, whose weight the chunk reads after the final norm's forward), and hook u_k's output so that
- when the gradient of u_k's output is ready (u_k's backward starts): gather u_k, release u_{k+1} (its backward
  is over: that gradient was its last use of its weights), start gathering u_{k-1};
- inside backward (recomputation) the hooks neither release nor prefetch;
- `release_all` at the end of the step's backward and before the optimizer writes the shard.
`gather_all` materialises every parameter (checkpoints, export and tests read them).

parallel.fp8_all_gather (train.precision=fp8, tensorwise): the weights of the FP8 linears (`param.fp8_weight`,
set by training/model/fp8_apply.py) travel in float8, 1 byte an element, as torchao's FSDP2 float8 all-gather
sends them (torchao/float8/fsdp_utils.py): the first gather after the shard may have changed (an optimizer
step, a checkpoint load) takes each FP8 weight's amax over this rank's shard, reduces them in one MAX all-reduce
over the group and turns them into scales with torchao's amax_to_scale (precompute_float8_dynamic_scale_for_fsdp's
computation); each owner casts its part with that scale (hp_tensor_and_scale_to_float8) into the message, whose
other parameters keep the model dtype; the receivers fill a float8 storage of each such weight (allocated and
released like the parameters' storages, so backward and recomputation read the bytes forward read), and the
FP8 matmul (training/parallel/fp8.py) takes it as torchao's float8 weight operand, the parameter's bf16 storage
staying empty. The global amax is the whole weight's, so the bytes are those torchao's dynamic cast of the
gathered bf16 weight gives: the run is bit-identical to zero=3 without the flag. `gather_all` gathers the model
dtype (whoever reads the whole model reads bf16); a unit it left gathered is gathered again in float8 by the
next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from training.parallel import collectives as comm


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Unit:
    params: list[int]
    """Indices into the layout's parameters."""
    keep_after_forward: bool = False
    """Read after its module's forward returns (the output layer): released only after its backward."""
    pieces: list[tuple[int, list[tuple[int, int, int]]]] = field(default_factory=list)
    """Per owner dp rank q: (q, [(param index, flat lo, flat hi)]) of the unit's elements in q's shard."""
    state: str = "free"
    """free | pending (broadcasts in flight) | ready."""
    works: list[tuple[Any, torch.Tensor, list[tuple[int, int, int]]]] = field(default_factory=list)
    fp8: bool = False
    """This gather carries the unit's FP8 weights in float8 (parallel.fp8_all_gather)."""


class Zero3Params:
    """The parameters of one optimizer's layout, sharded over dp and gathered unit by unit."""

    def __init__(self, layout, group, reshard_after_forward: bool = True, fp8_all_gather: bool = False):
        self.layout, self.group = layout, group
        self.reshard_after_forward = reshard_after_forward
        first = layout.params[0]
        # The persistent values: this rank's shard in the model dtype (exact: read from the parameters).
        self.shard = torch.zeros(layout.shard_size, dtype=first.dtype, device=first.device)
        for s in layout.segments:
            p = layout.params[s.param_index].detach().reshape(-1)
            self.shard[s.shard_start : s.shard_end].copy_(
                p[s.param_start : s.param_start + s.shard_end - s.shard_start]
            )
        self.refs = [0] * len(layout.params)
        self.units: list[_Unit] = []
        self.peak_gathered_bytes = 0
        """Most parameter bytes gathered at once (beside the shard) by the forward and backward hooks
        (gather_all, for checkpoints and readers of the whole model, is not counted)."""
        self._gathered_bytes = 0
        self.prefetched = 0
        """Gathers by the hooks that found their broadcasts already issued by a prefetch (over the run)."""
        self._index = {id(p): i for i, p in enumerate(layout.params)}
        self.watching = False
        self.gather_bytes = 0
        """Bytes of the messages the hooks' gathers broadcast (over the run; gather_all's not counted)."""
        self.gather_fp8_bytes = 0
        """The float8 bytes among them (parallel.fp8_all_gather: 1 an FP8 weight element)."""
        # parallel.fp8_all_gather: param index -> the FP8 weight's float8 storage, gathered like a parameter's.
        self.fp8: dict[int, torch.Tensor] = {}
        if fp8_all_gather:
            from training.parallel.fp8 import fp8_weight_dtype

            for i, p in enumerate(layout.params):
                if getattr(p, "fp8_weight", False):
                    self.fp8[i] = torch.empty(p.shape, dtype=fp8_weight_dtype(), device=p.device)
                    self.fp8[i].untyped_storage().resize_(0)
                    p.fp8_storage = self.fp8[i]  # model state, not activations, to the saved-bytes counters
        self.refs8 = [0] * len(layout.params)
        self.scales: dict[int, torch.Tensor] = {}
        """FP8 weight -> its tensorwise scale (0-dim fp32), from the amax over every rank's shard."""
        self._scales_stale = True
        self._model_dtype_only = False

    # ----- setup -----------------------------------------------------------------------------------
    def watch(self, chunks: list[torch.nn.Module]) -> None:
        """Build each chunk's units, hook them, and release every parameter (each gets a storage of its own)."""
        covered = set()
        for chunk in chunks:
            declared = chunk.param_units() if hasattr(chunk, "param_units") else []
            listed = {id(p) for _, params in declared for p in params}
            rest = [p for p in chunk.parameters() if id(p) not in listed and id(p) in self._index]
            if rest:  # parameters of no declared unit: gathered when the chunk's forward starts, kept for the step
                covered.update(self._index[id(p)] for p in rest)
                self.units.append(self._make_unit([self._index[id(p)] for p in rest], True))
                unit = len(self.units) - 1
                chunk.register_forward_pre_hook(lambda _m, _a, u=unit: self.gather(u))
            head = bool(getattr(chunk, "has_head", False))
            mods = []
            for k, (module, params) in enumerate(declared):
                idx = list(dict.fromkeys(self._index[id(p)] for p in params if id(p) in self._index))
                if idx:
                    mods.append((module, idx, head and k == len(declared) - 1))
            chain: list[int] = []
            for _module, idx, keep in mods:
                covered.update(idx)
                self.units.append(self._make_unit(idx, keep))
                chain.append(len(self.units) - 1)
            for pos, (module, _, _) in enumerate(mods):
                self._hook(module, chain, pos)
        missing = [self.layout.names[i] for i in range(len(self.layout.params)) if i not in covered]
        if missing:
            raise ValueError(f"zero=3: parameters {missing[:3]} belong to no unit of the model chunks")
        with torch.no_grad():
            for p in self.layout.params:
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)  # a storage of its own
                p.data.untyped_storage().resize_(0)
        for i in self.fp8:  # the FP8 matmul reads the float8 weight while it is gathered (training/parallel/fp8.py)
            self.layout.params[i].fp8_gathered = partial(self._fp8_source, i)
        self.watching = True

    def _fp8_source(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(float8 values, scale) of FP8 weight i while a unit holds it gathered in float8, else None."""
        return (self.fp8[i], self.scales[i]) if self.refs8[i] > 0 else None

    def _wants_fp8(self, unit: _Unit) -> bool:
        return not self._model_dtype_only and any(i in self.fp8 for i in unit.params)

    @torch.no_grad()
    def _refresh_scales(self) -> None:
        """The FP8 weights' scales from the current shards: this rank's amaxes, one MAX all-reduce over the
        group (every member calls this at the same gather: the first float8 one after the shards changed)."""
        from training.parallel.fp8 import fp8_weight_scales

        order = {i: k for k, i in enumerate(sorted(self.fp8))}
        amax = torch.zeros(len(order), dtype=torch.float32, device=self.shard.device)
        for s in self.layout.segments:
            k = order.get(s.param_index)
            if k is not None and s.shard_end > s.shard_start:
                part = self.shard[s.shard_start : s.shard_end].abs().max().float()
                amax[k] = torch.maximum(amax[k], part)
        if self.layout.dp > 1:
            comm.all_reduce_op(amax, group=self.group, op=comm.ReduceOp.MAX)
        scales = fp8_weight_scales(amax)
        self.scales = {i: scales[k] for i, k in order.items()}
        self._scales_stale = False

    def _make_unit(self, idx: list[int], keep: bool) -> _Unit:
        lay = self.layout
        S = lay.shard_size
        pieces = []
        for q in range(lay.dp):
            mine = []
            for i in idx:
                o = lay.offsets[i]
                lo, hi = max(o, q * S), min(o + lay.params[i].numel(), (q + 1) * S)
                if lo < hi:
                    mine.append((i, lo, hi))
            if mine:
                pieces.append((q, mine))
        return _Unit(idx, keep, pieces)

    def _hook(self, module: torch.nn.Module, chain: list[int], pos: int) -> None:
        u = chain[pos]
        nxt = chain[pos + 1] if pos + 1 < len(chain) else None
        prev = chain[pos - 1] if pos > 0 else None

        def pre(_module, _args):
            self.gather(u)
            if nxt is not None and not _in_backward():
                self.prefetch(nxt)

        def before_backward(grad):
            self.gather(u)
            if nxt is not None:
                self.release(nxt)
            if prev is not None:
                self.prefetch(prev)
            return grad

        def post(_module, _args, output):
            if _in_backward():
                return output  # recomputation: backward reads the unit next
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(before_backward)
                if self.reshard_after_forward and not self.units[u].keep_after_forward:
                    self.release(u)
            elif not torch.is_grad_enabled() and not self.units[u].keep_after_forward:
                self.release(u)  # evaluation: no backward follows (the head's unit: until the next step)
            return output

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    # ----- gather and release ----------------------------------------------------------------------
    def _alloc(self, i: int, fp8: bool = False) -> None:
        if fp8:  # the float8 storage: 1 byte an element
            if self.refs8[i] == 0:
                self.fp8[i].untyped_storage().resize_(self.fp8[i].numel())
                self._gathered_bytes += self.fp8[i].numel()
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
            self.refs8[i] += 1
            return
        p = self.layout.params[i]
        if self.refs[i] == 0:
            p.data.untyped_storage().resize_(p.numel() * p.element_size())
            self._gathered_bytes += p.numel() * p.element_size()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        self.refs[i] += 1

    def prefetch(self, u: int) -> None:
        """Start gathering unit u (a no-op when it is gathered or on its way)."""
        unit = self.units[u]
        if unit.state != "free":
            return
        unit.fp8 = self._wants_fp8(unit)
        if unit.fp8 and self._scales_stale:
            self._refresh_scales()
        for i in unit.params:
            self._alloc(i, unit.fp8 and i in self.fp8)
        lay = self.layout
        for q, mine in unit.pieces:
            if unit.fp8:
                buf = self._fp8_message(q, mine)
            else:
                n = sum(hi - lo for _, lo, hi in mine)
                buf = torch.empty(n, dtype=self.shard.dtype, device=self.shard.device)
                if q == lay.dp_rank:
                    pos = 0
                    for _, lo, hi in mine:
                        buf[pos : pos + hi - lo].copy_(self.shard[lo - lay.shard_lo : hi - lay.shard_lo])
                        pos += hi - lo
            if not self._model_dtype_only:
                self.gather_bytes += buf.numel() * buf.element_size()
            work = None
            if lay.dp > 1:
                work = comm.broadcast(buf, src=comm.global_rank(self.group, q), group=self.group, async_op=True)
            unit.works.append((work, buf, mine))
        unit.state = "pending"

    def _fp8_parts(self, buf: torch.Tensor, mine) -> tuple[torch.Tensor, torch.Tensor]:
        """A float8 message's two parts: the model-dtype elements of `mine` (in order), then the float8 ones."""
        n_hp = sum(hi - lo for i, lo, hi in mine if i not in self.fp8)
        size = n_hp * self.shard.element_size()
        return buf[:size].view(self.shard.dtype), buf[size:].view(next(iter(self.fp8.values())).dtype)

    @torch.no_grad()
    def _fp8_message(self, q: int, mine) -> torch.Tensor:
        """The bytes owner q broadcasts of `mine`: FP8 weights cast to float8 at their scales, the rest as is."""
        lay = self.layout
        n8 = sum(hi - lo for i, lo, hi in mine if i in self.fp8)
        n_hp = sum(hi - lo for _, lo, hi in mine) - n8
        buf = torch.empty(n_hp * self.shard.element_size() + n8, dtype=torch.uint8, device=self.shard.device)
        self.gather_fp8_bytes += n8
        if q == lay.dp_rank:
            from training.parallel.fp8 import fp8_cast_weight

            hp, f8 = self._fp8_parts(buf, mine)
            pos_hp = pos8 = 0
            for i, lo, hi in mine:
                values = self.shard[lo - lay.shard_lo : hi - lay.shard_lo]
                if i in self.fp8:
                    f8[pos8 : pos8 + hi - lo].copy_(fp8_cast_weight(values, self.scales[i]))
                    pos8 += hi - lo
                else:
                    hp[pos_hp : pos_hp + hi - lo].copy_(values)
                    pos_hp += hi - lo
        return buf

    def gather(self, u: int) -> None:
        """Unit u's parameters hold their full values when this returns."""
        unit = self.units[u]
        if unit.state == "ready" and not unit.fp8 and self._wants_fp8(unit) and not _in_backward():
            self.release(u)  # gathered in the model dtype by gather_all: forward reads the float8 weights
        if unit.state == "free":
            self.prefetch(u)
        elif unit.state == "pending":
            self.prefetched += 1
        if unit.state == "pending":
            lay = self.layout
            with torch.no_grad():
                for work, buf, mine in unit.works:
                    if work is not None:
                        work.wait()
                    if unit.fp8:
                        self._fp8_unpack(buf, mine)
                        continue
                    pos = 0
                    for i, lo, hi in mine:
                        o = lay.offsets[i]
                        lay.params[i].data.view(-1)[lo - o : hi - o].copy_(buf[pos : pos + hi - lo])
                        pos += hi - lo
            unit.works = []
            unit.state = "ready"

    def _fp8_unpack(self, buf: torch.Tensor, mine) -> None:
        lay = self.layout
        hp, f8 = self._fp8_parts(buf, mine)
        pos_hp = pos8 = 0
        for i, lo, hi in mine:
            o = lay.offsets[i]
            if i in self.fp8:
                self.fp8[i].view(-1)[lo - o : hi - o].copy_(f8[pos8 : pos8 + hi - lo])
                pos8 += hi - lo
            else:
                lay.params[i].data.view(-1)[lo - o : hi - o].copy_(hp[pos_hp : pos_hp + hi - lo])
                pos_hp += hi - lo

    def release(self, u: int) -> None:
        """Unit u no longer needs its parameters: each storage no gathered unit holds is freed."""
        unit = self.units[u]
        if unit.state == "free":
            return
        if unit.state == "pending":
            self.gather(u)  # its broadcasts must complete (every dp rank takes part in them)
        for i in unit.params:
            if unit.fp8 and i in self.fp8:
                self.refs8[i] -= 1
                if self.refs8[i] == 0:
                    self.fp8[i].untyped_storage().resize_(0)
                    self._gathered_bytes -= self.fp8[i].numel()
                continue
            self.refs[i] -= 1
            if self.refs[i] == 0:
                p = self.layout.params[i]
                p.data.untyped_storage().resize_(0)
                self._gathered_bytes -= p.numel() * p.element_size()
        unit.state = "free"

    def gather_all(self) -> None:
        """Every parameter materialised (checkpoints and whoever reads the model); released by the next step."""
        peak, prefetched = self.peak_gathered_bytes, self.prefetched  # the hooks' figures, not this
        for u, unit in enumerate(self.units):
            if unit.fp8 and unit.state != "free":
                self.release(u)  # held in float8: readers of the model read the model dtype
        self._model_dtype_only = True
        try:
            for u in range(len(self.units)):
                self.prefetch(u)
            for u in range(len(self.units)):
                self.gather(u)
        finally:
            self._model_dtype_only = False
        self.peak_gathered_bytes, self.prefetched = peak, prefetched

    def release_all(self) -> None:
        """Every unit released (the end of a step's backward, a checkpoint load): the shards may change next,
        so the FP8 weights' scales are taken again at the next float8 gather."""
        for u in range(len(self.units)):
            self.release(u)
        self._scales_stale = True

    def nbytes(self) -> int:
        """Bytes of the persistent shard."""
        return self.shard.numel() * self.shard.element_size()

    def refresh_shard(self) -> None:
        """Take this rank's shard from the (gathered) parameters: after a checkpoint loaded them in place."""
        self._scales_stale = True
        lay = self.layout
        for s in lay.segments:
            p = lay.params[s.param_index].detach().reshape(-1)
            self.shard[s.shard_start : s.shard_end].copy_(
                p[s.param_start : s.param_start + s.shard_end - s.shard_start]
            )
