"""GPT decoder with explicit Megatron-style tensor and sequence parallelism.

Hidden states are SEQUENCE-FIRST, [s, b, h], under sequence parallelism (as in Megatron): a rank holds
the contiguous shard [s/tp, b, h] of the sequence, so splitting and gathering is along dim 0. Without SP
nothing needs the sequence first, and between the layers they are BATCH-FIRST, [b, s, h], as in nanoGPT:
attention then reads q, k, v rows at a stride of 3h instead of b * 3h, and the heads merge after it
without a copy (docs/PERFORMANCE.md has the measurements). Every op computes each token the same way in
either order (the forward is bit for bit the same); a chunk's own inputs and outputs (pipeline messages,
logits) are sequence-first either way.
Where the parallelism lives (all visible here):
  embedding: vocab-parallel lookup, then all-reduce (or reduce-scatter into sequence shards under SP)
  attention: norm (on shards under SP) -> column-parallel fused QKV (one SP all-gather) -> heads split
             over tp -> row-parallel proj (all-reduce, or reduce-scatter under SP) -> dropout -> residual
  MLP:       norm -> column-parallel fc1 -> activation -> row-parallel fc2 -> dropout -> residual
             (model.num_experts > 0: router -> top-k -> all-to-all over ep -> experts -> back; training/model/moe.py)
  head:      final norm -> column-parallel logits -> vocab-parallel cross-entropy
A model is built as `GPTChunk`s, contiguous slices of layers (pipeline stages / virtual stages);
`build_gpt` makes this rank's chunks. Parameter names are the same at any tp / pp (CONTRACTS.md).

Weight layouts chosen so that a contiguous tp slice is a self-contained shard (layout independence):
  qkv.weight [(a + 2g) d, h]: per query group j, rows [q heads of j (a/g * d), k_j (d), v_j (d)];
  fc1.weight under swiglu [2f, h]: rows interleaved gate_0, up_0, gate_1, up_1, ...

Dropout masks come from generators seeded by (seed, dp rank, micro-batch counter, layer, site), not
from the global RNG, so that recomputation replays them exactly. Residual-branch dropout (outside the
TP region) draws the mask of the whole sequence and keeps this rank's rows, so it equals the
single-process mask at any tp / sp; attention-probability dropout (inside the TP region) differs per tp rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from training.contract.config import Config, ModelConfig, ParallelConfig
from training.contract.layout_rules import (
    layer_rules,
    model_rules,
    padded_vocab,
    raise_errors,
    sequence_parallel_on,
    sp_rules,
    tp_rules,
)
from training.contract.stage_split import SPLIT_KEYS, StageSplit
from training.model.dropout_softmax import masked_scale, softmax_16
from training.model.fp8_apply import apply_fp8
from training.model.fused_ops import rms_norm, rotary_qkv, swiglu
from training.model.init import init_parameters, stable_seed
from training.model.moe import MoEMLP
from training.parallel.collectives import group_rank, group_size, reduce_from_tp, reduce_scatter_to_sp
from training.parallel.context import CPContext, context_parallel_attention, split_sequence
from training.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    set_tp_meta,
    vocab_parallel_cross_entropy,
)
from training.parallel.mesh import ProcessMesh

# SDPA takes grouped key/value heads natively from torch 2.5 (enable_gqa); before, repeat them.
_SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate_model_layout(mc: ModelConfig, tp: int, sp: bool) -> None:
    """Errors a user can cause by combining model and tp, each naming the fix (training/contract/layout_rules.py)."""
    raise_errors(model_rules(mc) + tp_rules(mc, tp) + sp_rules(sp, tp, mc.seq_length))
    _check(mc.norm in ("layernorm", "rmsnorm"), f"model.norm={mc.norm!r}: use layernorm or rmsnorm")
    _check(mc.activation in ("gelu", "swiglu"), f"model.activation={mc.activation!r}: use gelu or swiglu")
    _check(mc.position in ("learned", "rope"), f"model.position={mc.position!r}: use learned or rope")
    _check(mc.attention in ("flash", "math"), f"model.attention={mc.attention!r}: use flash or math")


def keyed_dropout(x: torch.Tensor, p: float, key: int, shard: int = 0, num_shards: int = 1) -> torch.Tensor:
    """Dropout whose mask is a pure function of `key`.

    With num_shards > 1, x is shard `shard` (along dim 0) of a tensor num_shards times longer: the mask
    of the whole tensor is drawn and this shard's rows kept, so the result does not depend on sharding.
    """
    if p <= 0.0:
        return x
    g = torch.Generator(device=x.device).manual_seed(key)
    shape = (x.shape[0] * num_shards,) + tuple(x.shape[1:])
    keep = torch.rand(shape, generator=g, device=x.device) >= p
    if num_shards > 1:
        keep = keep.chunk(num_shards, dim=0)[shard].clone()  # saved: only this shard's rows, not the whole mask
    return masked_scale(x, keep, 1.0 / (1.0 - p))  # saves the 1-byte mask (Megatron's accounting)


class _SwapSequenceBatch(torch.autograd.Function):
    """[s, b, h] <-> [b, s, h] as a contiguous copy, forward and backward alike: at a chunk's boundary (pipeline
    messages are sequence-first) the grad handed back to the previous stage is contiguous too."""

    @staticmethod
    def forward(ctx, x):
        return x.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.transpose(0, 1).contiguous()


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dim; params replicated over tp (on sequence shards under SP)."""

    def __init__(self, h: int, kind: str, bias: bool, sequence_parallel: bool, dtype, device, eps: float = 1e-5):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = set_tp_meta(
            nn.Parameter(torch.empty(h, dtype=dtype, device=device)), None, (h,), sequence_parallel
        )
        self.bias = None
        if bias and kind == "layernorm":
            self.bias = set_tp_meta(
                nn.Parameter(torch.empty(h, dtype=dtype, device=device)), None, (h,), sequence_parallel
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return rms_norm(x, self.weight, self.eps)  # saves x and rstd only (training/model/fused_ops.py)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps=self.eps)


class Rotary(nn.Module):
    """Rotary position embedding; cos/sin tables are buffers, not parameters.

    Rotate-half pairing: dimension i of a head rotates with dimension i + d/2 (not with its neighbour i + 1
    as in the original Meta checkpoints), which is the convention of Hugging Face's Llama, so its q/k
    weights map onto meshrun's without a permutation (training/hf/convert.py).
    """

    def __init__(self, head_dim: int, seq_length: int, device, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        ang = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv)
        ang = torch.cat([ang, ang], dim=-1)  # [s, d]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: [b, heads, s, d], positions offset .. offset + s - 1 (0: the full sequence; a KV-cached
        decoding step passes the position of its first token). Under cp the tables hold this rank's positions."""
        s = x.shape[-2]
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        cos, sin = self.cos[offset : offset + s], self.sin[offset : offset + s]
        return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with heads split over tp, grouped-query attention, flash or math core."""

    def __init__(self, mc: ModelConfig, group, sp: bool, dtype, device, cp: CPContext | None = None):
        super().__init__()
        tp = group_size(group)
        # cp > 1: this rank's queries attend over the whole sequence through the cp group (parallel/context.py).
        self.cp = cp
        self.positions = cp.positions(mc.seq_length, device) if cp is not None else None
        a, g, h = mc.num_attention_heads, mc.query_groups, mc.hidden_size
        self.d = h // a
        self.q_per_group = a // g
        self.local_groups = g // tp
        self.local_heads = a // tp
        self.flash = mc.attention == "flash"
        self.dropout = mc.dropout
        self.tp_rank = group_rank(group)
        self.qkv = ColumnParallelLinear(h, (a + 2 * g) * self.d, mc.bias, group, sp, dtype, device)
        self.proj = RowParallelLinear(a * self.d, h, mc.bias, group, sp, dtype, device)
        self.rotary = Rotary(self.d, mc.seq_length, device, mc.rope_base) if mc.position == "rope" else None
        if self.rotary is not None and self.positions is not None:
            # This rank's rows of the tables, once: each forward then reads a slice, as without cp.
            self.rotary.cos, self.rotary.sin = self.rotary.cos[self.positions], self.rotary.sin[self.positions]
        self.recompute_core = False
        self.batch_first = not (sp and tp > 1)  # the layout of its input and output (module docstring)

    def core(self, q, k, v, key: int) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v with dropout on the probabilities; [b, heads, s, d]."""
        if self.cp is not None:
            return context_parallel_attention(q, k, v, self.cp)
        p = self.dropout if self.training else 0.0
        if p > 0.0:  # differs per tp rank: each rank holds other heads
            key = stable_seed(key, "attn_probs", self.tp_rank)
        if self.flash:
            kw = {}
            if self.q_per_group > 1:
                if _SDPA_GQA:
                    kw["enable_gqa"] = True
                else:
                    k = k.repeat_interleave(self.q_per_group, dim=1)
                    v = v.repeat_interleave(self.q_per_group, dim=1)
            if p == 0.0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            # SDPA draws its mask from the global RNG: seed it from the key inside a forked RNG.
            devices = [q.device] if q.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, device_type=q.device.type):
                torch.manual_seed(key)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **kw)
        if self.q_per_group > 1:
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.d))
        # An additive mask: unlike masked_fill, an add keeps no s x s boolean for backward.
        causal = torch.full((s, s), float("-inf"), device=q.device).triu_(1)
        probs = softmax_16(scores, causal)  # in fp32, saving only the probabilities in q's dtype
        probs = keyed_dropout(probs, p, key)
        return torch.matmul(probs, v)

    def split_qkv(self, qkv: torch.Tensor, batch_first: bool = False):
        """[s, b, local_groups * (q_per_group + 2) * d] (or [b, s, ...] with batch_first) -> q [b, local_heads, s, d],
        k and v [b, local_groups, s, d]."""
        n0, n1 = qkv.shape[:2]
        qkv = qkv.view(n0, n1, self.local_groups, self.q_per_group + 2, self.d)
        # One split, not three slices: the backward of a split is one concatenation, where each slice's
        # backward would build a zero-filled grad of the whole qkv output and add the three.
        q, k, v = torch.split(qkv, [self.q_per_group, 1, 1], dim=3)
        order = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
        q = q.reshape(n0, n1, self.local_heads, self.d).permute(*order)
        return q, k.squeeze(3).permute(*order), v.squeeze(3).permute(*order)

    def forward(self, x: torch.Tensor, key: int) -> torch.Tensor:
        """x: [b, s, h], or under SP the local sequence shard [s/tp, b, h]; the output has x's order."""
        qkv = self.qkv(x)  # [b, s, local_groups * (q_per_group + 2) * d]; under SP [s, b, ...], s the full sequence
        n0, n1 = qkv.shape[:2]
        if self.rotary is not None:  # rotated into new q and k+v tensors: the linear's output is freed (fused_ops)
            s = n1 if self.batch_first else n0
            q, kv = rotary_qkv(
                qkv.view(n0, n1, self.local_groups, self.q_per_group + 2, self.d),
                self.rotary.cos[:s],
                self.rotary.sin[:s],
                1 if self.batch_first else 0,
            )
            order = (0, 2, 1, 3) if self.batch_first else (1, 2, 0, 3)
            q, k, v = q.permute(*order), kv[:, :, :, 0].permute(*order), kv[:, :, :, 1].permute(*order)
        else:
            q, k, v = self.split_qkv(qkv, self.batch_first)
        if self.recompute_core:
            ctx = checkpoint(self.core, q, k, v, key, use_reentrant=False)
        else:
            ctx = self.core(q, k, v, key)
        # SDPA's output is [b, s, heads, d] in memory: batch-first, merging the heads is a view, not a copy.
        ctx = ctx.transpose(1, 2) if self.batch_first else ctx.permute(2, 0, 1, 3)
        return self.proj(ctx.reshape(n0, n1, self.local_heads * self.d))


class MLP(nn.Module):
    """fc1 (column-parallel) -> gelu or swiglu -> fc2 (row-parallel)."""

    def __init__(self, mc: ModelConfig, group, sp: bool, dtype, device):
        super().__init__()
        self.swiglu = mc.activation == "swiglu"
        self.gelu_approximate = "tanh" if mc.gelu_tanh else "none"
        f, h = mc.ffn, mc.hidden_size
        self.fc1 = ColumnParallelLinear(h, 2 * f if self.swiglu else f, mc.bias, group, sp, dtype, device)
        self.fc2 = RowParallelLinear(f, h, mc.bias, group, sp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.swiglu:
            y = swiglu(y)  # interleaved gate / up rows; saves only y (training/model/fused_ops.py)
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.fc2(y)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(
        self, mc: ModelConfig, mesh: ProcessMesh, sp: bool, layer_id: int, dtype, device, cp: CPContext | None = None
    ):
        super().__init__()
        self.layer_id = layer_id
        self.dropout = mc.dropout
        self.tp, self.tp_rank = mesh.tp, mesh.tp_rank
        self.sp = sp
        self.attn_norm = Norm(mc.hidden_size, mc.norm, mc.bias, sp, dtype, device, mc.norm_eps)
        self.attn = Attention(mc, mesh.tp_group, sp, dtype, device, cp)
        self.mlp_norm = Norm(mc.hidden_size, mc.norm, mc.bias, sp, dtype, device, mc.norm_eps)
        # model.num_experts > 0: the mixture-of-experts MLP (training/model/moe.py), experts over parallel.ep.
        self.mlp = (
            MoEMLP(mc, mesh, sp, dtype, device) if mc.num_experts > 0 else MLP(mc, mesh.tp_group, sp, dtype, device)
        )

    def _drop(self, x: torch.Tensor, key: int, site: str) -> torch.Tensor:
        if not self.training or self.dropout <= 0.0:
            return x
        k = stable_seed(key, self.layer_id, site)
        if self.sp:  # x is this rank's sequence shard: keep its rows of the full-sequence mask
            return keyed_dropout(x, self.dropout, k, self.tp_rank, self.tp)
        # Batch-first: the mask is drawn in [s, b, h] order, the same as under SP.
        return keyed_dropout(x.transpose(0, 1), self.dropout, k).transpose(0, 1)

    def forward(self, x: torch.Tensor, key: int) -> torch.Tensor:
        # The attention's own key only matters with dropout (hashing it costs a little every layer).
        attn_key = stable_seed(key, self.layer_id) if self.dropout > 0.0 and self.training else 0
        x = x + self._drop(self.attn(self.attn_norm(x), attn_key), key, "attn_out")
        return x + self._drop(self.mlp(self.mlp_norm(x)), key, "mlp_out")


class PositionEmbedding(nn.Module):
    """Learned absolute positions [s, h], replicated over tp."""

    def __init__(self, s: int, h: int, sequence_parallel: bool, dtype, device):
        super().__init__()
        self.weight = set_tp_meta(
            nn.Parameter(torch.empty(s, h, dtype=dtype, device=device)), None, (s, h), sequence_parallel
        )


class Embedding(nn.Module):
    """Word (vocab-parallel) plus optional learned position embedding; output [b, s, h] ([s/tp, b, h] under SP)."""

    def __init__(
        self,
        mc: ModelConfig,
        mesh: ProcessMesh,
        sp: bool,
        padded_vocab: int,
        with_position: bool,
        dtype,
        device,
        cp: CPContext | None = None,
    ):
        super().__init__()
        self.group, self.sp, self.tp_rank = mesh.tp_group, sp, mesh.tp_rank
        # cp > 1: the rows of this rank's tokens' true positions (parallel/context.py); else the first s rows.
        self.positions = cp.positions(mc.seq_length, device) if cp is not None else None
        self.word = VocabParallelEmbedding(padded_vocab, mc.hidden_size, mesh.tp_group, dtype, device)
        # Under SP the position table is added to sequence shards, so its grad is a partial sum.
        self.position = PositionEmbedding(mc.seq_length, mc.hidden_size, sp, dtype, device) if with_position else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sp:
            x = reduce_from_tp(self.word(ids, reduce=False), self.group)  # [b, s, h]
            if self.position is None:
                return x
            if self.positions is not None:
                return x + self.position.weight[self.positions]
            return x + self.position.weight[: ids.shape[1]]
        # Looked up in [s, b] order: the rows come out sequence-first and contiguous, with no transposing copy.
        x = reduce_scatter_to_sp(self.word(ids.t(), reduce=False), self.group)  # this rank's [s/tp, b, h]
        if self.position is not None:
            lo, hi = self.tp_rank * x.shape[0], (self.tp_rank + 1) * x.shape[0]
            rows = (
                self.position.weight[self.positions[lo:hi]]
                if self.positions is not None
                else self.position.weight[lo:hi]
            )
            x = x + rows.unsqueeze(1)
        return x


class GPTChunk(nn.Module):
    """A contiguous slice of the GPT: optional embedding, layers `layer_ids`, optional head and loss.

    forward(x, targets=None):
      x: token ids [b, s] when has_embedding, else hidden states [s/tp (SP) or s, b, h] (sequence-first);
      returns hidden states (sequence-first), or with has_head: the mean token loss of this micro-batch (fp32
      scalar, identical on every tp rank) when targets [b, s] are given, else this rank's logits [s, b, Vp/tp].
    With tied embeddings, a head-only chunk holds its own copy of `embedding.word.weight` (same name);
    the pipeline keeps the copies equal by all-reducing their grads over mesh.embedding_group.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        parallel_cfg: ParallelConfig,
        mesh: ProcessMesh,
        layer_ids: list[int],
        has_embedding: bool,
        has_head: bool,
        dtype: torch.dtype,
        seed: int,
    ):
        super().__init__()
        mc = model_cfg
        self.sp = sequence_parallel_on(parallel_cfg.sp, mesh.tp)  # off at tp = 1 (the engine warns once)
        self.batch_first = not self.sp  # the layout between the layers (module docstring)
        validate_model_layout(mc, mesh.tp, self.sp)
        if parallel_cfg.recompute not in ("none", "selective", "full"):
            raise ValueError(f"parallel.recompute={parallel_cfg.recompute!r}: use none, selective or full")
        self.mc, self.mesh, self.seed = mc, mesh, seed
        self.layer_ids = list(layer_ids)
        self.has_embedding, self.has_head = has_embedding, has_head
        self.recompute = parallel_cfg.recompute
        n = getattr(parallel_cfg, "recompute_num_layers", 0)
        if n < 0:
            raise ValueError(f"parallel.recompute_num_layers={n}: use 0 (every layer) or a positive count")
        # Full recompute of the first n layers of this chunk (0: all); the others keep their activations.
        self.recompute_layers = len(layer_ids) if n == 0 else min(n, len(layer_ids))
        self.vocab_size = mc.vocab_size
        self.padded_vocab = padded_vocab(mc.vocab_size, mesh.tp)
        self.micro_step = 0  # counts training forwards: the dropout key of each micro-batch
        dev = mesh.device
        # Context parallelism: this rank runs its two chunks of every sample (parallel/context.py).
        self.cp = (
            CPContext(
                mesh.cp,
                mesh.cp_rank,
                mesh.cp_group,
                list(mesh.group_ranks.get("cp", [])),
                getattr(parallel_cfg, "cp_comm", "ring"),
            )
            if mesh.cp > 1
            else None
        )
        self.embedding = None
        if has_embedding or (has_head and mc.tie_embeddings):
            self.embedding = Embedding(
                mc, mesh, self.sp, self.padded_vocab, has_embedding and mc.position == "learned", dtype, dev, self.cp
            )
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(mc, mesh, self.sp, i, dtype, dev, self.cp) for i in self.layer_ids}
        )
        first = None
        for layer in self.layers.values():
            layer.attn.recompute_core = self.recompute == "selective"
            # One pair of RoPE tables for the chunk: every layer's are the same values (2 x s x d fp32 each,
            # 8 MiB per layer at s = 8K, d = 128, which no plan counted; found by the rehearsal).
            rot = layer.attn.rotary
            if rot is not None:
                first = first or rot
                rot.cos, rot.sin = first.cos, first.sin
        self.final_norm = Norm(mc.hidden_size, mc.norm, mc.bias, self.sp, dtype, dev, mc.norm_eps) if has_head else None
        self.output = None
        if has_head and not mc.tie_embeddings:
            self.output = ColumnParallelLinear(
                mc.hidden_size, self.padded_vocab, False, mesh.tp_group, self.sp, dtype, dev
            )
        self.output_matmul = (
            None  # an FP8 matmul for the head when fp8_skip leaves it out (training/model/fp8_apply.py)
        )
        init_parameters(self, seed, mc.init_std, mc.num_layers, mc.vocab_size, mesh.tp, mesh.tp_rank)

    def param_units(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """The chunk's parts in forward order, each with the parameters read once that part's forward has
        started: for code that puts parameters in place just in time (optim/param_gather.py). The head's
        weight is read by this chunk's forward right after the final norm's forward."""
        units: list[tuple[nn.Module, list[nn.Parameter]]] = []
        if self.has_embedding:
            units.append((self.embedding, list(self.embedding.parameters())))
        units += [(layer, list(layer.parameters())) for layer in self.layers.values()]
        if self.has_head:
            head = self.output.weight if self.output is not None else self.embedding.word.weight
            units.append((self.final_norm, [*self.final_norm.parameters(), head]))
        return units

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        key = (
            stable_seed(self.seed, "dropout", self.mesh.dp_rank, self.mesh.cp_rank, self.micro_step)
            if self.mc.dropout > 0.0
            else 0
        )
        if self.training:
            self.micro_step += 1
        batch_first = self.batch_first
        if self.cp is not None:  # full samples in: keep this rank's chunks of the tokens and of the targets
            if self.has_embedding:
                x = split_sequence(x, 1, self.cp.cp, self.cp.cp_rank)
            if targets is not None:
                targets = split_sequence(targets, 1, self.cp.cp, self.cp.cp_rank)
        if self.has_embedding:
            x = self.embedding(x)
        elif batch_first:
            x = _SwapSequenceBatch.apply(x)
        for k, layer in enumerate(self.layers.values()):
            if self.recompute == "full" and k < self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, key, use_reentrant=False)
            else:
                x = layer(x, key)
        if not self.has_head:
            return _SwapSequenceBatch.apply(x) if batch_first else x
        x = self.final_norm(x)
        weight = self.output.weight if self.output is not None else self.embedding.word.weight
        logits = column_parallel_linear(  # [b, s, Vp/tp] or [s, b, ...]
            x, weight, None, self.mesh.tp_group, self.sp, self.output_matmul
        )
        if targets is None:
            return logits.transpose(0, 1).contiguous() if batch_first else logits
        if batch_first:
            # The mean over the tokens in sequence-first order (a copy of b s floats): the same sum as under SP.
            loss = vocab_parallel_cross_entropy(logits, targets, self.mesh.tp_group, self.vocab_size)
            return loss.t().contiguous().mean()
        return vocab_parallel_cross_entropy(logits, targets.t(), self.mesh.tp_group, self.vocab_size).mean()


def chunk_layer_ids(num_layers: int, pp: int, vpp: int, pp_rank: int, **split: Any) -> list[list[int]]:
    """Global layer ids of this pipeline rank's chunks: model chunk v * pp + pp_rank for v < vpp (`split`: the
    parallel.* keys of training/contract/stage_split.py; none: the even split)."""
    raise_errors(layer_rules(num_layers, pp, vpp, **split))
    return StageSplit(num_layers, pp, vpp, **split).layer_ids(pp_rank)


def build_gpt(cfg: Config, mesh: ProcessMesh, dtype: torch.dtype) -> list[GPTChunk]:
    """This rank's model chunks (one with every layer when pp = vpp = 1), in virtual-stage order."""
    pc = cfg.parallel
    vpp = pc.vpp if pc.pp > 1 else 1
    chunks = []
    last = pc.pp * vpp - 1
    split = {k: getattr(pc, k) for k in SPLIT_KEYS}
    for v, ids in enumerate(chunk_layer_ids(cfg.model.num_layers, pc.pp, vpp, mesh.pp_rank, **split)):
        index = v * pc.pp + mesh.pp_rank
        chunks.append(
            GPTChunk(
                cfg.model,
                pc,
                mesh,
                ids,
                has_embedding=index == 0,
                has_head=index == last,
                dtype=dtype,
                seed=cfg.train.seed,
            )
        )
    # One pair of RoPE tables for the rank (each chunk's layers already share their chunk's; see GPTChunk).
    rotaries = [layer.attn.rotary for c in chunks for layer in c.layers.values() if layer.attn.rotary is not None]
    for rot in rotaries[1:]:
        rot.cos, rot.sin = rotaries[0].cos, rotaries[0].sin
    apply_fp8(chunks, cfg)
    return chunks
