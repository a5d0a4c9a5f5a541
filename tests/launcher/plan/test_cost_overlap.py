"""Issue 28: the overlap the engine achieves enters predicted_step_s (launcher/plan/cost_model.py
overlap_hidden_s): what each switch hides, the bounds (never more than the part less its exposed call, never
more than its compute window), and that the recommender's DP-heavy layouts gain from it."""

from __future__ import annotations

import pytest
from helpers.cli import compose_cfg

from launcher.plan.cost_model import OVERLAP_EFFICIENCY, overlap_hidden_s
from launcher.plan.estimate import make_plan

# A DP-heavy GPU layout: 8 x 8 GPUs, tp 1, so the grads of a 1.3B model cross the nodes in many buckets.
DP_HEAVY = (
    "model=gpt_1p3b",
    "cluster=dgx_h100",
    "cluster.nodes=8",
    "parallel.tp=1",
    "parallel.pp=1",
    "parallel.dp=null",
    "parallel.global_batch=512",
    "parallel.micro_batch=4",
    "parallel.sp=false",
    "parallel.recompute=selective",
)


def _plan(*overrides):
    return make_plan(compose_cfg(*DP_HEAVY, *overrides))


def _parts(*overrides):
    return _plan(*overrides).predicted_step_parts_s


@pytest.mark.parametrize("zero", [0, 1])
def test_dp_reduce_overlaps_only_when_the_engine_overlaps_it(zero):
    plan_on, plan_off = (
        _plan(f"parallel.zero={zero}"),
        _plan(f"parallel.zero={zero}", "parallel.overlap_grad_reduce=false"),
    )
    on, off = plan_on.predicted_step_parts_s, plan_off.predicted_step_parts_s
    assert "overlapped" not in off and on["dp"] == off["dp"] > 0
    hidden = -on["overlapped"]
    assert 0 < hidden < on["dp"]  # the last bucket (and zero=1's first gather) stays exposed
    per_micro = on["compute"] / (512 // 4 // 64)
    window = per_micro * (2 / 3 if zero == 0 else 1.0)  # backward; zero=1 also the next forward
    assert hidden <= OVERLAP_EFFICIENCY["cuda"] * window + 1e-12
    assert plan_on.predicted_step_s == pytest.approx(plan_off.predicted_step_s - hidden)


def test_zero3_prefetch_pipeline_sends_and_cp_ring_are_hidden_up_to_their_windows():
    z3 = _parts("parallel.zero=3")
    assert 0 < -z3["overlapped"] < z3["dp"]
    pp = make_plan(
        compose_cfg(
            "model=tiny",
            "cluster.device=cpu",
            "cluster.gpus_per_node=4",
            "parallel.tp=1",
            "parallel.pp=2",
            "parallel.dp=null",
            "parallel.global_batch=64",
            "parallel.micro_batch=1",
            "parallel.sp=false",
            "parallel.zero=0",
            "parallel.overlap_grad_reduce=false",
        )
    ).predicted_step_parts_s
    assert 0 < -pp["overlapped"] <= pp["pp"] / 2
    pp_off = make_plan(
        compose_cfg(
            "model=tiny",
            "cluster.device=cpu",
            "cluster.gpus_per_node=4",
            "parallel.tp=1",
            "parallel.pp=2",
            "parallel.dp=null",
            "parallel.global_batch=64",
            "parallel.micro_batch=1",
            "parallel.sp=false",
            "parallel.zero=0",
            "parallel.overlap_grad_reduce=false",
            "parallel.overlap_p2p=false",
        )
    ).predicted_step_parts_s
    assert "overlapped" not in pp_off


def test_hidden_is_bounded_by_the_window_and_the_exposed_call():
    cfg = compose_cfg(*DP_HEAVY, "parallel.zero=0")
    # Communication far longer than the compute: the window caps what is hidden.
    parts = {"compute": 1.0, "dp": 100.0}
    hidden = overlap_hidden_s(cfg, parts, m=2, counts={"dp": 50})
    assert hidden["dp"] == pytest.approx(OVERLAP_EFFICIENCY["cuda"] * (1.0 / 2) * 2 / 3)
    # Short communication in one call: nothing can hide (the one bucket starts when backward ends).
    assert overlap_hidden_s(cfg, {"compute": 1.0, "dp": 0.01}, m=2, counts={"dp": 1}) == {"dp": 0.0}
    cpu = compose_cfg(*DP_HEAVY, "parallel.zero=0", "cluster.device=cpu")
    assert overlap_hidden_s(cpu, parts, m=2, counts={"dp": 50})["dp"] == pytest.approx(
        OVERLAP_EFFICIENCY["cpu"] * (1.0 / 2) * 2 / 3
    )
