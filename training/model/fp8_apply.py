"""train.precision=fp8: give the model's linears their FP8 matmul (training/parallel/fp8.py).

The kinds of training/contract/fp8_rules.py map onto modules here: qkv and proj of each attention, fc1 and fc2
of each dense MLP, every expert's fc1 and fc2 (kind `experts`), and the head (`output`, the tied embedding's
weight too). Kinds in train.fp8_skip keep F.linear; the rules run first, so a width FP8 cannot take is an error
naming the fix before any step.
"""

from __future__ import annotations

from typing import Any

import torch

from training.contract.fp8_rules import FP8_MIN_CAPABILITY, fp8_kinds, fp8_rules
from training.contract.layout_rules import raise_errors


def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        return  # torch's CPU build runs torch._scaled_mm on float8 tensors (slowly: a numerics check, not a speed-up)
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"train.precision=fp8: {torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) has no "
            f"FP8 tensor cores (8.9 or newer: L4/L40, H100/H200, B200); use train.precision=bf16"
        )


def apply_fp8(chunks: list[Any], cfg: Any) -> list[str]:
    """Set the FP8 matmul on the linears of `chunks` when cfg.train.precision is fp8; returns the kinds set."""
    kinds = fp8_kinds(cfg)
    if not kinds:
        return []
    raise_errors(fp8_rules(cfg))
    from training.parallel.fp8 import fp8_linear_for

    matmul = fp8_linear_for(str(cfg.train.fp8_recipe)).linear
    for chunk in chunks:
        _check_device(next(chunk.parameters()).device)
        for layer in chunk.layers.values():
            if "qkv" in kinds:
                layer.attn.qkv.matmul = matmul
                _mark(layer.attn.qkv.weight)
            if "proj" in kinds:
                layer.attn.proj.matmul = matmul
                _mark(layer.attn.proj.weight)
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                if "experts" in kinds:
                    for expert in experts.values():
                        expert.matmul = matmul
                        _mark(expert.fc1.weight, expert.fc2.weight)
            else:
                if "fc1" in kinds:
                    layer.mlp.fc1.matmul = matmul
                    _mark(layer.mlp.fc1.weight)
                if "fc2" in kinds:
                    layer.mlp.fc2.matmul = matmul
                    _mark(layer.mlp.fc2.weight)
        if chunk.has_head and "output" in kinds:
            chunk.output_matmul = matmul
            if getattr(chunk, "output", None) is not None:  # a tied head's weight is the embedding's lookup table too
                _mark(chunk.output.weight)
    return kinds


def _mark(*weights: torch.Tensor) -> None:
    """`fp8_weight`: read only by an FP8 matmul, so zero=3 may gather it in float8 (parallel.fp8_all_gather)."""
    for w in weights:
        w.fp8_weight = True  # type: ignore[attr-defined]
