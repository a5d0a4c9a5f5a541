"""FP8 matmuls of the linear layers (train.precision=fp8) through torchao's float8 training.

meshrun's column- and row-parallel linears, its fused QKV and the experts keep their own parameters, sharding
and collectives; only the matmul `x @ W^T` becomes torchao's float8 one: `matmul_with_hp_or_float8_args`, the
autograd function torchao's own Float8Linear calls, with the Float8LinearConfig of the chosen recipe
(`Float8LinearConfig.from_recipe_name`) and the LinearMMConfig that `convert_to_float8_training` gives a
Float8Linear of that config (so the scaled-mm settings are torchao's, not a copy). Scaling is dynamic: each
cast's scale comes from the amax of the tensor being cast (per tensor, or per row with rowwise), so a
recomputed forward (parallel.recompute) casts the same values with the same scales and is bit-identical.

Forward casts the input and the weight to float8, backward the output grad (in the recipe's float8 dtypes) and
recasts the saved high-precision input and weight for the two grad matmuls. torchao saves the bf16 input and
weight, never a float8 copy: the linear saves what its bf16 F.linear saves, except where the input is a new tensor
(under SP the gathered sequence, layers.py column_parallel_linear; rows padded below). What FP8 adds beyond that
are the transient float8 copies of one linear's operands and their scales. The planner counts both
(launcher/plan/fp8.py: the activations' extra, memory_bytes.fp8_cache).

`matmul_with_hp_or_float8_args` is torchao's module-level function (no underscore, not in torchao.float8's
__all__); the public entry point, the Float8Linear module swap, replaces nn.Linear modules, which meshrun's
sharded linears are not.

torchao is optional (`pip install 'meshrun[fp8]'`); this module imports it only when an FP8 model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.contract.fp8_rules import FP8_DIM_MULTIPLE, FP8_INSTALL, FP8_RECIPES


def torchao_missing() -> str | None:
    """None when torchao's float8 training imports, else the error naming the install line."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"train.precision=fp8 needs torchao's float8 training ({e}); install it: {FP8_INSTALL}"
    return None


@dataclass(frozen=True)
class Fp8Linear:
    """The float8 settings one linear's matmul runs with: torchao's config and scaled-mm config."""

    config: Any
    """torchao.float8.Float8LinearConfig of the recipe."""
    mm_config: Any
    """torchao.float8.LinearMMConfig a Float8Linear of that config uses."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias) with float8 operands; x [..., in], weight [out, in] in bf16.

        The rows (tokens) are zero-padded to a multiple of 16 when they are not (an expert's share of a batch):
        torch._scaled_mm on a GPU needs every dim so, and zero rows change no amax, hence no scale, and add
        nothing to the weight's grad, so the result is the unpadded one's."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        gathered = getattr(weight, "fp8_gathered", None)  # parallel.fp8_all_gather: zero3.py's float8 weight
        source = gathered() if gathered is not None else None
        if source is not None:
            weight = _GatheredWeight.apply(weight, source[0], source[1], self.mm_config)
        rows = x.numel() // x.shape[-1]
        pad = (-rows) % FP8_DIM_MULTIPLE if rows else FP8_DIM_MULTIPLE
        if pad:
            flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))
            out = matmul_with_hp_or_float8_args.apply(flat, weight.t(), self.mm_config, self.config)
            out = out[:rows].reshape(*x.shape[:-1], weight.shape[0])
        else:
            out = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return out + bias.to(out.dtype) if bias is not None else out


class _GatheredWeight(torch.autograd.Function):
    """The float8 weight zero=3 gathered (parallel.fp8_all_gather) as torchao's matmul takes an already cast
    operand: a Float8TrainingTensor of role WEIGHT (what torchao's FSDP2 float8 all-gather hands its Float8Linear,
    fsdp_utils.py's fsdp_post_all_gather), so the matmul skips its own cast of the weight in forward and in
    backward (the tensorwise recipe casts the weight for the input grad with the same dtype and scale). The grad
    passes through to the bf16 parameter, whose storage stays empty."""

    @staticmethod
    def forward(ctx, weight, data, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, weight.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fp8_weight_dtype() -> torch.dtype:
    """The float8 dtype the tensorwise recipe casts weights to (torchao's config: float8_e4m3fn)."""
    return fp8_linear_for("tensorwise").config.cast_config_weight.target_dtype


def fp8_weight_scales(amax: torch.Tensor) -> torch.Tensor:
    """The tensorwise scales of weights whose amaxes (over every shard) are `amax`: torchao's amax_to_scale, as
    precompute_float8_dynamic_scale_for_fsdp computes them after the optimizer step (fp32)."""
    from torchao.float8.float8_utils import amax_to_scale

    config = fp8_linear_for("tensorwise").config
    return amax_to_scale(amax, fp8_weight_dtype(), config.round_scales_to_power_of_2)


def fp8_cast_weight(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`values` (part of a weight, model dtype) in float8 at the weight's scale: torchao's
    hp_tensor_and_scale_to_float8 (fsdp_pre_all_gather's cast), its bytes. Elementwise, so a shard's part cast
    alone gives the bytes of the whole weight cast."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    linear = fp8_linear_for("tensorwise")
    cast = hp_tensor_and_scale_to_float8(values, scale, fp8_weight_dtype(), linear.mm_config, GemmInputRole.WEIGHT)
    return cast._data


_CACHE: dict = {}


def fp8_linear_for(recipe: str) -> Fp8Linear:
    """The Fp8Linear of a recipe (built once per process)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe={recipe!r}; use {' or '.join(FP8_RECIPES)}")
    if recipe not in _CACHE:
        error = torchao_missing()
        if error:
            raise ImportError(error)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        n = FP8_DIM_MULTIPLE
        probe = nn.Sequential(nn.Linear(n, n, bias=False, device="meta"))
        probe = convert_to_float8_training(probe, config=config)
        _CACHE[recipe] = Fp8Linear(config, probe[0].linear_mm_config)
    return _CACHE[recipe]
