"""RMSNorm, SwiGLU and rotary embedding as autograd Functions that save for backward only what the planner
counts (launcher/plan/memory.py, layer_activation_bytes), as fused training kernels do.

Written with ordinary torch ops, each one's saved tensors differ from the composite form's:
  RMSNorm: the input and the fp32 rstd per row; the normalised value is recomputed in backward (the composite
           form keeps x * rstd besides x: one more activation-sized tensor per norm).
  SwiGLU:  the fc1 output (gate and up); silu(gate) is recomputed in backward (the composite form keeps
           silu(gate) as well, four f-wide tensors per token where the plan counts three with fc2's input).
  RoPE:    nothing but the tables: q is rotated into a tensor of its own and k into another with v copied
           beside it, so what attention saves is one QKV's worth of storage; backward is the inverse rotation.
           The composite form rotated q and k into new tensors while v stayed a view of the linear's output,
           whose whole storage (q and k included) then stayed alive beside the rotated copies.
The forward of each is the composite form's arithmetic, op for op (the same values in every dtype); the
backward is the same derivative computed in another order (fp32 rounding differs; docs/PERFORMANCE.md).

Device-agnostic (CPU, CUDA; fp32, bf16, fp16): reduced-precision inputs are computed in fp32 and rounded
once, as the composite forms do. torch.compile traces through them (training/model/compile_layers.py).
On CUDA torch has its own fused RMSNorm kernel (aten::_fused_rms_norm, which saves the input, the weight and
the fp32 rstd as the Function does): `rms_norm` calls it there through F.rms_norm, as the model did before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# torch's native RMSNorm kernel (saves the input and rstd) exists where this op does; CPU runs the composite.
_NATIVE_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


class _RMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w over the last dim; saves x and the fp32 rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd  # recomputed, not saved
        g = grad.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = g * weight.float()
            # d/dx of x * rstd: rstd * (gw - xhat * mean(gw * xhat)) per row.
            grad_x = (rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim keeping only x and the per-row rstd for backward."""
    if x.is_cuda and _NATIVE_FUSED_RMS_NORM:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return _RMSNorm.apply(x, weight, eps)


def _gate_up(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's output [..., 2f] with gate and up rows interleaved (training/model/gpt.py) -> gate, up [..., f]."""
    return y.view(*y.shape[:-1], -1, 2).unbind(-1)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up from fc1's interleaved output; saves only that output."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        gate, up = _gate_up(y)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        gate, up = _gate_up(y)
        gate, up, g = gate.float(), up.float(), grad.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig  # recomputed, not saved
        d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))  # silu'(x) = sig(x) (1 + x (1 - sig(x)))
        d_up = g * silu
        return torch.stack([d_gate, d_up], dim=-1).reshape(y.shape).to(y.dtype)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1's interleaved [gate_0, up_0, gate_1, up_1, ...] output; only that output is saved."""
    return _SwiGLU.apply(y.contiguous())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim's halves: dimension i rotates with i + d/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class _RotaryQKV(torch.autograd.Function):
    """From a packed QKV tensor [n0, n1, groups, q_per_group + 2, d] (the sequence along dim seq_dim): the
    rotated q heads as one tensor [n0, n1, groups * q_per_group, d] and the rotated k with v beside it as
    another [n0, n1, groups, 2, d]; saves only the tables."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int):
        cos, sin = _table(cos, seq_dim), _table(sin, seq_dim)
        ctx.save_for_backward(cos, sin)
        n0, n1, groups, heads, d = qkv.shape
        q = _rotate(qkv[:, :, :, : heads - 2], cos, sin).reshape(n0, n1, groups * (heads - 2), d)
        kv = torch.cat([_rotate(qkv[:, :, :, heads - 2 : heads - 1], cos, sin), qkv[:, :, :, heads - 1 :]], dim=3)
        return q, kv

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_kv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        n0, n1, groups, _, d = grad_kv.shape
        grad_q = grad_q.reshape(n0, n1, groups, -1, d)
        # The rotation by angle t is orthogonal (the tables repeat over the halves): its transpose is the
        # rotation by -t.
        neg = -sin
        grad = torch.cat(
            [_rotate(grad_q, cos, neg), _rotate(grad_kv[:, :, :, :1], cos, neg), grad_kv[:, :, :, 1:]], dim=3
        )
        return grad, None, None, None


def _table(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """[s, d] -> broadcastable against [n0, n1, groups, heads, d] with the sequence at dim seq_dim."""
    return t.view(t.shape[0], 1, 1, 1, t.shape[1]) if seq_dim == 0 else t.view(1, t.shape[0], 1, 1, t.shape[1])


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int):
    """The packed QKV tensor [n0, n1, groups, q_per_group + 2, d] with q and k rotated by the tables cos/sin
    [s, d] (the positions of the s tokens along dim seq_dim, 0 or 1): q [n0, n1, groups * q_per_group, d] and
    kv [n0, n1, groups, 2, d] (k, then v), two new tensors. Attention saves q and views of kv: one QKV-sized
    storage in all, and the linear's output is freed."""
    return _RotaryQKV.apply(qkv, cos, sin, seq_dim)
