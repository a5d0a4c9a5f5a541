"""A Hugging Face config.json and meshrun's ModelConfig, both ways, for the two families meshrun can express.

- GPT-2 (GPT2LMHeadModel): LayerNorm with biases, GELU (exact or tanh), learned positions, multi-head attention.
- Llama (LlamaForCausalLM): RMSNorm, SwiGLU, rotary positions (rotate-half pairing, meshrun's own), grouped-query
  attention, biases off (or on in every linear: attention_bias = mlp_bias), tied or untied embeddings.
- Mixtral (MixtralForCausalLM): Llama's attention and norms, no biases, and a mixture of num_local_experts SwiGLU
  experts of width intermediate_size per layer, num_experts_per_tok of them per token (meshrun's model.num_experts,
  moe_top_k, moe_ffn_hidden_size; router_aux_loss_coef -> moe_aux_loss_coeff, overridable).

Pure Python (no torch): the launcher reads config.json with it before a launch (train.init_from), and the
export writes config.json with it. Anything either side cannot express is an HFError naming the field.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from training.contract.limits import too_large

GPT2 = "gpt2"
LLAMA = "llama"
MIXTRAL = "mixtral"
ARCHITECTURES = {"GPT2LMHeadModel": GPT2, "LlamaForCausalLM": LLAMA, "MixtralForCausalLM": MIXTRAL}
CLASS_OF = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM", MIXTRAL: "MixtralForCausalLM"}
CONFIG = "config.json"

# GPT-2's activation_function values: the exact erf GELU, or the tanh approximation (transformers' ACT2FN).
_GELU_EXACT = ("gelu",)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


class HFError(ValueError):
    """A Hugging Face directory or a model meshrun cannot convert; the message names the file or field and the fix."""


_REQUIRED = object()


def _whole(hf: dict[str, Any], key: str, path: str, default: Any = _REQUIRED) -> Any:
    """config.json's integer `key` (default when absent, if one is given); HFError naming the key when it is
    missing, not a number or not whole (4.5 layers is a broken file, not 4)."""
    value = hf.get(key, default)
    if value is _REQUIRED:
        raise HFError(f"{path}: config.json has no {key!r}: add it (transformers' save_pretrained writes it)")
    if value is None or value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value % 1:
        raise HFError(f"{path}: config.json's {key}={value!r} is not a whole number: fix it in config.json")
    return int(value)


def _real(hf: dict[str, Any], key: str, path: str, default: float) -> float:
    """config.json's number `key` (default when absent or null); HFError naming the key when it is not a number."""
    value = hf.get(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFError(f"{path}: config.json's {key}={value!r} is not a number: fix it in config.json")
    return float(value)


def read_hf_config(directory: str, key: str = "train.init_from") -> dict[str, Any]:
    """config.json of a Hugging Face model directory, with errors that name the file and the fix."""
    if not os.path.isdir(directory):
        raise HFError(
            f"{key}={directory}: no such directory; point {key} at a Hugging Face model directory "
            f"(the one save_pretrained wrote: config.json and *.safetensors)"
        )
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise HFError(
            f"{path} does not exist: {key} needs a Hugging Face model directory with config.json next to "
            f"its *.safetensors (save the model with save_pretrained, or download config.json too)"
        )
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise HFError(f"{path} cannot be read as JSON ({exc}); download it again or re-save the model") from exc
    if not isinstance(data, dict):
        raise HFError(f"{path} is not a JSON object; download it again or re-save the model")
    return data


def family_of(hf: dict[str, Any], path: str) -> str:
    """gpt2 or llama from config.json's architectures (or model_type when architectures is absent)."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
        what = f"architectures={archs}"
    else:
        mt = hf.get("model_type")
        if mt in (GPT2, LLAMA, MIXTRAL):
            return mt
        what = f"model_type={mt!r}"
    raise HFError(
        f"{path}: {what} is not supported; meshrun imports and exports only GPT2LMHeadModel "
        f"(model_type gpt2), LlamaForCausalLM (model_type llama) and MixtralForCausalLM (model_type "
        f"mixtral): use a model of one of those classes"
    )


def _rope_theta(hf: dict[str, Any], path: str) -> float:
    """The rotary base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (before); no scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = (params.get("rope_type") or params.get("type") or "default") if isinstance(params, dict) else "default"
    if scaling or kind != "default":
        raise HFError(
            f"{path}: rope scaling ({'rope_scaling' if scaling else 'rope_parameters.rope_type'}="
            f"{scaling or kind!r}) is not supported: meshrun's rotary embedding has only a base (theta); "
            f"use a model without rope scaling"
        )
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        return _real(hf, "rope_theta", path, 10000.0)
    return _real({"rope_parameters.rope_theta": theta}, "rope_parameters.rope_theta", path, 10000.0)


def model_fields_from_hf(hf: dict[str, Any], path: str) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    """(family, ModelConfig fields config.json decides, fields an override may still change); HFError for a field
    of the wrong type or a size beyond training/contract/limits.py's bounds (checked before any shape is built)."""
    family, fields, free = _model_fields(hf, path)
    for key, value in fields.items():
        problem = too_large(f"model.{key}", value)
        if problem:
            raise HFError(f"{path}: config.json gives model.{key}, which {problem}: fix config.json")
    return family, fields, free


def _model_fields(hf: dict[str, Any], path: str) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    """(family, ModelConfig fields config.json decides, fields an override may still change).

    Model fields not returned (dropout, attention kernel, init_std, name) stay as configured: they change no
    weight. For rotary models seq_length is only a default (max_position_embeddings): it shapes no weight.
    """
    family = family_of(hf, path)

    def need(key: str, ok: bool, fix: str) -> None:
        if not ok:
            raise HFError(f"{path}: {key}={hf.get(key)!r} is not supported by meshrun's model; {fix}")

    if family == GPT2:
        need("scale_attn_weights", hf.get("scale_attn_weights", True) is True, "meshrun scales scores by 1/sqrt(d)")
        need(
            "scale_attn_by_inverse_layer_idx",
            not hf.get("scale_attn_by_inverse_layer_idx", False),
            "meshrun does not scale attention by the layer index",
        )
        need("add_cross_attention", not hf.get("add_cross_attention", False), "meshrun is a decoder only")
        act = hf.get("activation_function", "gelu_new")
        need(
            "activation_function", act in _GELU_EXACT + _GELU_TANH, f"use one of {', '.join(_GELU_EXACT + _GELU_TANH)}"
        )
        h, heads = _whole(hf, "n_embd", path), _whole(hf, "n_head", path)
        fields = {
            "num_layers": _whole(hf, "n_layer", path),
            "hidden_size": h,
            "num_attention_heads": heads,
            "num_query_groups": None,
            "ffn_hidden_size": (_whole(hf, "n_inner", path, None) or 4 * h),
            "seq_length": _whole(hf, "n_positions", path),
            "vocab_size": _whole(hf, "vocab_size", path),
            "norm": "layernorm",
            "activation": "gelu",
            "gelu_tanh": act in _GELU_TANH,
            "position": "learned",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "bias": True,
            "norm_eps": _real(hf, "layer_norm_epsilon", path, 1e-5),
        }
        return family, fields, ()
    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "meshrun's swiglu gates with SiLU")
    if family == MIXTRAL:
        return family, *_mixtral_fields(hf, path, need)
    need(
        "mlp_bias",
        bool(hf.get("mlp_bias", False)) == bool(hf.get("attention_bias", False)),
        "meshrun has biases in every linear layer or in none: attention_bias and mlp_bias must agree",
    )
    h, heads = _whole(hf, "hidden_size", path), _whole(hf, "num_attention_heads", path)
    need(
        "head_dim",
        hf.get("head_dim") in (None, h // heads) and h % heads == 0,
        f"meshrun's head size is hidden_size / num_attention_heads = {h}/{heads}",
    )
    fields = {
        "num_layers": _whole(hf, "num_hidden_layers", path),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_query_groups": (_whole(hf, "num_key_value_heads", path, None) or heads),
        "ffn_hidden_size": _whole(hf, "intermediate_size", path),
        "seq_length": _whole(hf, "max_position_embeddings", path, 2048),
        "vocab_size": _whole(hf, "vocab_size", path),
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "bias": bool(hf.get("attention_bias", False)),
        "norm_eps": _real(hf, "rms_norm_eps", path, 1e-6),
        "rope_base": _rope_theta(hf, path),
    }
    return family, fields, ("seq_length",)


def _mixtral_fields(hf: dict[str, Any], path: str, need) -> tuple[dict[str, Any], tuple[str, ...]]:
    """MixtralForCausalLM's fields: Llama's attention and norms without biases, the experts' shape; the aux-loss
    weight and the capacity factor change no weight and stay overridable."""
    h, heads = _whole(hf, "hidden_size", path), _whole(hf, "num_attention_heads", path)
    seq = _whole(hf, "max_position_embeddings", path, 4096)
    need(
        "head_dim",
        hf.get("head_dim") in (None, h // heads) and h % heads == 0,
        f"meshrun's head size is hidden_size / num_attention_heads = {h}/{heads}",
    )
    window = hf.get("sliding_window")
    need(
        "sliding_window",
        window is None or _whole(hf, "sliding_window", path) >= seq,
        "meshrun's attention is full causal attention: use a model without a sliding window (sliding_window null)",
    )
    ffn = _whole(hf, "intermediate_size", path)
    fields = {
        "num_layers": _whole(hf, "num_hidden_layers", path),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_query_groups": (_whole(hf, "num_key_value_heads", path, None) or heads),
        "ffn_hidden_size": ffn,
        "seq_length": seq,
        "vocab_size": _whole(hf, "vocab_size", path),
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "bias": False,
        "norm_eps": _real(hf, "rms_norm_eps", path, 1e-5),
        "rope_base": _rope_theta(hf, path),
        "num_experts": _whole(hf, "num_local_experts", path, 8),
        "moe_top_k": _whole(hf, "num_experts_per_tok", path, 2),
        "moe_ffn_hidden_size": ffn,
        "moe_aux_loss_coeff": _real(hf, "router_aux_loss_coef", path, 0.001),
        "moe_capacity_factor": 0.0,
    }
    return fields, ("seq_length", "moe_aux_loss_coeff", "moe_capacity_factor")


def effective(field: str, fields: dict[str, Any]) -> Any:
    """A field's meaning rather than its spelling: num_query_groups None is one group per head, ffn None is 4h."""
    value = fields.get(field)
    if field == "num_query_groups" and value is None:
        return fields.get("num_attention_heads")
    if field == "ffn_hidden_size" and value is None:
        return 4 * fields.get("hidden_size", 0)
    if field == "moe_ffn_hidden_size" and value is None:
        return effective("ffn_hidden_size", fields)
    if hasattr(value, "value"):  # a choice Enum member
        return value.value
    return value


def family_for_model(mc) -> str:
    """The Hugging Face family of a meshrun ModelConfig, or an HFError naming each field that stands in the way."""
    pos, norm, act, bias = str(mc.position), str(mc.norm), str(mc.activation), bool(mc.bias)
    groups = mc.num_query_groups or mc.num_attention_heads
    if getattr(mc, "num_experts", 0) > 0:  # a mixture of experts: Mixtral's shape or nothing
        wrong = [
            f"model.{k}={v} (MixtralForCausalLM needs {need})"
            for k, v, need, ok in (
                ("position", pos, "rope", pos == "rope"),
                ("norm", norm, "rmsnorm", norm == "rmsnorm"),
                ("activation", act, "swiglu", act == "swiglu"),
                ("bias", bias, "false", not bias),
            )
            if not ok
        ]
        if wrong:
            raise HFError(
                f"this mixture of experts has no Hugging Face class meshrun exports to: {'; '.join(wrong)}. "
                "MixtralForCausalLM: rope, rmsnorm, swiglu experts, no biases"
            )
        return MIXTRAL
    if pos == "learned":
        wrong = [
            f"model.{k}={v} (GPT2LMHeadModel needs {need})"
            for k, v, need, ok in (
                ("norm", norm, "layernorm", norm == "layernorm"),
                ("activation", act, "gelu", act == "gelu"),
                ("bias", bias, "true", bias),
                ("num_query_groups", groups, "one group per head", groups == mc.num_attention_heads),
            )
            if not ok
        ]
        family = GPT2
    else:
        wrong = [
            f"model.{k}={v} (LlamaForCausalLM needs {need})"
            for k, v, need, ok in (
                ("norm", norm, "rmsnorm", norm == "rmsnorm"),
                ("activation", act, "swiglu", act == "swiglu"),
            )
            if not ok
        ]
        family = LLAMA
    if wrong:
        raise HFError(
            f"this model (model.position={pos}) has no Hugging Face class meshrun exports to: "
            f"{'; '.join(wrong)}. GPT-2 style: learned positions, layernorm, gelu, biases; Llama style: "
            f"rope, rmsnorm, swiglu"
        )
    return family


def hf_config_from_model(mc, family: str, dtype: str, token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for a meshrun ModelConfig of `family` (dtype: float32 | bfloat16 | float16)."""
    h, heads = mc.hidden_size, mc.num_attention_heads
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    ids.update(token_ids or {})
    if family == GPT2:
        cfg = {
            "architectures": [CLASS_OF[GPT2]],
            "model_type": GPT2,
            "n_layer": mc.num_layers,
            "n_embd": h,
            "n_head": heads,
            "n_inner": mc.ffn,
            "n_positions": mc.seq_length,
            "vocab_size": mc.vocab_size,
            "activation_function": "gelu_new" if mc.gelu_tanh else "gelu",
            "layer_norm_epsilon": mc.norm_eps,
            "resid_pdrop": mc.dropout,
            "embd_pdrop": 0.0,
            "attn_pdrop": mc.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
            "tie_word_embeddings": bool(mc.tie_embeddings),
        }
    else:
        cfg = {
            "architectures": [CLASS_OF[LLAMA]],
            "model_type": LLAMA,
            "num_hidden_layers": mc.num_layers,
            "hidden_size": h,
            "num_attention_heads": heads,
            "num_key_value_heads": mc.num_query_groups or heads,
            "head_dim": h // heads,
            "intermediate_size": mc.ffn,
            "max_position_embeddings": mc.seq_length,
            "vocab_size": mc.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": mc.norm_eps,
            "attention_bias": bool(mc.bias),
            "mlp_bias": bool(mc.bias),
            "attention_dropout": mc.dropout,
            "tie_word_embeddings": bool(mc.tie_embeddings),
            # Both spellings: transformers 5 reads rope_parameters, earlier versions rope_theta.
            "rope_theta": mc.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_base},
        }
    if family == MIXTRAL:  # Llama's keys less the biases, with the experts
        for key in ("attention_bias", "mlp_bias"):
            cfg.pop(key)
        cfg.update(
            {
                "architectures": [CLASS_OF[MIXTRAL]],
                "model_type": MIXTRAL,
                "intermediate_size": mc.moe_ffn_hidden_size or mc.ffn,
                "num_local_experts": mc.num_experts,
                "num_experts_per_tok": mc.moe_top_k,
                "router_aux_loss_coef": mc.moe_aux_loss_coeff,
                "output_router_logits": False,
                "router_jitter_noise": 0.0,
                "sliding_window": None,
            }
        )
    cfg.update(ids)
    cfg.update({"initializer_range": mc.init_std, "use_cache": True, "dtype": dtype, "torch_dtype": dtype})
    return cfg


def conflicts(fields: dict[str, Any], free: tuple[str, ...], overrides: dict[str, Any]) -> list[str]:
    """Lines 'model.KEY=VALUE (config.json: X)' for each override that disagrees with config.json."""
    out = []
    for key, value in sorted(overrides.items()):
        if key not in fields or key in free:
            continue
        mine = effective(key, {**fields, **{key: value}})
        theirs = effective(key, fields)
        if mine != theirs:
            out.append(f"model.{key}={value} (config.json: {theirs})")
    return out
