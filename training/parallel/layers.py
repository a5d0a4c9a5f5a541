"""Tensor-parallel layers over plain tensors (Megatron-LM style).

Every parameter carries the metadata of docs/CONTRACTS.md: `tp_shard_dim` (0, 1 or None),
`global_shape` (unsharded shape, vocab padding included) and `sequence_parallel` (a replicated
parameter used on sequence shards: its grad is a partial sum that needs a TP all-reduce, which
training/optim/model_parallel.py does). Weights are created empty; the model initialises them
layout-independently (training/model/init.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.parallel.collectives import (
    ReduceOp,
    all_gather_dim0,
    all_reduce,
    copy_to_tp,
    gather_from_sp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_dim0,
    reduce_scatter_to_sp,
)


def set_tp_meta(
    p: nn.Parameter, tp_shard_dim: int | None, global_shape: Sequence[int], sequence_parallel: bool = False
) -> nn.Parameter:
    """Attach the contract's metadata to a parameter."""
    p.tp_shard_dim = tp_shard_dim
    p.global_shape = tuple(int(v) for v in global_shape)
    p.sequence_parallel = bool(sequence_parallel)
    return p


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} = {n} is not divisible by tp = {d}; choose a tp that divides it")
    return n // d


class _LinearWithSPGather(torch.autograd.Function):
    """all-gather(x along the sequence) @ W^T + b, saving only the local sequence shard.

    Backward re-gathers the input for the weight grad and reduce-scatters the input grad, so the
    gathered [s, b, h] tensor is never kept between forward and backward (Korthikanti et al. 2022).
    """

    @staticmethod
    def forward(ctx, x_local, weight, bias, group):
        total = all_gather_dim0(x_local, group)
        out = F.linear(total, weight, bias)
        ctx.save_for_backward(x_local, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        x_local, weight = ctx.saved_tensors
        total = all_gather_dim0(x_local, ctx.group)
        g = g.contiguous()
        grad_input = reduce_scatter_dim0(g.matmul(weight), ctx.group)
        g2 = g.reshape(-1, g.shape[-1])
        grad_weight = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


Matmul = Callable[..., torch.Tensor]
"""`(x, weight, bias) -> x @ weight^T + bias`: F.linear, or an FP8 one (training/parallel/fp8.py Fp8Linear.linear)."""


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Any,
    sequence_parallel: bool,
    matmul: Matmul | None = None,
) -> torch.Tensor:
    """y_local = x @ W_local^T (+ b_local); x replicated, or a sequence shard under SP (gathered here).

    `matmul` None: F.linear (under SP saving only the sequence shard). An FP8 matmul under SP runs on the
    gathered input, which torchao's float8 function saves whole for backward (tp times the shard's bytes)."""
    sp = sequence_parallel and group_size(group) > 1
    if matmul is not None:
        return matmul(gather_from_sp(x, group) if sp else copy_to_tp(x, group), weight, bias)
    if sp:
        return _LinearWithSPGather.apply(x, weight, bias, group)
    return F.linear(copy_to_tp(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """Linear whose output features are split over tp (weight [out/tp, in], tp_shard_dim 0).

    Input: replicated [s, b, in] (or the local sequence shard [s/tp, b, in] under SP);
    output: [s, b, out/tp], left split (feeds a RowParallelLinear or the loss).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: Any,
        sequence_parallel: bool,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        tp = group_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel and tp > 1
        local = _divide(out_features, tp, "output features of a column-parallel linear")
        self.weight = set_tp_meta(_param((local, in_features), dtype, device), 0, (out_features, in_features))
        self.bias = set_tp_meta(_param((local,), dtype, device), 0, (out_features,)) if bias else None
        self.matmul: Matmul | None = None  # an FP8 matmul when train.precision=fp8 (training/model/fp8_apply.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel, self.matmul)


class RowParallelLinear(nn.Module):
    """Linear whose input features are split over tp (weight [out, in/tp], tp_shard_dim 1).

    Input: [s, b, in/tp] from a column-parallel layer; output: the all-reduced [s, b, out], or under SP
    the reduce-scattered sequence shard [s/tp, b, out]. The bias is replicated and added after the
    reduction (under SP on shards, hence `sequence_parallel`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: Any,
        sequence_parallel: bool,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        tp = group_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel and tp > 1
        local = _divide(in_features, tp, "input features of a row-parallel linear")
        self.weight = set_tp_meta(_param((out_features, local), dtype, device), 1, (out_features, in_features))
        self.bias = (
            set_tp_meta(_param((out_features,), dtype, device), None, (out_features,), self.sequence_parallel)
            if bias
            else None
        )
        self.single = tp == 1
        self.matmul: Matmul = F.linear  # an FP8 matmul when train.precision=fp8 (training/model/fp8_apply.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.single:  # nothing to reduce: the bias joins the matmul (one addmm, not a matmul and an add)
            return self.matmul(x, self.weight, self.bias)
        y = self.matmul(x, self.weight, None)
        y = reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over tp (weight [Vp/tp, h], tp_shard_dim 0).

    `forward(ids, reduce=False)` returns this rank's partial sum (zero rows for ids held elsewhere) so
    the caller can all-reduce it or, under SP, reduce-scatter it straight into sequence shards.
    """

    def __init__(self, padded_vocab: int, dim: int, group: Any, dtype: torch.dtype, device=None):
        super().__init__()
        tp = group_size(group)
        self.group = group
        self.local_vocab = _divide(padded_vocab, tp, "padded vocabulary")
        self.vocab_start = group_rank(group) * self.local_vocab
        self.weight = set_tp_meta(_param((self.local_vocab, dim), dtype, device), 0, (padded_vocab, dim))

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.local_vocab)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group) if reduce else out


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_in, targets, group, vocab_start, vocab_size):
        in_dtype = logits_in.dtype
        logits = logits_in.float()  # softmax statistics in fp32, whatever the param dtype
        n_local = logits.shape[-1]
        if vocab_start + n_local > vocab_size:  # padded vocabulary rows never win or count
            pad = torch.arange(vocab_start, vocab_start + n_local, device=logits.device) >= vocab_size
            logits = logits.masked_fill(pad, float("-inf"))
        lmax = logits.max(dim=-1).values
        all_reduce(lmax, group, op=ReduceOp.MAX)
        if logits.data_ptr() == logits_in.data_ptr():
            # Out of place: the caller's logits stay untouched without a defensive clone (one pass, not two).
            logits = logits - lmax.unsqueeze(-1)
        else:
            logits.sub_(lmax.unsqueeze(-1))  # a fresh tensor already (masked or cast to fp32)
        in_range = (targets >= vocab_start) & (targets < vocab_start + n_local)
        local_t = (targets - vocab_start).masked_fill(~in_range, 0)
        target_logit = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        all_reduce(target_logit, group)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax
        ctx.save_for_backward(exp, in_range, local_t)
        ctx.in_dtype = in_dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, in_range, local_t = ctx.saved_tensors
        # The saved softmax is this function's own tensor and backward runs once (no retain_graph in the
        # engine): it becomes the grad in place instead of being cloned.
        grad = softmax
        # softmax - one_hot(target), in place whatever the logits' layout (a caller may pass a transposed view).
        grad.scatter_add_(-1, local_t.unsqueeze(-1), in_range.unsqueeze(-1).to(grad.dtype).neg_())
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor, targets: torch.Tensor, group: Any, vocab_size: int
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of targets) from vocab-split logits, never gathering them.

    logits_local: [..., Vp/tp], this rank's contiguous vocabulary slice; columns at or beyond the
    real vocab_size (padding) are masked to -inf. The result is identical on every tp rank.
    """
    vocab_start = group_rank(group) * logits_local.shape[-1]
    return _VocabParallelCE.apply(logits_local, targets, group, vocab_start, vocab_size)
