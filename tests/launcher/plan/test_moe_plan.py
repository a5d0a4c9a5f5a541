"""The planner's mixture of experts: Mixtral 8x7B's published sizes, experts over ep in memory and traffic, the
layout rules with their fixes, recommend's ep search, and the engine's own parameter count (docs/FORMULAS.md)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from helpers.cli import compose_cfg

from launcher.plan.cost_model import cluster_rates
from launcher.plan.estimate import make_plan, with_parallel
from launcher.plan.memory import OPTIMIZER_BYTES
from launcher.plan.model_size import (
    _forward_flops_per_token,
    model_flops_per_token,
    params_active,
    params_total,
    stage_params,
)
from launcher.plan.moe import all_to_all_bytes, expert_dp, expert_params
from launcher.plan.validate import validate
from launcher.recommend.recommend import search

# Mixtral of Experts (Jiang et al. 2024, arXiv:2401.04088) and Mistral AI's model card: 46.7B parameters in
# total, 12.9B used per token; the Hugging Face checkpoint holds 46,702,792,704 elements.
MIXTRAL_TOTAL = 46_702_792_704
MIXTRAL_TOTAL_B, MIXTRAL_ACTIVE_B = 46.7, 12.9


def test_mixtral_8x7b_total_active_and_flops_match_the_published_figures():
    cfg = compose_cfg("model=mixtral_8x7b", "parallel=single")
    m = cfg.model
    total, active = params_total(cfg), params_active(cfg)
    assert total == MIXTRAL_TOTAL
    assert round(total / 1e9, 1) == MIXTRAL_TOTAL_B and round(active / 1e9, 1) == MIXTRAL_ACTIVE_B
    # Active = total less the 6 experts per layer a token skips.
    assert total - active == m.num_layers * (m.num_experts - m.moe_top_k) * expert_params(m)
    # FLOPs from the active parameters: 6 x the active GEMM weights (all but the embedding lookup and the norms)
    # plus the attention scores; forward ~ 2 x 12.9B per token (Kaplan's C = 2N), within the embedding's share.
    gemm_weights = active - m.vocab_size * m.hidden_size - (2 * m.num_layers + 1) * m.hidden_size
    fw = _forward_flops_per_token(cfg)
    assert fw["layers"] + fw["logits"] == 2 * gemm_weights
    assert model_flops_per_token(cfg) == 6 * gemm_weights + 3 * fw["attention"]
    assert abs((fw["layers"] + fw["logits"]) / (2 * MIXTRAL_ACTIVE_B * 1e9) - 1) < 0.015
    # A dense model is unchanged: active = total.
    dense = compose_cfg("model=llama3_8b", "parallel=single")
    assert params_active(dense) == params_total(dense) == 8_030_261_248


def test_experts_over_ep_memory_and_all_to_all():
    base = compose_cfg(
        "model=mixtral_8x7b",
        "cluster=dgx_h100",
        "cluster.nodes=2",
        "parallel.tp=2",
        "parallel.pp=1",
        "parallel.sp=true",
        "parallel.zero=1",
        "parallel.global_batch=256",
        "parallel.micro_batch=1",
        "train.precision=bf16",
        "parallel.recompute=full",
        "parallel.dp=null",
    )
    plans = {ep: make_plan(with_parallel(base, ep=ep)) for ep in (1, 2, 8)}
    m = base.model
    per_layer_experts = m.num_experts * expert_params(m) // 2  # tp=2
    for ep, plan in plans.items():
        sp_ = stage_params(with_parallel(base, ep=ep), 0)
        assert sp_.experts == m.num_layers * per_layer_experts // ep
        assert plan.params_active == params_active(base) and plan.ep == ep
        # Dense states shard over dp (8), expert states over dp / ep (zero=1, K = 12 bytes per element at bf16).
        dense, experts, k = sp_.total - sp_.experts, sp_.experts, OPTIMIZER_BYTES["bf16"]
        edp = expert_dp(with_parallel(base, ep=ep), plan.dp)
        assert edp == plan.dp // ep
        assert plan.memory_bytes["optimizer"] == math.ceil(dense / plan.dp) * k + math.ceil(experts / edp) * k
        assert plan.memory_bytes["weights"] == (dense + experts) * 2
    assert plans[8].memory_bytes["weights"] < plans[2].memory_bytes["weights"] < plans[1].memory_bytes["weights"]
    # The all-to-all: none at ep=1; per layer pass (fwd, bwd, recomputed fwd) 2 exchanges of k s b h 2-byte
    # elements, (ep - 1)/ep of them leaving the rank; priced in the step time.
    assert "ep" not in plans[1].comm_bytes and "ep" not in plans[1].predicted_step_parts_s
    s, h, k_ = m.seq_length, m.hidden_size, m.moe_top_k
    for ep in (2, 8):
        one = all_to_all_bytes(with_parallel(base, ep=ep), 2)
        assert one == k_ * s * h * 2 * (ep - 1) / ep
        micro = 256 // plans[ep].dp
        assert plans[ep].comm_bytes["ep"] == int(micro * 3 * m.num_layers * 2 * one)
        assert plans[ep].predicted_step_parts_s["ep"] > 0
    assert plans[8].comm_bytes["ep"] > plans[2].comm_bytes["ep"]


def test_moe_layout_rules_name_their_fixes():
    base = compose_cfg("action=plan", "data=synthetic", "model=tiny_moe")  # 4 ranks: tp2 x dp2

    def errors(model=None, **par):
        cfg = replace(base, model=replace(base.model, **(model or {})), parallel=replace(base.parallel, **par))
        return {(i.key, i.fix) for i in validate(cfg).errors}

    assert errors(ep=2) == set()  # ep2 inside dp2
    assert ("parallel.ep", "parallel.ep=2") in errors(ep=3)  # 4 experts
    assert any(k == "parallel.ep" and f.startswith("parallel.ep=2") for k, f in errors(ep=4))  # dp=2
    assert any(k == "parallel.ep" and "parallel.ep=1" in f for k, f in errors(model=dict(num_experts=0), ep=2))
    assert ("model.moe_top_k", "model.moe_top_k=4") in errors(model=dict(moe_top_k=5))
    assert ("parallel.ep", "parallel.ep=1") in errors(ep=0)
    assert any(k == "model.moe_ffn_hidden_size" for k, _ in errors(model=dict(moe_ffn_hidden_size=127)))
    assert any(k == "model.moe_capacity_factor" for k, _ in errors(model=dict(moe_capacity_factor=-1.0)))
    assert ("model.moe_aux_loss_coeff", "model.moe_aux_loss_coeff=0.01") in errors(model=dict(moe_aux_loss_coeff=-1.0))


def test_recommend_searches_ep():
    cfg = compose_cfg(
        "model=mixtral_8x7b",
        "cluster=dgx_h100",
        "cluster.nodes=1",
        "parallel.global_batch=32",
        "train.precision=bf16",
        "model.num_layers=4",
        "recommend.probe=false",
    )
    result = search(cfg, cluster_rates(cfg))
    eps = {c.cfg.parallel.ep for c in result.candidates}
    assert {1, 2, 4, 8} <= eps | {c.cfg.parallel.ep for c in result.no_fit}
    best = result.candidates[0]
    assert best.cfg.parallel.ep > 1 and "parallel.ep=" in best.overrides()
    # Every candidate is a valid layout: ep divides dp and the experts.
    assert all(c.plan.dp % c.cfg.parallel.ep == 0 and 8 % c.cfg.parallel.ep == 0 for c in result.candidates)


def test_the_engine_holds_the_planned_parameters():
    """The planner's counts are the engine's: the tiny MoE built by training/model/gpt.py, on one process, whole and
    as the second of two ep ranks."""
    from training.model.gpt import build_gpt
    from training.parallel.mesh import ProcessMesh

    cfg = compose_cfg("model=tiny_moe", "parallel=single")
    (chunk,) = build_gpt(cfg, ProcessMesh.single(), torch.float32)
    assert sum(p.numel() for p in chunk.parameters()) == params_total(cfg) == stage_params(cfg, 0).total
    experts = sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n)
    assert experts == stage_params(cfg, 0).experts
    # ep=2, the second ep rank (its mesh coordinate; the model reads only ep and ep_rank): experts 2 and 3 of 4.
    half = replace(cfg, parallel=replace(cfg.parallel, ep=2))
    (chunk,) = build_gpt(half, replace(ProcessMesh.single(), ep=2, ep_rank=1), torch.float32)
    names = {n.split(".")[4] for n, _ in chunk.named_parameters() if ".experts." in n}
    assert names == {"2", "3"}
    assert sum(p.numel() for p in chunk.parameters()) == stage_params(half, 0).total
    assert (
        sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n)
        == stage_params(half, 0).experts
        == experts // 2
    )
