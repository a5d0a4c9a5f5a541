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
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.contract.fp8_rules import FP8_DIM_MULTIPLE, FP8_INSTALL, FP8_RECIPES


def torchao_missing() -> Optional[str]:
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

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x @ weight^T (+ bias) with float8 operands; x [..., in], weight [out, in] in bf16.

        The rows (tokens) are zero-padded to a multiple of 16 when they are not (an expert's share of a batch):
        torch._scaled_mm on a GPU needs every dim so, and zero rows change no amax, hence no scale, and add
        nothing to the weight's grad, so the result is the unpadded one's."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        rows = x.numel() // x.shape[-1]
        pad = (-rows) % FP8_DIM_MULTIPLE if rows else FP8_DIM_MULTIPLE
        if pad:
            flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))
            out = matmul_with_hp_or_float8_args.apply(flat, weight.t(), self.mm_config, self.config)
            out = out[:rows].reshape(*x.shape[:-1], weight.shape[0])
        else:
            out = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return out + bias.to(out.dtype) if bias is not None else out


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
