"""Megatron-style communication regions as autograd functions over plain tensors.

Layout convention: activations are sequence-first, [s, b, h]; sequence parallelism splits dim 0,
tensor parallelism splits the last dim. A group of None (ProcessMesh.single()) or of size 1 makes
every function here the identity, so the model code never branches on the layout.

Forward / backward pairs (Korthikanti et al. 2022, Megatron-LM), the ones the model uses:
  copy_to_tp            identity     / all-reduce
  reduce_from_tp        all-reduce   / identity
  reduce_scatter_to_sp  reduce-scatter dim 0 / all-gather dim 0
(The sequence-parallel all-gather before a column-parallel linear lives in layers.py, fused with the
matmul so that the gathered input is not kept for backward.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of the *_single ones, which older
# torch (pyproject allows 2.4) does not have: every caller goes through these two names
# (tests/launcher/launch/test_gpu_paths_on_cpu.py checks that no module calls dist.*_single directly).
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Any = None, async_op: bool = False):
    """The ranks' x concatenated into out (dim 0), under either torch's name for it."""
    _record("all_gather_into_tensor", [x], group, async_op=async_op)
    return _all_gather_base(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: Any = None, async_op: bool = False):
    """This rank's slice of the sum of the ranks' x into out, under either torch's name for it."""
    _record("reduce_scatter_tensor", [x], group, async_op=async_op, reduce_op=dist.ReduceOp.SUM)
    return _reduce_scatter_base(out, x, group=group, async_op=async_op)


def group_size(group: Any) -> int:
    """Size of a group; 1 for None (a single-process mesh)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This rank's index in a group; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


# ---- plain (non-autograd) collectives ---------------------------------------------------------


def all_reduce(x: torch.Tensor, group: Any, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; identity for a None or size-1 group."""
    if group_size(group) > 1:
        _record("all_reduce", [x], group, reduce_op=op)
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's x along dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum x over ranks and keep this rank's 1/n slice of dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by the group size {n}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x, group=group)
    return out


# ---- autograd regions -------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g.contiguous(), ctx.group), None


def _active(group: Any) -> bool:
    return group_size(group) > 1


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of the grad."""
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region: all-reduce the partial sums forward, identity backward."""
    return _ReduceFromTP.apply(x, group) if _active(group) else x


def reduce_scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum partial results over TP and keep this rank's sequence shard; backward all-gathers."""
    return _ReduceScatterToSP.apply(x, group) if _active(group) else x


# ---- every other torch.distributed call of the engine -----------------------------------------------
# The engine's one door to torch.distributed (tests/engine/test_collectives_door.py holds it): each wrapper
# below takes torch's arguments, records the call when a recorder is installed (the rehearsal,
# training/rehearse/) and calls torch, looked up at call time so that train.nvtx's wrappers see it. Unlike
# all_reduce above, a group of None here means what it means to torch: the default (world) group.

ReduceOp = dist.ReduceOp
P2POp = dist.P2POp
Work = Any


def is_initialized() -> bool:
    """Whether a default process group exists (False in a single-process run without one)."""
    return dist.is_available() and dist.is_initialized()


def world_group() -> Any:
    """The default group, for the calls that span every rank."""
    return dist.group.WORLD


def world_size(group: Any = None) -> int:
    """Size of `group` (default: the world) as torch counts it."""
    return dist.get_world_size(group)


def rank(group: Any = None) -> int:
    """This rank's index in `group` (default: its global rank)."""
    return dist.get_rank(group)


def global_rank(group: Any, group_rank_: int) -> int:
    """The global rank of member `group_rank_` of `group`."""
    return dist.get_global_rank(group, group_rank_)


def group_ranks(group: Any) -> list[int]:
    """Global ranks of a group's members, in group order (the world's for None)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def backend(group: Any = None) -> str:
    """The backend's name of `group` ("gloo", "nccl"); under a rehearsal the backend the run would use, so the
    engine takes that backend's path."""
    if _RECORDER is not None and _RECORDER.backend:
        return _RECORDER.backend
    return str(dist.get_backend(group))


def init_process_group(backend_: str, **kwargs) -> None:
    """torch.distributed.init_process_group. "fake": torch's fake process group (any world size, no data moved,
    every device type including meta) on an in-process store: what the rehearsal runs on."""
    if backend_ == "fake":
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend; no public name)

        kwargs.setdefault("store", dist.HashStore())
        backend_ = "cpu:fake,cuda:fake,meta:fake"
    dist.init_process_group(backend_, **kwargs)


def destroy_process_group() -> None:
    """torch.distributed.destroy_process_group (every group)."""
    dist.destroy_process_group()


def new_group(ranks: Sequence[int], **kwargs) -> Any:
    """torch.distributed.new_group; every rank of the world calls it with the same ranks, in the same order."""
    _record("new_group", [], None, members=list(ranks))
    return dist.new_group(list(ranks), **kwargs)


def new_subgroups(size: int, **kwargs) -> Any:
    """torch.distributed.new_subgroups: (this rank's group of `size` consecutive ranks, every such group)."""
    _record("new_subgroups", [], None, members=[size])
    return dist.new_subgroups(group_size=size, **kwargs)


def all_reduce_op(x: torch.Tensor, group: Any = None, op=ReduceOp.SUM, async_op: bool = False) -> Work | None:
    """torch.distributed.all_reduce (a None group is the world; use all_reduce above for mesh groups)."""
    _record("all_reduce", [x], group, reduce_op=op, async_op=async_op)
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)


def reduce(x: torch.Tensor, dst: int, group: Any = None, op=ReduceOp.SUM, async_op: bool = False) -> Work | None:
    """torch.distributed.reduce to global rank dst."""
    _record("reduce", [x], group, reduce_op=op, async_op=async_op, root=dst)
    return dist.reduce(x, dst=dst, op=op, group=group, async_op=async_op)


def broadcast(x: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Work | None:
    """torch.distributed.broadcast from global rank src."""
    _record("broadcast", [x], group, async_op=async_op, root=src)
    return dist.broadcast(x, src=src, group=group, async_op=async_op)


def all_gather(out: list[torch.Tensor], x: torch.Tensor, group: Any = None, async_op: bool = False) -> Work | None:
    """torch.distributed.all_gather into a list of tensors."""
    _record("all_gather", [x], group, async_op=async_op)
    return dist.all_gather(out, x, group=group, async_op=async_op)


def all_to_all_single(
    out: torch.Tensor,
    x: torch.Tensor,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """torch.distributed.all_to_all_single (row splits per member; None for equal blocks)."""
    _record("all_to_all_single", [x], group, async_op=async_op, splits=(out_splits, in_splits))
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)


def barrier(group: Any = None) -> None:
    """torch.distributed.barrier."""
    _record("barrier", [], group)
    dist.barrier(group=group)


def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
    """torch.distributed.all_gather_object (pickled; on the group's device). Under a recorder that moves no data
    (the rehearsal's fake backend) every member's entry is this rank's object."""
    _record("all_gather_object", [], group)
    if _RECORDER is not None and _RECORDER.no_data:
        out[:] = [obj] * len(out)
        return
    dist.all_gather_object(out, obj, group=group)


def broadcast_object_list(box: list[Any], src: int, group: Any = None) -> None:
    """torch.distributed.broadcast_object_list from global rank src. Under a recorder that moves no data the list
    keeps this rank's objects (the fake backend cannot unpickle what it never received)."""
    _record("broadcast_object_list", [], group, root=src)
    if _RECORDER is not None and _RECORDER.no_data:
        return
    dist.broadcast_object_list(box, src=src, group=group)


def isend(x: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> Work:
    """torch.distributed.isend, un-batched (NCCL runs it on the pair's own communicator: prefer batch_isend_irecv)."""
    _record("isend", [x], group, peer=peer)
    return dist.isend(x, peer, group=group, tag=tag)


def irecv(x: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> Work:
    """torch.distributed.irecv, un-batched (see isend)."""
    _record("irecv", [x], group, peer=peer)
    return dist.irecv(x, peer, group=group, tag=tag)


def send_op(x: torch.Tensor, peer: int, group: Any, tag: int = 0) -> Any:
    """A send for batch_isend_irecv."""
    return dist.P2POp(dist.isend, x, peer, group, tag)


def recv_op(x: torch.Tensor, peer: int, group: Any, tag: int = 0) -> Any:
    """A receive for batch_isend_irecv."""
    return dist.P2POp(dist.irecv, x, peer, group, tag)


def batch_isend_irecv(ops: list[Any]) -> list[Work]:
    """torch.distributed.batch_isend_irecv: the sends and receives of one exchange as one NCCL group, which
    cannot deadlock on its own ops (every rank posts all of them before any waits)."""
    if _RECORDER is not None:
        batch = _RECORDER.next_batch()
        for p in ops:
            kind = "send" if p.op in (dist.isend, getattr(dist, "send", None)) else "recv"
            _record(kind, [p.tensor], p.group, peer=p.peer, batch=batch)
    return dist.batch_isend_irecv(ops)


_WARMED: set = set()


def create_communicator(group: Any, device: torch.device) -> None:
    """Once per group and process: one small all-reduce over `group`. On NCCL it creates the group's communicator,
    so that the point-to-point ops that follow run on it (created together by every member) instead of a
    communicator per rank pair created lazily by each op, which blocks until both ranks reach it."""
    if group is None or group_size(group) == 1 or id(group) in _WARMED:
        return
    all_reduce(torch.zeros(1, device=device), group)
    _WARMED.add(id(group))


# ---- the recording layer (off unless a recorder is installed) ---------------------------------------


@dataclass
class CommCall:
    """One recorded call of this rank."""

    order: int
    """Issue position on this rank (0, 1, ...)."""
    op: str
    """all_reduce | reduce | broadcast | all_gather | all_gather_into_tensor | reduce_scatter_tensor |
    all_to_all_single | barrier | all_gather_object | broadcast_object_list | new_group | new_subgroups |
    isend | irecv (un-batched) | send | recv (inside a batch_isend_irecv)."""
    group: tuple[int, ...]
    """The group's global ranks in group order (new_group: the ranks it creates)."""
    dtype: str
    """The tensor's dtype ("" without a tensor)."""
    numel: int
    """Elements of the tensor (0 without one)."""
    device: str
    """The tensor's device type ("meta", "cpu", "cuda"; "" without a tensor)."""
    site: str
    """Engine call site, path:line (function)."""
    phase: str
    """What the engine was doing (set by the recorder's owner: "forward_backward", "optimizer", "save", ...)."""
    reduce_op: str = ""
    """The reduction of a reducing collective."""
    root: int | None = None
    """Global source/destination rank of broadcast / reduce."""
    peer: int | None = None
    """Point-to-point: the peer's global rank."""
    batch: int | None = None
    """Point-to-point: index of the batch_isend_irecv it was part of (None: un-batched)."""
    async_op: bool = False
    """Issued asynchronously."""
    splits: Any = None
    """all_to_all_single: (out_splits, in_splits)."""
    members: Any = None
    """new_group's ranks / new_subgroups' size."""


@dataclass
class Recorder:
    """Collects every call of this process. `no_data`: the backend moves no data (torch's fake process group), so
    the object collectives answer with this rank's own objects."""

    no_data: bool = False
    backend: str = ""
    """The backend the rehearsed run would use ("nccl", "gloo"): what `backend()` answers while recording."""
    phase: str = ""
    calls: list[CommCall] = field(default_factory=list)
    batches: int = 0
    _ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def next_batch(self) -> int:
        self.batches += 1
        return self.batches - 1

    def ranks_of(self, group: Any) -> tuple[int, ...]:
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = tuple(group_ranks(group))
        return self._ranks[key]


_RECORDER: Recorder | None = None
_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_REHEARSE = os.path.join(_ROOT, "training", "rehearse") + os.sep  # its kernel mode's frames are not call sites


def start_recording(recorder: Recorder) -> None:
    """Record every call from now on into `recorder`."""
    global _RECORDER
    _RECORDER = recorder


def moves_no_data() -> bool:
    """Whether calls move no data (the rehearsal's fake backend, under a recorder with no_data): an object
    broadcast then leaves every rank its own object, so the caller computes the root's value on every rank."""
    return _RECORDER is not None and _RECORDER.no_data


def stop_recording() -> Recorder | None:
    """Stop recording; the recorder that was installed."""
    global _RECORDER
    rec, _RECORDER = _RECORDER, None
    return rec


def _call_site() -> str:
    """The first frame outside this module and outside torch: the engine's line that made the call."""
    f, fallback = sys._getframe(2), "?"
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_ROOT) and "site-packages" not in path and not path.startswith(_REHEARSE):
            site = f"{os.path.relpath(path, _ROOT)}:{f.f_lineno} ({f.f_code.co_name})"
            if path != _HERE:
                return site
            if fallback == "?":  # an autograd region's backward, called by autograd's engine: no engine frame
                fallback = site
        f = f.f_back
    return fallback


def _record(op: str, tensors: list[torch.Tensor], group: Any, reduce_op: Any = None, **info) -> None:
    """Zero cost when off (one global test); else one CommCall."""
    rec = _RECORDER
    if rec is None:
        return
    t = tensors[0] if tensors else None
    rec.calls.append(
        CommCall(
            order=len(rec.calls),
            op=op,
            group=rec.ranks_of(group) if op not in ("new_group", "new_subgroups") else (),
            dtype=str(t.dtype).replace("torch.", "") if t is not None else "",
            numel=t.numel() if t is not None else 0,
            device=t.device.type if t is not None else "",
            site=_call_site(),
            phase=rec.phase,
            reduce_op=str(reduce_op).rsplit(".", 1)[-1] if reduce_op is not None else "",
            **info,
        )
    )


def value(t: torch.Tensor, on_meta: float) -> float:
    """A (reduced) scalar read on the host. A rehearsal's meta tensors carry no value: `on_meta` stands in (the
    caller names a value that keeps every rank on the path a real run takes, e.g. a finite loss)."""
    if t.device.type == "meta":
        return float(on_meta)
    return float(t.item())


def gather_from_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence shards -> the whole sequence (all-gather along dim 0); backward reduce-scatters the grad."""
    return _GatherFromSP.apply(x, group) if _active(group) else x
