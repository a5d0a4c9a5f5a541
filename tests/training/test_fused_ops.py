"""training/model/fused_ops.py: RMSNorm, SwiGLU and RoPE as autograd Functions that save only what the planner counts.

Against the composite forms the model used before (F.rms_norm; silu(gate) * up; rotate-half on q and k): the
forward is the same in fp32, bf16 and fp16 (bit for bit), the gradients agree to rounding; what each saves for
backward (saved-tensor hooks, training/observe/saved_bytes.py) is x and the fp32 rstd, fc1's output, and the
rotary tables alone; torch.compile traces through all three (dynamo and AOTAutograd, the part of
train.compile that meets them; inductor's code generation is the same as for any op).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.model.fused_ops import rms_norm, rotary_qkv, rotate_half, swiglu
from training.observe.saved_bytes import SavedBytes

S, B, H, F_, GROUPS, QPG, D = 16, 2, 32, 48, 2, 3, 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Gradient agreement: fp32 rounding, and the 16-bit formats' rounding of intermediates the composite form
# keeps at 16 bits where the Functions compute in fp32.
GRAD_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _tables(s: int = S):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _composite_swiglu(y):
    gate, up = y.view(*y.shape[:-1], -1, 2).unbind(-1)
    return F.silu(gate) * up


def _composite_rotary(qkv, cos, sin, seq_dim):
    """The model's previous path: q and k split off the packed tensor, each rotated in fp32 and cast back."""
    shape = (-1, 1, 1, 1, D) if seq_dim == 0 else (1, -1, 1, 1, D)
    cos, sin = cos.view(shape), sin.view(shape)

    def rot(x):
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    n0, n1 = qkv.shape[:2]
    q, k, v = torch.split(qkv, [QPG, 1, 1], dim=3)
    return rot(q).reshape(n0, n1, GROUPS * QPG, D), torch.cat([rot(k), v], dim=3)


def _cases():
    cos, sin = _tables()
    return {
        "rmsnorm": (
            lambda x, w: rms_norm(x, w, 1e-5),
            lambda x, w: F.rms_norm(x, (H,), w, eps=1e-5),
            [torch.randn(B, S, H), torch.rand(H) + 0.5],
        ),
        "swiglu": (swiglu, _composite_swiglu, [torch.randn(B, S, 2 * F_)]),
        # batch-first [b, s, ...] and sequence-first [s, b, ...] (sequence parallelism) packed QKV tensors
        "rope_batch_first": (
            lambda t: rotary_qkv(t, cos, sin, 1),
            lambda t: _composite_rotary(t, cos, sin, 1),
            [torch.randn(B, S, GROUPS, QPG + 2, D)],
        ),
        "rope_sequence_first": (
            lambda t: rotary_qkv(t, cos, sin, 0),
            lambda t: _composite_rotary(t, cos, sin, 0),
            [torch.randn(S, B, GROUPS, QPG + 2, D)],
        ),
    }


def _outputs_and_grads(fn, inputs, dtype, grads=None):
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*xs)
    out = out if isinstance(out, tuple) else (out,)
    if grads is None:
        grads = [torch.randn(o.shape).to(dtype) for o in out]
    torch.autograd.backward(out, grads)
    return [o.detach() for o in out], [x.grad for x in xs], grads


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", ["rmsnorm", "swiglu", "rope_batch_first", "rope_sequence_first"])
def test_fused_ops_compute_the_composite_forms(op, dtype):
    torch.manual_seed(0)
    fused, composite, inputs = _cases()[op]
    out, grads, upstream = _outputs_and_grads(fused, inputs, dtype)
    ref_out, ref_grads, _ = _outputs_and_grads(composite, inputs, dtype, upstream)
    for a, b in zip(out, ref_out):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), f"{op} {dtype}: forward differs"
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        err = float((a.float() - b.float()).abs().max())
        scale = float(b.float().abs().max())
        assert scale > 0 and err <= GRAD_RTOL[dtype] * scale, f"{op} {dtype}: grad error {err:.3g} of {scale:.3g}"


def _saved(fn, *inputs, exclude=()):
    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with SavedBytes(list(exclude)) as saved:
        fn(*xs)
    return saved.total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_each_op_saves_only_what_the_plan_counts(dtype):
    es = torch.tensor([], dtype=dtype).element_size()
    x, w = torch.randn(B, S, H, dtype=dtype), torch.ones(H, dtype=dtype, requires_grad=True)
    # RMSNorm: its input and one fp32 rstd per row (the weight is a parameter: left out); the composite form
    # keeps x * rstd as well, for the weight's gradient (and at 16 bits the fp32 copy of x).
    fused = _saved(lambda x: rms_norm(x, w, 1e-5), x, exclude=[w])
    assert fused == B * S * H * es + B * S * 4
    assert _saved(lambda x: F.rms_norm(x, (H,), w, eps=1e-5), x, exclude=[w]) >= fused + B * S * H * es
    # SwiGLU: fc1's output (gate and up) alone; the composite form keeps silu(gate) too.
    y = torch.randn(B, S, 2 * F_, dtype=dtype)
    assert _saved(swiglu, y) == B * S * 2 * F_ * es
    assert _saved(_composite_swiglu, y) == B * S * 3 * F_ * es
    # RoPE: nothing but the tables (module buffers: left out as model state); the outputs q and k+v, one QKV's
    # worth, are what attention then saves, and the packed input is free once the Function returns.
    cos, sin = _tables()
    qkv = torch.randn(B, S, GROUPS, QPG + 2, D, dtype=dtype)
    keep = []
    assert _saved(lambda t: keep.extend(t2.detach() for t2 in rotary_qkv(t, cos, sin, 1)), qkv, exclude=[cos, sin]) == 0
    q, kv = keep
    assert q.untyped_storage().nbytes() + kv.untyped_storage().nbytes() == qkv.numel() * es
    assert q.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()


def test_torch_compile_traces_through_the_fused_ops():
    """A Llama-style MLP and attention prologue compiled (dynamo + AOTAutograd, the aot_eager backend) give the
    eager outputs and gradients."""
    torch.manual_seed(0)
    cos, sin = _tables()
    w_norm = torch.rand(H) + 0.5
    w_qkv = torch.randn(GROUPS * (QPG + 2) * D, H) * 0.1
    w_fc1 = torch.randn(2 * F_, H) * 0.1

    def block(x, wn, wq, wf):
        h = rms_norm(x, wn, 1e-5)
        q, kv = rotary_qkv(F.linear(h, wq).view(B, S, GROUPS, QPG + 2, D), cos, sin, 1)
        return q.sum() + (kv * kv).sum() + swiglu(F.linear(h, wf)).pow(2).sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (block, compiled):
        args = [
            t.clone().requires_grad_()
            for t in (torch.randn(B, S, H, generator=torch.Generator().manual_seed(1)), w_norm, w_qkv, w_fc1)
        ]
        out = fn(*args)
        out.backward()
        results.append((out.detach(), [a.grad for a in args]))
    (eager, eager_grads), (comp, comp_grads) = results
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=0)
    for a, b in zip(comp_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
