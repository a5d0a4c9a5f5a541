"""Model size: parameter counts per layer, per pipeline stage and in total, and FLOPs per step (pure Python).

Conventions shared with the engine (docs/CONTRACTS.md): padded_vocab = ceil(V/tp)*tp; each pipeline rank
holds its layers of training/contract/stage_split.py's split (L/pp with the even split; parallel.first_stage_layers,
last_stage_layers, embedding_in_split and loss_in_split make the first and last ranks' counts differ: rank_layers);
the first stage holds the embeddings, the
last the final norm and the output layer; with tied embeddings and pp > 1 the last stage also holds
a copy of the word embedding (Megatron), which counts in its memory but not in params_total.
Narayanan et al. 2021's parameter count and FLOPs formulas are special cases, reproduced by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.plan.moe import active_mlp_params, expert_ffn, expert_params_per_layer, is_moe, router_params
from training.contract.config import Config
from training.contract.layout_rules import padded_vocab  # the engine's embedding rows: one definition for both
from training.contract.stage_split import stage_split

# --------------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------------


def _norm_params(cfg: Config) -> int:
    m = cfg.model
    if m.norm == "rmsnorm":
        return m.hidden_size
    return m.hidden_size * (2 if m.bias else 1)


@dataclass
class LayerParams:
    """Parameters of one transformer layer held by one tp rank (sharded part / replicated part)."""

    sharded: int
    """Elements of column/row-parallel weights and column-parallel biases on this tp rank."""
    replicated: int
    """Elements replicated over tp: norms and the row-parallel biases."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def layer_params(cfg: Config, tp: int | None = None, all_experts: bool = False) -> LayerParams:
    """One layer on one tp rank: fused QKV (column), attention output (row), MLP fc1 (column), fc2 (row).

    A mixture of experts (launcher/plan/moe.py) replaces the MLP: the router (replicated) and the rank's E/ep
    experts (all E with all_experts), each split over tp like the dense MLP (expert fc2 biases included)."""
    m = cfg.model
    t = tp if tp is not None else cfg.parallel.tp
    h, a, g, f = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn
    hd = h // a
    qkv_out = (a + 2 * g) * hd
    fc1_out = 2 * f if m.activation == "swiglu" else f
    if is_moe(cfg):
        full_sharded = qkv_out * h + h * h + (qkv_out if m.bias else 0)
        replicated = 2 * _norm_params(cfg) + (h if m.bias else 0) + router_params(m)
        return LayerParams(
            sharded=full_sharded // t + expert_params_per_layer(cfg, t, all_experts), replicated=replicated
        )
    full_sharded = qkv_out * h + h * h + fc1_out * h + h * f
    if m.bias:
        full_sharded += qkv_out + fc1_out
    replicated = 2 * _norm_params(cfg) + (2 * h if m.bias else 0)
    return LayerParams(sharded=full_sharded // t, replicated=replicated)


@dataclass
class StageParams:
    """Parameters one pipeline stage's tp rank holds, by part."""

    layers: int
    """Transformer layers on this rank (all its virtual chunks)."""
    layer_params: int
    """Elements of those layers."""
    embedding: int
    """Word (vocab-parallel shard) and position embeddings, or the tied copy on the last stage."""
    head: int
    """Final norm and the untied output layer."""
    experts: int = 0
    """Of layer_params, the experts' elements (sharded over ep; their gradients and optimizer state belong to the
    expert-data-parallel group, launcher/plan/moe.py)."""

    @property
    def total(self) -> int:
        return self.layer_params + self.embedding + self.head


def stage_params(cfg: Config, stage: int) -> StageParams:
    """Elements held by one rank of pipeline stage `stage` (0-based) at the config's tp."""
    m, par = cfg.model, cfg.parallel
    t, p = par.tp, par.pp
    h = m.hidden_size
    vp = padded_vocab(m.vocab_size, t)
    word = vp * h // t
    n_layers = rank_layers(cfg)[stage]
    lp = layer_params(cfg).total * n_layers
    embedding = 0
    head = 0
    if stage == 0:
        embedding += word
        if m.position == "learned":
            embedding += m.seq_length * h
    if stage == p - 1:
        head += _norm_params(cfg)
        if not m.tie_embeddings:
            head += word
        elif p > 1:
            embedding += word  # Megatron's tied copy on the last stage
    experts = n_layers * expert_params_per_layer(cfg, t)
    return StageParams(layers=n_layers, layer_params=lp, embedding=embedding, head=head, experts=experts)


def params_total(cfg: Config, tp: int | None = None) -> int:
    """Unique parameters of the model as instantiated at tp (vocab padded to a multiple of tp).

    With tp=1 and V already a multiple of tp this is the model's true size; the tied copy on the
    last pipeline stage is not counted (it is the same parameter)."""
    m = cfg.model
    t = tp if tp is not None else cfg.parallel.tp
    h = m.hidden_size
    lp = layer_params(cfg, tp=1, all_experts=True).total
    total = m.num_layers * lp + padded_vocab(m.vocab_size, t) * h + _norm_params(cfg)
    if m.position == "learned":
        total += m.seq_length * h
    if not m.tie_embeddings:
        total += padded_vocab(m.vocab_size, t) * h
    return total


def params_active(cfg: Config, tp: int | None = None) -> int:
    """Parameters one token runs through: params_total with each layer's experts counted k times instead of E
    times (a dense model: params_total). Mixtral 8x7B: 12.9B of 46.7B (docs/FORMULAS.md)."""
    total = params_total(cfg, tp)
    if not is_moe(cfg):
        return total
    m = cfg.model
    all_experts = expert_params_per_layer(cfg, 1, all_experts=True)
    return total - m.num_layers * (all_experts + router_params(m)) + m.num_layers * active_mlp_params(m)


# --------------------------------------------------------------------------------------------------
# FLOPs per step
# --------------------------------------------------------------------------------------------------


def _forward_flops_per_token(cfg: Config) -> dict[str, int]:
    """Forward GEMM FLOPs per token: layers' weight GEMMs, attention scores (QK^T and AV), logits."""
    m = cfg.model
    h, a, g, f, s = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn, m.seq_length
    hd = h // a
    fc1 = 2 * f if m.activation == "swiglu" else f
    weights = (a + 2 * g) * hd * h + a * hd * h + fc1 * h + f * h
    if is_moe(cfg):  # the router and the k experts a token runs through (biases are not GEMMs)
        weights = (a + 2 * g) * hd * h + a * hd * h + router_params(m) + m.moe_top_k * _expert_gemm(cfg)
    return {
        "layers": m.num_layers * 2 * weights,
        "attention": m.num_layers * 4 * s * a * hd,
        "logits": 2 * h * m.vocab_size,
    }


def _expert_gemm(cfg: Config) -> int:
    """Weight elements of one expert's GEMMs (no biases)."""
    m = cfg.model
    fe = expert_ffn(m)
    return (3 if m.activation == "swiglu" else 2) * fe * m.hidden_size


def model_flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token: 3 x the forward GEMMs (weights of the active parameters, attention scores,
    logits). Without the attention term this is 6 x the active GEMM weights (Kaplan et al.'s 6N, with N the
    active parameters less the embedding lookup and the norms)."""
    fw = _forward_flops_per_token(cfg)
    return 3 * (fw["layers"] + fw["attention"] + fw["logits"])


def model_flops_per_step(cfg: Config) -> int:
    """3 x forward GEMMs for B = global batch sequences; for GPT: 72 B s L h^2 (1 + s/(6h) + V/(12 L h))."""
    fw = _forward_flops_per_token(cfg)
    tokens = cfg.parallel.global_batch * cfg.model.seq_length
    return 3 * tokens * (fw["layers"] + fw["attention"] + fw["logits"])


def hardware_flops_per_step(cfg: Config) -> int:
    """Model FLOPs plus recomputation.

    full: one more forward of the layers (not the logits) -> 96 B s L h^2 (1 + s/(6h) + V/(16 L h)).
    selective: Korthikanti et al.'s published 72 B s L h^2 (1 + s/(3h) + V/(12 L h)), i.e. the
    attention-score term counted twice; reproduced as published."""
    fw = _forward_flops_per_token(cfg)
    tokens = cfg.parallel.global_batch * cfg.model.seq_length
    total = model_flops_per_step(cfg)
    if cfg.parallel.recompute == "full":
        total += round(tokens * (fw["layers"] + fw["attention"]) * recomputed_fraction(cfg))
    elif cfg.parallel.recompute == "selective":
        total += 3 * tokens * fw["attention"]
    return total


def rank_layers(cfg: Config) -> list[int]:
    """Transformer layers of each pipeline rank (all its chunks), from training/contract/stage_split.py (the
    engine's split); the even share L // pp on every rank when no split exists (validation reports that)."""
    ranks = stage_split(cfg).rank_layers()
    if ranks is None:
        p = max(1, cfg.parallel.pp)
        return [cfg.model.num_layers // p] * p
    return ranks


def rank_chunk_layers(cfg: Config, stage: int) -> list[int]:
    """Layers of each of pipeline rank `stage`'s model chunks, chunk 0 first (the even share when no split
    exists)."""
    s = stage_split(cfg)
    counts = s.counts()
    if counts is None:
        per = cfg.model.num_layers // max(1, s.pp * s.vpp)
        return [per] * s.vpp
    return [counts[c * s.pp + stage] for c in range(s.vpp)]


def chunk_layers(cfg: Config) -> int:
    """Layers of the largest pipeline chunk (model chunk of the interleaved schedule, or the rank's stage)."""
    s = stage_split(cfg)
    return s.max_chunk_layers() or cfg.model.num_layers // max(1, s.pp * s.vpp)


def busiest_stage(cfg: Config) -> int:
    """The pipeline rank with the most layers (the first of them): whose passes pace the pipeline."""
    ranks = rank_layers(cfg)
    return ranks.index(max(ranks))


def recomputed_layers_per_rank(cfg: Config, stage: int | None = None) -> int:
    """Layers of pipeline rank `stage` (default: the busiest, busiest_stage) that recompute their forward in
    backward (recompute=full): the first recompute_num_layers of each of its chunks, every layer when it is 0;
    none without full recompute."""
    par = cfg.parallel
    if str(par.recompute) != "full":
        return 0
    chunks = rank_chunk_layers(cfg, busiest_stage(cfg) if stage is None else stage)
    n = getattr(par, "recompute_num_layers", 0)
    if n <= 0:
        return sum(chunks)
    return sum(min(n, c) for c in chunks)


def recomputed_fraction(cfg: Config) -> float:
    """Share of the layers that are recomputed (1 under recompute=full with recompute_num_layers=0)."""
    if str(cfg.parallel.recompute) != "full":
        return 0.0
    ranks = rank_layers(cfg)
    return sum(recomputed_layers_per_rank(cfg, st) for st in range(len(ranks))) / max(1, sum(ranks))
