"""Megatron-style communication regions as autograd functions over plain tensors.

Layout convention: activations are sequence-first, [s, b, h]; sequence parallelism splits dim 0,
tensor parallelism splits the last dim. A group of None (ProcessMesh.single()) or of size 1 makes
every function here the identity, so the model code never branches on the layout.

Forward / backward pairs (Korthikanti et al. 2022, Megatron-LM):
  copy_to_tp            identity     / all-reduce
  reduce_from_tp        all-reduce   / identity
  scatter_to_tp         split last   / all-gather last
  gather_from_tp        all-gather last / split last
  scatter_to_sp         split dim 0  / all-gather dim 0
  gather_from_sp        all-gather dim 0 / reduce-scatter dim 0 (the output feeds a TP region)
  reduce_scatter_to_sp  reduce-scatter dim 0 / all-gather dim 0
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of the *_single ones.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's x along dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_base(out, x, group=group)
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
    _reduce_scatter_base(out, x, group=group)
    return out


def split_dim(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's contiguous 1/n slice of x along dim (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's x along the last dim."""
    n = group_size(group)
    if n == 1:
        return x
    # Gather along dim 0 (contiguous per rank), then move the rank axis next to the last dim.
    g = all_gather_dim0(x.unsqueeze(0), group)  # [n, ...]
    return torch.cat(g.unbind(0), dim=-1).contiguous()


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


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_last(g, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return split_dim(g, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_tp_region):
        ctx.group, ctx.to_tp_region = group, to_tp_region
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        # Feeding a TP region, each rank's grad is a partial sum: reduce-scatter; otherwise just split.
        if ctx.to_tp_region:
            return reduce_scatter_dim0(g, ctx.group), None, None
        return split_dim(g, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


def _active(group: Any) -> bool:
    return group_size(group) > 1


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of the grad."""
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region: all-reduce the partial sums forward, identity backward."""
    return _ReduceFromTP.apply(x, group) if _active(group) else x


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers it."""
    return _ScatterToTP.apply(x, group) if _active(group) else x


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's slice."""
    return _GatherFromTP.apply(x, group) if _active(group) else x


def scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's sequence shard (dim 0) of a replicated tensor; backward all-gathers."""
    return _ScatterToSP.apply(x, group) if _active(group) else x


def gather_from_sp(x: torch.Tensor, group: Any, to_tp_region: bool = True) -> torch.Tensor:
    """All-gather sequence shards (dim 0); backward reduce-scatters (or splits if not to_tp_region)."""
    return _GatherFromSP.apply(x, group, to_tp_region) if _active(group) else x


def reduce_scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum partial results over TP and keep this rank's sequence shard; backward all-gathers."""
    return _ReduceScatterToSP.apply(x, group) if _active(group) else x
