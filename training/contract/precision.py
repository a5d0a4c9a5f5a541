"""Training precisions: the one table of what each precision stores (pure Python; the planner reads it too).

Mixed precision as docs/CONTRACTS.md accounts it: bf16 and fp16 keep the weights in 16 bits, with main
grads in fp32 (bf16) or in fp16 under a loss scale (fp16), an fp32 master copy of the weights and fp32 Adam
moments; fp32 keeps everything in fp32 and needs no master copy. Dtypes are named, not torch objects, so
that the launcher can import this module without torch; `torch_dtype` turns a name into the torch dtype.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""The values train.precision accepts once resolved."""

PARAM_DTYPE: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
"""Dtype of the model's weights and activations (fp8 stores bf16: only the linears' matmul operands are cast to
float8, transiently, training/parallel/fp8.py)."""

GRAD_DTYPE: dict[str, str] = {"fp32": "float32", "bf16": "float32", "fp16": "float16", "fp8": "float32"}
"""Dtype of the main (accumulated, reduced) gradients."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each dtype."""

PARAM_BYTES: dict[str, int] = {p: DTYPE_BYTES[PARAM_DTYPE[p]] for p in PRECISIONS}
"""Weight bytes per parameter."""

GRAD_BYTES: dict[str, int] = {p: DTYPE_BYTES[GRAD_DTYPE[p]] for p in PRECISIONS}
"""Main-grad bytes per parameter."""

OPTIMIZER_BYTES: dict[str, int] = {p: 8 + (4 if PARAM_DTYPE[p] != "float32" else 0) for p in PRECISIONS}
"""Optimizer-state bytes per parameter before ZeRO sharding: Adam's m and v in fp32, plus the fp32 master."""


def check_precision(precision: str) -> None:
    """ValueError naming the fix when `precision` is not one the engine trains in."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r}; use {', '.join(PRECISIONS)}")


def torch_dtype(dtype_name: str):
    """The torch dtype of a name of PARAM_DTYPE / GRAD_DTYPE ("float32", "bfloat16", "float16")."""
    import torch  # here, not at the top: the launcher imports this module and never torch

    return getattr(torch, dtype_name)


def param_dtype(precision: str):
    """Torch dtype of the weights at `precision`."""
    check_precision(precision)
    return torch_dtype(PARAM_DTYPE[precision])


def grad_dtype(precision: str):
    """Torch dtype of the main grads at `precision`."""
    check_precision(precision)
    return torch_dtype(GRAD_DTYPE[precision])


OFFLOAD_BLOCK_ELEMS = 1 << 18
"""Elements per block of the offloaded optimizer step (parallel.offload=nvme reads and writes the state in
blocks of this size; the planner counts one fp32 buffer of it per state tensor as the rank's host bytes)."""

PARAM_GATHER_INFLIGHT_BYTES = 64 << 20
"""Bound of the zero=1/2 all-gather of the updated shards (training/optim/param_gather.py): the chunks in
flight at once, their receive buffers and send copies together, stay within this many bytes, instead of a
second copy of every weight while the next forward waits for them. The planner counts it
(launcher/plan/memory.py param_gather_bytes). 64 MiB: about one bucket of Megatron-LM's overlapped parameter
gather (which gathers in place and holds nothing extra); how much of the gather it hides on a GPU is unmeasured."""


def param_gather_chunk_elems(precision: str, bucket_mb: float, dp: int) -> int:
    """Elements of one rank's piece of each chunk of that all-gather: the grad bucket (parallel.bucket_mb of
    main grads) split over dp, as the optimizer builds it."""
    return max(1, max(1, int(bucket_mb * 2**20) // DTYPE_BYTES[GRAD_DTYPE[precision]]) // dp)


def param_gather_inflight_chunks(precision: str, bucket_mb: float, dp: int) -> int:
    """Chunks of that all-gather in flight at once: each holds dp + 1 pieces (the gathered chunk and this
    rank's send copy) of the weights' dtype; at least one."""
    chunk = (dp + 1) * param_gather_chunk_elems(precision, bucket_mb, dp) * PARAM_BYTES[precision]
    return max(1, PARAM_GATHER_INFLIGHT_BYTES // chunk)
