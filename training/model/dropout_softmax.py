"""Dropout and the attention softmax saving for backward what Megatron-LM's CUDA kernels save.

Korthikanti et al. 2022 (Table 2) count a dropout mask at 1 byte per element and math attention's softmax at
its 16-bit output; composite torch ops save more: `x * mask.to(x.dtype)` keeps the mask in the activation
dtype (2 bytes at bf16), and `scores.float().softmax().to(bf16)` keeps softmax's fp32 output (4 bytes) besides
the 16-bit copy the next op saves. These two autograd Functions compute the same forward values, bit for bit,
and save only:
- `masked_scale`: the boolean mask (1 byte per element); backward multiplies as the composite form's
  autograd did ((g * scale) * mask), so the grads are bit-identical too. The mask is a pure function of its
  key (training/model/gpt.py keyed_dropout), so a recomputation draws the same one.
- `softmax_16`: the softmax computed in fp32 and returned in the input's dtype, saving that output (Megatron's
  fused softmax keeps the 16-bit probabilities); backward is softmax's, y (g - sum(g y)), in fp32 from them.
  In fp32 runs it saves the same fp32 output autograd's softmax saved.
"""

from __future__ import annotations

import torch


class _MaskedScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep.to(x.dtype) * scale

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return (g * ctx.scale) * keep.to(g.dtype), None, None


def masked_scale(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """x * keep * scale (keep: bool, x's shape), saving only the 1-byte mask for backward."""
    return _MaskedScale.apply(x, keep, scale)


class _Softmax16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = (scores.float() + bias).softmax(dim=-1).to(scores.dtype)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (out,) = ctx.saved_tensors
        y, gf = out.float(), g.float()
        grad = y * (gf - (gf * y).sum(dim=-1, keepdim=True))
        return grad.to(out.dtype), None


def softmax_16(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(scores + bias) over the last dim, in fp32, returned (and saved) in scores' dtype; bias (fp32,
    broadcast, e.g. the causal -inf mask) gets no grad."""
    return _Softmax16.apply(scores, bias)
