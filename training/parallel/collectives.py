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

from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of the *_single ones, which older
# torch (pyproject allows 2.4) does not have: every caller goes through these two names
# (tests/launcher/test_gpu_readiness.py checks that no module calls dist.*_single directly).
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Any = None, async_op: bool = False):
    """The ranks' x concatenated into out (dim 0), under either torch's name for it."""
    return _all_gather_base(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: Any = None, async_op: bool = False):
    """This rank's slice of the sum of the ranks' x into out, under either torch's name for it."""
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
