"""Where train.precision=fp8 can run: the rules the launcher's validation and the engine both check (no torch).

FP8 matmuls (training/parallel/fp8.py) need both dims of every FP8 weight, as this rank holds it (after the tp
split), to be multiples of 16, torchao's float8 training installed, and, on a GPU, FP8 tensor cores (compute
capability 8.9 or newer: Ada, Hopper, Blackwell; the engine checks the GPU it runs on, the launcher the
cluster's `fp8_supported`, set false by the A100 presets). parallel.fp8_all_gather needs fp8, zero=3 and the
tensorwise recipe.
"""

from __future__ import annotations

import importlib.util

from training.contract.config import Config
from training.contract.layout_rules import Violation, padded_vocab

FP8_RECIPES = ("tensorwise", "rowwise")
"""train.fp8_recipe values (torchao's recipe names)."""

FP8_KINDS = ("qkv", "proj", "fc1", "fc2", "experts", "embedding", "output")
"""Module kinds train.fp8_skip may name; the embedding is a lookup (no matmul), never FP8 whatever it says."""

FP8_DIM_MULTIPLE = 16
"""Both dims of an FP8 weight must be multiples of this (torch._scaled_mm's requirement on its operands)."""

FP8_INSTALL = "pip install 'torchao==0.18.*' (or pip install 'meshrun[fp8]')"
"""The install line of the error when torchao is missing."""

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada Lovelace; Hopper is 9.0)."""


def fp8_local_shapes(cfg: Config) -> dict[str, list[tuple[int, int]]]:
    """The local weight shapes [out, in] of each FP8-capable kind at cfg's tp (experts: fc1 and fc2)."""
    m, tp = cfg.model, cfg.parallel.tp
    h, a, g = m.hidden_size, m.num_attention_heads, m.query_groups
    d = h // a if a else 0
    f1 = 2 * m.ffn if m.activation == "swiglu" else m.ffn
    shapes = {
        "qkv": [((a + 2 * g) * d // tp, h)],
        "proj": [(h, a * d // tp)],
        "fc1": [(f1 // tp, h)],
        "fc2": [(h, m.ffn // tp)],
        "output": [(padded_vocab(m.vocab_size, tp) // tp, h)],
    }
    if m.num_experts > 0:
        fe = m.moe_ffn_hidden_size or m.ffn
        fe1 = 2 * fe if m.activation == "swiglu" else fe
        shapes["experts"] = [(fe1 // tp, h), (h, fe // tp)]
        del shapes["fc1"], shapes["fc2"]  # an MoE model's MLPs are its experts
    return shapes


def fp8_kinds(cfg: Config) -> list[str]:
    """The kinds whose matmuls run in FP8 (none unless train.precision=fp8)."""
    if str(cfg.train.precision) != "fp8":
        return []
    skip = {str(k) for k in cfg.train.fp8_skip}
    return [k for k in fp8_local_shapes(cfg) if k not in skip]


def torchao_installed() -> bool:
    """Whether torchao can be imported (looked up, not imported: the launcher imports no torch)."""
    return importlib.util.find_spec("torchao") is not None


def fp8_rules(cfg: Config) -> list[Violation]:
    """The errors of train.precision=fp8 (and of its keys set without it), each naming the fix."""
    t, par = cfg.train, cfg.parallel
    out: list[Violation] = []
    if getattr(par, "fp8_all_gather", False):
        needs = []
        if str(t.precision) != "fp8":
            needs.append(("train.precision=fp8", f"train.precision={t.precision} runs no float8 matmul"))
        if int(par.zero) != 3:
            needs.append(("parallel.zero=3", f"parallel.zero={par.zero} gathers no weights (zero=3 does)"))
        if str(t.precision) == "fp8" and str(t.fp8_recipe) != "tensorwise":
            needs.append(
                (
                    "train.fp8_recipe=tensorwise",
                    f"train.fp8_recipe={t.fp8_recipe} scales the weight per row, differently in forward and backward",
                )
            )
        for fix, why in needs:
            out.append(
                Violation(
                    "error",
                    "parallel.fp8_all_gather",
                    f"the float8 all-gather of zero=3 weights needs train.precision=fp8, parallel.zero=3 and "
                    f"train.fp8_recipe=tensorwise: {why}",
                    f"{fix} (or parallel.fp8_all_gather=false)",
                    "fp8",
                )
            )
    if str(t.precision) != "fp8":
        return out
    cluster = cfg.cluster
    if str(cluster.device) == "cuda" and getattr(cluster, "fp8_supported", None) is False:
        out.append(
            Violation(
                "error",
                "train.precision",
                f"cluster {cluster.name}'s GPUs have no FP8 tensor cores (cluster.fp8_supported=false; FP8 needs "
                f"compute capability 8.9 or newer: L4/L40, H100/H200, B200)",
                "train.precision=bf16 (or a cluster whose GPUs have FP8, e.g. cluster=dgx_h100)",
                "fp8",
            )
        )
    if str(t.fp8_recipe) not in FP8_RECIPES:
        out.append(
            Violation(
                "error",
                "train.fp8_recipe",
                f"{t.fp8_recipe!r} is no recipe",
                "train.fp8_recipe=tensorwise or rowwise",
                "fp8",
            )
        )
    unknown = [str(k) for k in t.fp8_skip if str(k) not in FP8_KINDS]
    if unknown:
        out.append(
            Violation(
                "error", "train.fp8_skip", f"unknown module kinds {unknown}", f"name kinds of {list(FP8_KINDS)}", "fp8"
            )
        )
    shapes = fp8_local_shapes(cfg)
    for kind in fp8_kinds(cfg):
        bad = [s for s in shapes[kind] if s[0] % FP8_DIM_MULTIPLE or s[1] % FP8_DIM_MULTIPLE]
        if bad:
            out.append(
                Violation(
                    "error",
                    "train.fp8_skip",
                    f"the {kind} weight is {bad[0][0]} x {bad[0][1]} per rank at tp={par.tp}; FP8 matmuls need both "
                    f"dims multiples of {FP8_DIM_MULTIPLE}",
                    f"model sizes whose per-rank widths are multiples of {FP8_DIM_MULTIPLE}, or "
                    f"train.fp8_skip=[{','.join([*map(str, t.fp8_skip), kind])}]",
                    "fp8",
                )
            )
    if not torchao_installed():
        out.append(
            Violation(
                "error", "train.precision", "fp8 needs torchao's float8 training, not installed", FP8_INSTALL, "fp8"
            )
        )
    return out
