"""What train.precision=fp8 changes in the plan (pure Python): FP8 memory, the linears' FLOPs at the FP8 peak.

Memory (training/parallel/fp8.py is what it counts): torchao's float8 matmul saves its bf16 input and weight for
backward, never a float8 copy, and its scaling is dynamic (each scale from the amax of the tensor being cast, no
amax history), so FP8 holds no state between steps. What it adds:
- `fp8_cache`: the float8 copies of one linear's operands while its matmuls run (they are freed after them; one
  linear at a time): in backward the output grad cast twice (for the input grad and for the weight grad), the
  weight and the input cast again, 1 byte per element, plus their fp32 scales (one per tensor, or one per row
  with rowwise). The largest FP8 linear of the model sets it.
- saved for backward (`saved_bytes_per_layer`, added to the activations of every layer that keeps them): under
  sequence parallelism the FP8 column-parallel linears (qkv, fc1) save the gathered input, tp times the shard the
  bf16 path keeps (training/parallel/layers.py column_parallel_linear); FP8 experts save a padded copy of their
  input.
FLOPs: the FP8 linears' GEMMs run at cluster.peak_tflops_fp8 / cluster.peak_tflops times the bf16 rate (attention,
the router and the skipped kinds at the bf16 rate); MFU is reported against both peaks.
parallel.fp8_all_gather (zero=3): the FP8 weights are gathered at 1 byte an element (`fp8_gathered_elements`):
levers.py counts the gathered units and the gather traffic with it.
"""

from __future__ import annotations

from training.contract.config import Config
from training.contract.fp8_rules import fp8_kinds, fp8_local_shapes


def _tokens(cfg: Config) -> int:
    """Tokens of one micro-batch on one rank (the rows of a linear's input without SP)."""
    return cfg.parallel.micro_batch * cfg.model.seq_length // max(1, cfg.parallel.cp)


def fp8_cache_bytes(cfg: Config) -> int:
    """memory_bytes.fp8_cache: the transient float8 operands of the largest FP8 linear (0 unless fp8)."""
    kinds = fp8_kinds(cfg)
    if not kinds:
        return 0
    rowwise = str(cfg.train.fp8_recipe) == "rowwise"
    worst = 0
    for kind, shapes in fp8_local_shapes(cfg).items():
        if kind not in kinds:
            continue
        for out_f, in_f in shapes:
            rows = _tokens(cfg)  # under SP too: the matmuls see the whole sequence
            if kind == "experts":  # balanced routing: top_k of num_experts' tokens per expert
                rows = -(-rows * cfg.model.moe_top_k // max(1, cfg.model.num_experts))
            rows += -rows % 16  # padded to a multiple of 16 (Fp8Linear.linear)
            elems = 2 * rows * out_f + out_f * in_f + rows * in_f
            scales = (2 * rows + out_f + rows + in_f if rowwise else 4) * 4
            worst = max(worst, elems + scales)
    return worst


def saved_bytes_per_layer(cfg: Config) -> int:
    """Extra bytes one layer saves for backward in fp8 over bf16 (0 unless fp8):
    - under SP with FP8 qkv / fc1: the gathered input instead of the shard, (1 - 1/tp) x s b h at 16 bits each;
    - FP8 experts: each expert's fc1 input is a zero-padded copy (rows to a multiple of 16, Fp8Linear.linear) where
      bf16 saves a view of the dispatched tokens: top_k x s b h at 16 bits over the rank's experts (balanced
      routing), the padding rows left out."""
    par, m = cfg.parallel, cfg.model
    kinds = fp8_kinds(cfg)
    rows = _tokens(cfg)
    extra = 0
    if par.sp and par.tp > 1:
        extra += sum(1 for k in ("qkv", "fc1") if k in kinds) * 2 * (rows - rows // par.tp) * m.hidden_size
    if "experts" in kinds:
        extra += 2 * rows * m.moe_top_k * m.hidden_size
    return extra


def fp8_weight_share(cfg: Config) -> float:
    """The share of a layer's weight-GEMM FLOPs that run in FP8 (0 unless fp8)."""
    kinds = fp8_kinds(cfg)
    if not kinds:
        return 0.0
    m = cfg.model
    flops: dict[str, float] = {}
    for kind, shapes in fp8_local_shapes(cfg).items():
        if kind == "output":
            continue
        per = sum(o * i for o, i in shapes)
        flops[kind] = per * (m.moe_top_k if kind == "experts" else 1)
    router = m.num_experts * m.hidden_size if m.num_experts > 0 else 0
    total = sum(flops.values()) + router
    return sum(v for k, v in flops.items() if k in kinds) / total if total else 0.0


def fp8_rate_ratio(cfg: Config) -> float:
    """cluster.peak_tflops_fp8 / cluster.peak_tflops: how much faster an FP8 GEMM runs (1 when either is unknown
    or the run is not fp8)."""
    c = cfg.cluster
    if str(cfg.train.precision) != "fp8" or c.peak_tflops <= 0 or getattr(c, "peak_tflops_fp8", 0.0) <= 0:
        return 1.0
    return c.peak_tflops_fp8 / c.peak_tflops


def weight_gemm_seconds(cfg: Config, weight_flops: float, rate: float) -> float:
    """Seconds of a layer's weight GEMMs at the bf16 `rate`, the FP8 share at rate x fp8_rate_ratio."""
    share, ratio = fp8_weight_share(cfg), fp8_rate_ratio(cfg)
    return weight_flops * ((1.0 - share) + share / ratio) / rate


def logits_rate(cfg: Config, rate: float) -> float:
    """The output layer's GEMM rate: the FP8 one when `output` is not in train.fp8_skip."""
    return rate * fp8_rate_ratio(cfg) if "output" in fp8_kinds(cfg) else rate


def fp8_gathered_elements(cfg: Config) -> dict[str, int]:
    """Elements of the FP8 weights, as a rank holds them, that parallel.fp8_all_gather gathers in float8 (1 byte
    each instead of 2; training/optim/zero3.py): `layer` (one layer's qkv, proj, fc1, fc2, the kinds not
    skipped), `experts` (one layer's E/ep experts' fc1 and fc2), `head` (the untied output layer when not
    skipped; a tied head is the embedding's lookup table and stays bf16). All 0 without the flag, fp8 or zero=3."""
    par = cfg.parallel
    out = {"layer": 0, "experts": 0, "head": 0}
    if not getattr(par, "fp8_all_gather", False) or int(par.zero) != 3:
        return out
    kinds, shapes = fp8_kinds(cfg), fp8_local_shapes(cfg)
    experts = cfg.model.num_experts // max(1, par.ep)
    for kind in kinds:
        per = sum(o * i for o, i in shapes[kind])
        if kind == "output":
            out["head"] = 0 if cfg.model.tie_embeddings else per
        elif kind == "experts":
            out["experts"] = per * experts
        elif kind != "embedding":
            out["layer"] += per
    return out
