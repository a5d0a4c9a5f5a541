"""Mixture of experts in the plan: expert and router sizes, active parameters, the expert-data-parallel group
and the all-to-all exchange (pure Python; docs/FORMULAS.md "Mixture of experts").

Conventions (shared with the engine, docs/CONTRACTS.md): with `model.num_experts` = E > 0 every layer's MLP is
a router (a bias-free h x E linear, replicated over tp) and E experts of width `moe_ffn_hidden_size` (fe),
each shaped like the dense MLP (SwiGLU: gate, up, down; GELU: fc1, fc2; biases with model.bias). Each token
runs through `moe_top_k` = k experts. Experts split over `parallel.ep` ranks carved out of the data-parallel
ranks: a rank holds E/ep experts of every layer, their weights split over tp like the dense MLP; their gradients
are reduced, and their optimizer state sharded, over the expert-data-parallel group (the dp x cp ranks holding
the same experts: dp x cp / ep of them).
"""

from __future__ import annotations

from training.contract.config import Config, ModelConfig


def is_moe(cfg: Config) -> bool:
    """Whether the model's MLPs are mixtures of experts."""
    return cfg.model.num_experts > 0


def expert_ffn(m: ModelConfig) -> int:
    """Hidden width of one expert: moe_ffn_hidden_size, else the dense MLP's (ffn_hidden_size or 4h)."""
    return m.moe_ffn_hidden_size or m.ffn


def expert_params(m: ModelConfig) -> int:
    """Elements of one expert (whole, unsharded): fc1 (2 fe x h for SwiGLU's gate and up), fc2, their biases."""
    h, fe = m.hidden_size, expert_ffn(m)
    fc1 = 2 * fe if m.activation == "swiglu" else fe
    n = fc1 * h + h * fe
    if m.bias:
        n += fc1 + h
    return n


def router_params(m: ModelConfig) -> int:
    """Elements of one layer's router: h x E, no bias (Mixtral's gate)."""
    return m.hidden_size * m.num_experts


def ep_degree(cfg: Config) -> int:
    """parallel.ep (1 for a dense model or an invalid value, which validation reports)."""
    ep = getattr(cfg.parallel, "ep", 1)
    return ep if is_moe(cfg) and ep >= 1 else 1


def local_experts(cfg: Config) -> int:
    """Experts of one layer on one rank: E / ep."""
    return cfg.model.num_experts // ep_degree(cfg) if is_moe(cfg) else 0


def expert_params_per_layer(cfg: Config, tp: int, all_experts: bool = False) -> int:
    """Expert elements of one layer on one tp rank: E/ep experts (all E with all_experts), each split over tp but
    for fc2's bias, which every tp rank keeps whole (a row-parallel layer adds it after its reduction, as the dense
    MLP's fc2 does: training/model/moe.py)."""
    if not is_moe(cfg):
        return 0
    n = cfg.model.num_experts if all_experts else local_experts(cfg)
    whole = cfg.model.hidden_size if cfg.model.bias else 0
    return n * ((expert_params(cfg.model) - whole) // tp + whole)


def expert_dp(cfg: Config, dp: int) -> int:
    """Ranks of the expert-data-parallel group: dp x cp / ep (those holding the same experts)."""
    return max(1, dp * max(1, cfg.parallel.cp) // ep_degree(cfg))


def active_mlp_params(m: ModelConfig) -> int:
    """MLP elements one token runs through in one layer: the router and k experts."""
    return router_params(m) + m.moe_top_k * expert_params(m)


def all_to_all_bytes(cfg: Config, act_bytes: int) -> float:
    """Bytes one rank sends in one token exchange (dispatch or combine) of one MoE layer for one micro-batch.

    Each of the rank's T = s b tokens (the whole micro-batch: under sequence parallelism the MoE block gathers
    the sequence first, so every tp rank routes all of it, training/model/moe.py) goes to k experts; with the load
    balanced over the ep ranks, (ep - 1)/ep of the k T copies of h elements leave the rank (dropless; a
    capacity factor below 1 sends fewer, which this upper bound ignores)."""
    ep = ep_degree(cfg)
    if ep <= 1:
        return 0.0
    m, par = cfg.model, cfg.parallel
    tokens = m.seq_length // max(1, par.cp) * par.micro_batch
    return m.moe_top_k * tokens * m.hidden_size * act_bytes * (ep - 1) / ep


def moe_activation_elements(cfg: Config, tokens: int, tp: int) -> dict:
    """Elements one MoE layer saves for backward for `tokens` tokens on one tp rank, in place of the dense MLP's
    fc1/fc2 activations, as training/model/moe.py's autograd saves them (measured by the rehearsal,
    training/rehearse/runner.py):
    - act (16-bit): the router's input, the whole micro-batch on every tp rank (under SP the gathered sequence:
      the caller counts the dense fc1 input's tokens x h / tp, this adds the rest); per assignment (k copies of
      every token) the experts' input, their output (the gate's product saves it), the gated output (the
      index_add that sums a token's k outputs saves its source) and the gate; each expert's inner activations
      at fe/tp (SwiGLU: the fc1 output 2 fe that the gate and up views keep alive, the SiLU output and the
      product fc2 takes, 4 fe; GELU: the fc1 output and the GELU output, 2 fe);
    - fp32: the router's probabilities (softmax saves its output), the top-k's and their sum;
    - int64: the top-k's expert indices and the index tensors of the gathers and scatters (the tokens' rows,
      the expert order, under ep the dispatch's order and its inverse)."""
    m, par = cfg.model, cfg.parallel
    k, fe, h, E = m.moe_top_k, expert_ffn(m), m.hidden_size, m.num_experts
    inner = (4 if m.activation == "swiglu" else 2) * fe
    t_sp = tp if par.sp else 1
    router_rest = tokens * h - tokens * h // t_sp
    indices = 3 + (2 if getattr(par, "ep", 1) > 1 else 0)
    return {
        "act": k * tokens * (3 * h + 1 + inner // tp) + router_rest,
        "fp32": tokens * (E + k + 1),
        "int64": k * tokens * (indices + 1),
    }
