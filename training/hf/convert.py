"""meshrun parameters <-> Hugging Face tensors, both ways (names and layouts).

meshrun's layouts (training/model/gpt.py): the fused qkv.weight [(a + 2g) d, h] holds, per query group j, the rows
[q heads of j, k_j, v_j]; under swiglu fc1.weight [2f, h] interleaves rows gate_0, up_0, gate_1, ... (each
expert's `mlp.experts.{e}.fc1.weight` too, e the global expert index; `mlp.router.weight` is Mixtral's gate); the
vocabulary dim of embedding.word.weight / output.weight is padded to a multiple of tp (the padding rows are
zero and never exported). Hugging Face: GPT-2's Conv1D stores [in, out] (the transpose) and c_attn is
[q | k | v] along out; Llama has separate q/k/v and gate/up projections. Rotary pairing is rotate-half on both
sides (training/model/gpt.py Rotary), so q and k rows need no permutation.

Export works on full tensors (one process). Import reads only this rank's slice of each Hugging Face tensor
(`read(name, rows, cols)` is safetensors' get_slice): a tp shard of a fused or interleaved meshrun tensor is
made of contiguous row or column ranges of the Hugging Face tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.hf.hf_config import GPT2, MIXTRAL
from training.hf.names import PREFIX

Reader = Callable[[str, slice | None, slice | None], torch.Tensor]
"""read(expected Hugging Face name, row slice or None, column slice or None) -> that part of the tensor."""


def _dims(mc):
    a = mc.num_attention_heads
    g = mc.num_query_groups or a
    return a, g, mc.hidden_size // a, a // g


# ---- export: full meshrun tensors -> Hugging Face tensors ----------------------------------------------
def to_hf(full: dict[str, torch.Tensor], mc, family: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (expected_shapes' names) from full, unpadded meshrun parameters."""
    a, g, d, qpg = _dims(mc)
    h, f, V = mc.hidden_size, mc.ffn, mc.vocab_size
    p = PREFIX[family]
    out: dict[str, torch.Tensor] = {}
    gpt2 = family == GPT2
    out[p + ("wte.weight" if gpt2 else "embed_tokens.weight")] = full["embedding.word.weight"][:V]
    if gpt2:
        out[p + "wpe.weight"] = full["embedding.position.weight"]
    for i in range(mc.num_layers):
        m = lambda k, i=i: full[f"layers.{i}.{k}"]  # noqa: E731
        qkv = m("attn.qkv.weight").view(g, qpg + 2, d, h)
        q, k, v = (qkv[:, :qpg].reshape(a * d, h), qkv[:, qpg].reshape(g * d, h), qkv[:, qpg + 1].reshape(g * d, h))
        qkv_b = m("attn.qkv.bias").view(g, qpg + 2, d) if mc.bias else None
        if gpt2:
            b = f"{p}h.{i}."
            out[b + "ln_1.weight"], out[b + "ln_1.bias"] = m("attn_norm.weight"), m("attn_norm.bias")
            out[b + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t()
            out[b + "attn.c_attn.bias"] = torch.cat(
                [qkv_b[:, 0].reshape(-1), qkv_b[:, 1].reshape(-1), qkv_b[:, 2].reshape(-1)]
            )
            out[b + "attn.c_proj.weight"], out[b + "attn.c_proj.bias"] = m("attn.proj.weight").t(), m("attn.proj.bias")
            out[b + "ln_2.weight"], out[b + "ln_2.bias"] = m("mlp_norm.weight"), m("mlp_norm.bias")
            out[b + "mlp.c_fc.weight"], out[b + "mlp.c_fc.bias"] = m("mlp.fc1.weight").t(), m("mlp.fc1.bias")
            out[b + "mlp.c_proj.weight"], out[b + "mlp.c_proj.bias"] = m("mlp.fc2.weight").t(), m("mlp.fc2.bias")
            continue
        b = f"{p}layers.{i}."
        out[b + "input_layernorm.weight"] = m("attn_norm.weight")
        out[b + "post_attention_layernorm.weight"] = m("mlp_norm.weight")
        out[b + "self_attn.q_proj.weight"], out[b + "self_attn.k_proj.weight"] = q, k
        out[b + "self_attn.v_proj.weight"], out[b + "self_attn.o_proj.weight"] = v, m("attn.proj.weight")
        if family == MIXTRAL:
            out.update(_mixtral_experts_to_hf(full, mc, i, b))
            continue
        fc1 = m("mlp.fc1.weight").view(f, 2, h)
        out[b + "mlp.gate_proj.weight"], out[b + "mlp.up_proj.weight"] = fc1[:, 0], fc1[:, 1]
        out[b + "mlp.down_proj.weight"] = m("mlp.fc2.weight")
        if mc.bias:
            out[b + "self_attn.q_proj.bias"] = qkv_b[:, :qpg].reshape(-1)
            out[b + "self_attn.k_proj.bias"] = qkv_b[:, qpg].reshape(-1)
            out[b + "self_attn.v_proj.bias"] = qkv_b[:, qpg + 1].reshape(-1)
            out[b + "self_attn.o_proj.bias"] = m("attn.proj.bias")
            fc1_b = m("mlp.fc1.bias").view(f, 2)
            out[b + "mlp.gate_proj.bias"], out[b + "mlp.up_proj.bias"] = fc1_b[:, 0], fc1_b[:, 1]
            out[b + "mlp.down_proj.bias"] = m("mlp.fc2.bias")
    if gpt2:
        out[p + "ln_f.weight"], out[p + "ln_f.bias"] = full["final_norm.weight"], full["final_norm.bias"]
    else:
        out[p + "norm.weight"] = full["final_norm.weight"]
    if not mc.tie_embeddings:
        out["lm_head.weight"] = full["output.weight"][:V]
    # safetensors stores each tensor on its own: contiguous copies, no views sharing storage.
    return {k: v.contiguous().clone() for k, v in out.items()}


def _mixtral_experts_to_hf(full: dict[str, torch.Tensor], mc, i: int, b: str) -> dict[str, torch.Tensor]:
    """Layer i's router and experts as Mixtral's gate and w1 (gate) / w3 (up) / w2 (down) per expert."""
    h, fe = mc.hidden_size, mc.moe_ffn_hidden_size or mc.ffn
    out = {b + "block_sparse_moe.gate.weight": full[f"layers.{i}.mlp.router.weight"]}
    for e in range(mc.num_experts):
        src, dst = f"layers.{i}.mlp.experts.{e}.", f"{b}block_sparse_moe.experts.{e}."
        fc1 = full[src + "fc1.weight"].view(fe, 2, h)
        out[dst + "w1.weight"], out[dst + "w3.weight"] = fc1[:, 0], fc1[:, 1]
        out[dst + "w2.weight"] = full[src + "fc2.weight"]
    return out


# ---- import: this rank's slice of each meshrun parameter from the Hugging Face tensors ----------------
def local_from_hf(
    name: str, global_shape, tp_shard_dim: int | None, tp: int, tp_rank: int, read: Reader, mc, family: str
) -> torch.Tensor:
    """This rank's shard of meshrun parameter `name` (global_shape includes vocabulary padding)."""
    p = PREFIX[family]
    gpt2 = family == GPT2
    lo, hi = 0, None
    if tp_shard_dim is not None:
        local = global_shape[tp_shard_dim] // tp
        lo, hi = tp_rank * local, (tp_rank + 1) * local
    rows = slice(lo, hi)

    if name in ("embedding.word.weight", "output.weight"):
        key = "lm_head.weight" if name == "output.weight" else p + ("wte.weight" if gpt2 else "embed_tokens.weight")
        return _vocab_rows(read, key, lo, global_shape[0] if hi is None else hi, mc)
    if name == "embedding.position.weight":
        return read(p + "wpe.weight", None, None)
    if name.startswith("final_norm."):
        kind = name.split(".")[-1]
        return read(p + ("ln_f." + kind if gpt2 else "norm.weight"), None, None)
    _, i, rest = name.split(".", 2)
    b = f"{p}h.{i}." if gpt2 else f"{p}layers.{i}."
    kind = rest.rsplit(".", 1)[-1]  # weight | bias
    if rest.startswith(("attn_norm.", "mlp_norm.")):
        if gpt2:
            return read(b + ("ln_1." if rest.startswith("attn_norm") else "ln_2.") + kind, None, None)
        return read(
            b + ("input_layernorm" if rest.startswith("attn_norm") else "post_attention_layernorm") + ".weight",
            None,
            None,
        )
    if rest.startswith("attn.qkv."):
        return _qkv_rows(read, b, kind, lo, global_shape[0] if hi is None else hi, mc, gpt2)
    if rest.startswith("attn.proj."):  # row-parallel: columns of the output projection; bias replicated
        if gpt2:
            return (
                read(b + "attn.c_proj.bias", None, None)
                if kind == "bias"
                else read(b + "attn.c_proj.weight", rows, None).t()
            )
        return (
            read(b + "self_attn.o_proj.bias", None, None)
            if kind == "bias"
            else read(b + "self_attn.o_proj.weight", None, rows)
        )
    if rest.startswith(("mlp.router.", "mlp.experts.", "mlp.fc1.", "mlp.fc2.")):
        return _mlp_part(read, b, rest, kind, lo, hi, global_shape, gpt2)
    raise KeyError(f"no Hugging Face tensor for meshrun parameter {name}")


def _vocab_rows(read: Reader, key: str, lo: int, hi: int, mc) -> torch.Tensor:
    """Rows [lo, hi) of a vocabulary-sized tensor: the Hugging Face rows below vocab_size, zeros past it."""
    h, V = mc.hidden_size, mc.vocab_size
    real = read(key, slice(lo, min(hi, V)), None) if lo < V else torch.empty(0, h)
    pad = torch.zeros(hi - lo - real.shape[0], h, dtype=real.dtype)  # vocabulary padding rows stay zero
    return torch.cat([real, pad]) if pad.shape[0] else real


def _qkv_rows(read: Reader, b: str, kind: str, lo: int, hi: int, mc, gpt2: bool) -> torch.Tensor:
    """Rows [lo, hi) of the fused qkv weight (or bias): whole query groups, [q heads of j, k_j, v_j] each."""
    _, _, d, qpg = _dims(mc)
    h = mc.hidden_size
    gs = (qpg + 2) * d
    j0, j1 = lo // gs, hi // gs
    n = j1 - j0
    if gpt2:  # Conv1D [h, 3h]: q | k | v along columns; one group per head

        def part(off: int) -> torch.Tensor:
            cols = slice(off + j0 * d, off + j1 * d)
            return (
                read(b + "attn.c_attn.bias", cols, None)
                if kind == "bias"
                else read(b + "attn.c_attn.weight", None, cols).t()
            )

        q, k, v = part(0), part(h), part(2 * h)
    else:

        def proj(which: str, lo_: int, hi_: int) -> torch.Tensor:
            return read(f"{b}self_attn.{which}_proj.{kind}", slice(lo_, hi_), None)

        q = proj("q", j0 * qpg * d, j1 * qpg * d)
        k, v = proj("k", j0 * d, j1 * d), proj("v", j0 * d, j1 * d)
    tail = (h,) if kind == "weight" else ()
    parts = [q.reshape(n, qpg * d, *tail), k.reshape(n, d, *tail), v.reshape(n, d, *tail)]
    return torch.cat(parts, 1).reshape(n * gs, *tail)


def _mlp_part(
    read: Reader, b: str, rest: str, kind: str, lo: int, hi: int | None, global_shape, gpt2: bool
) -> torch.Tensor:
    """This rank's part of an MLP parameter (`rest` its name within the layer): the router, an expert's fc1 or
    fc2, or the dense fc1 (column-parallel) or fc2 (row-parallel)."""
    rows = slice(lo, hi)
    if rest.startswith("mlp.router."):  # replicated over tp
        return read(b + "block_sparse_moe.gate.weight", None, None)
    if rest.startswith("mlp.experts."):  # Mixtral: mlp.experts.{e}.fc1 / fc2 of global expert e
        e, part = rest[len("mlp.experts.") :].split(".", 1)
        x = f"{b}block_sparse_moe.experts.{e}."
        if part.startswith("fc1."):
            hi_ = hi if hi is not None else global_shape[0]
            half = slice(lo // 2, hi_ // 2)  # interleaved gate / up rows, as the dense fc1
            gate, up = read(x + "w1.weight", half, None), read(x + "w3.weight", half, None)
            return torch.stack([gate, up], 1).reshape(hi_ - lo, *gate.shape[1:])
        return read(x + "w2.weight", None, rows)  # fc2: row-parallel, columns of w2
    if rest.startswith("mlp.fc1."):
        if gpt2:
            return (
                read(b + "mlp.c_fc.bias", rows, None) if kind == "bias" else read(b + "mlp.c_fc.weight", None, rows).t()
            )
        hi_ = hi if hi is not None else global_shape[0]
        half = slice(lo // 2, hi_ // 2)  # interleaved gate / up rows: shard [lo, hi) holds pairs lo/2 .. hi/2
        gate, up = read(f"{b}mlp.gate_proj.{kind}", half, None), read(f"{b}mlp.up_proj.{kind}", half, None)
        return torch.stack([gate, up], 1).reshape(hi_ - lo, *gate.shape[1:])
    if gpt2:  # mlp.fc2
        return (
            read(b + "mlp.c_proj.bias", None, None) if kind == "bias" else read(b + "mlp.c_proj.weight", rows, None).t()
        )
    return (
        read(b + "mlp.down_proj.bias", None, None) if kind == "bias" else read(b + "mlp.down_proj.weight", None, rows)
    )
