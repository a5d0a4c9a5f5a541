"""The kernels a CUDA run would pick, where meta tensors would pick another.

On meta, F.scaled_dot_product_attention takes the math path, which saves the s x s probabilities for backward;
on a GPU the same call runs the flash kernel (16-bit inputs, no mask), which saves only q, k, v, the output and
its log-sum-exp. The rehearsal's memory is the GPU's, so under it a 16-bit attention on meta calls the flash
kernel's operator (its meta function and autograd formula are torch's own). Nothing else changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CudaKernels:
    """Active during a rehearsed step whose run is on CUDA. F.scaled_dot_product_attention is replaced process-wide
    (a rehearsal's worker runs nothing else): a mode would not reach the recomputation of a checkpointed
    attention, which autograd may run on another thread, and the recomputation must save what the forward saved."""

    def __enter__(self):
        self.real = F.scaled_dot_product_attention
        real = self.real

        def sdpa(*args, **kwargs):
            if not _flash_eligible(args, kwargs):
                return real(*args, **kwargs)
            q, k, v = args[:3]
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q,
                k,
                v,
                float(kwargs.get("dropout_p", 0.0)),
                bool(kwargs.get("is_causal", False)),
                False,
                scale=kwargs.get("scale"),
            )
            return out[0]

        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.real
        return False


def _flash_eligible(args, kwargs) -> bool:
    q = args[0]
    return (
        isinstance(q, torch.Tensor)
        and q.device.type == "meta"
        and q.dtype in (torch.bfloat16, torch.float16)
        and kwargs.get("attn_mask") is None
        and len(args) == 3
    )
