"""The Hugging Face tensors of a meshrun model: names and shapes, per family (pure Python).

GPT2LMHeadModel keeps its weights under `transformer.` (checkpoints of the GPT2Model class have no prefix:
`hf_name` accepts both when reading); Conv1D stores [in, out], the transpose of a Linear. LlamaForCausalLM
keeps them under `model.`. A tied output layer has no tensor of its own (lm_head.weight is absent or ignored).
MixtralForCausalLM is Llama's layout with `block_sparse_moe.gate` (the router, [E, h]) and, per expert e,
`block_sparse_moe.experts.{e}.w1` (gate projection), `w3` (up), `w2` (down) in place of the MLP: the Hub's
checkpoint format, which every transformers version reads (recent ones fuse the experts in memory at load and
write this format back on save).
"""

from __future__ import annotations

from collections.abc import Iterable

from training.hf.hf_config import GPT2, MIXTRAL

PREFIX = {GPT2: "transformer.", "llama": "model.", MIXTRAL: "model."}


def expected_shapes(mc, family: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this model holds (prefixed names) -> its shape."""
    h, L, V = mc.hidden_size, mc.num_layers, mc.vocab_size
    a = mc.num_attention_heads
    d = h // a
    g = mc.num_query_groups or a
    f = mc.ffn
    out: dict[str, tuple[int, ...]] = {}
    if family == GPT2:
        p = PREFIX[GPT2]
        out[p + "wte.weight"] = (V, h)
        out[p + "wpe.weight"] = (mc.seq_length, h)
        for i in range(L):
            b = f"{p}h.{i}."
            out.update(
                {
                    b + "ln_1.weight": (h,),
                    b + "ln_1.bias": (h,),
                    b + "attn.c_attn.weight": (h, 3 * h),
                    b + "attn.c_attn.bias": (3 * h,),
                    b + "attn.c_proj.weight": (h, h),
                    b + "attn.c_proj.bias": (h,),
                    b + "ln_2.weight": (h,),
                    b + "ln_2.bias": (h,),
                    b + "mlp.c_fc.weight": (h, f),
                    b + "mlp.c_fc.bias": (f,),
                    b + "mlp.c_proj.weight": (f, h),
                    b + "mlp.c_proj.bias": (h,),
                }
            )
        out[p + "ln_f.weight"] = (h,)
        out[p + "ln_f.bias"] = (h,)
    else:
        p = PREFIX["llama"]
        out[p + "embed_tokens.weight"] = (V, h)
        for i in range(L):
            b = f"{p}layers.{i}."
            out.update(
                {
                    b + "input_layernorm.weight": (h,),
                    b + "post_attention_layernorm.weight": (h,),
                    b + "self_attn.q_proj.weight": (a * d, h),
                    b + "self_attn.k_proj.weight": (g * d, h),
                    b + "self_attn.v_proj.weight": (g * d, h),
                    b + "self_attn.o_proj.weight": (h, a * d),
                }
            )
            if family == MIXTRAL:
                out.update(_mixtral_moe_shapes(mc, b))
                continue
            out.update(
                {
                    b + "mlp.gate_proj.weight": (f, h),
                    b + "mlp.up_proj.weight": (f, h),
                    b + "mlp.down_proj.weight": (h, f),
                }
            )
            if mc.bias:
                out.update(
                    {
                        b + "self_attn.q_proj.bias": (a * d,),
                        b + "self_attn.k_proj.bias": (g * d,),
                        b + "self_attn.v_proj.bias": (g * d,),
                        b + "self_attn.o_proj.bias": (h,),
                        b + "mlp.gate_proj.bias": (f,),
                        b + "mlp.up_proj.bias": (f,),
                        b + "mlp.down_proj.bias": (h,),
                    }
                )
        out[p + "norm.weight"] = (h,)
    if not mc.tie_embeddings:
        out["lm_head.weight"] = (V, h)
    return out


def _mixtral_moe_shapes(mc, b: str) -> dict[str, tuple[int, ...]]:
    """One Mixtral layer's router and experts (names under the layer's prefix b)."""
    h, fe = mc.hidden_size, mc.moe_ffn_hidden_size or mc.ffn
    out: dict[str, tuple[int, ...]] = {b + "block_sparse_moe.gate.weight": (mc.num_experts, h)}
    for e in range(mc.num_experts):
        x = f"{b}block_sparse_moe.experts.{e}."
        out.update({x + "w1.weight": (fe, h), x + "w3.weight": (fe, h), x + "w2.weight": (h, fe)})
    return out


def hf_name(name: str, family: str, available: Iterable[str]) -> str | None:
    """The name under which a checkpoint holds `name` (expected_shapes' spelling), or None when it lacks it.

    Checkpoints of the base classes (GPT2Model, LlamaModel) store the same tensors without the prefix."""
    have = available if isinstance(available, (set, dict, frozenset)) else set(available)
    if name in have:
        return name
    p = PREFIX[family]
    if name.startswith(p) and name[len(p) :] in have:
        return name[len(p) :]
    return None
