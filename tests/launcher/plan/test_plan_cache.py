"""The recommender's PlanCache (launcher/plan/plan_cache.py): a plan made through a cache that already holds a
layout's figures equals a fresh plan, whichever parallel field the next layout changes (a key missing a field the
figures read would hand the new layout the old layout's memory or FLOPs)."""

from __future__ import annotations

from dataclasses import fields

from helpers.cli import compose_cfg

from launcher.plan.estimate import make_plan, with_parallel
from launcher.plan.plan_cache import PlanCache
from training.contract.config import ParallelConfig, derived_dp

# One or more changes per ParallelConfig field, each a layout make_plan can plan from the bases below. The cache
# keeps every layout's figures, so for each field some pair of layouts differs in it alone where the figures
# differ too (dropping a field the figures read from their key fails the test).
FULL_1 = {"recompute": "full", "recompute_num_layers": 1}
CHANGES = [
    {"tp": 4},
    {"dp": 1},
    {"auto": True},  # parallel=auto is resolved before a plan: the plan of the layout is the same
    {"auto_pinned": "tp"},  # the record of parallel=auto's pins (an elastic resize re-plans by it): the same plan
    {"dp": 1, "tp": 4},
    {"dp": 1, "cp": 2},
    {"dp": 1, "pp": 4},
    {"pp": 4},
    {"pp": 1},
    {"vpp": 2, "schedule": "interleaved_1f1b"},
    {"schedule": "gpipe"},
    {"cp": 2},
    {"cp": 2, "cp_comm": "all_gather"},
    {"dp": 2},
    {"sp": True},
    {"zero": 0},
    {"zero": 2},
    {"zero": 3},
    {"zero": 3, "pp": 1},
    {"zero": 3, "pp": 1, "zero3_reshard_after_forward": False},
    {"offload": "cpu"},
    {"offload": "nvme", "offload_dir": "/x"},
    {"micro_batch": 2},
    {"global_batch": 32},
    {"recompute": "selective"},
    {"recompute": "full"},
    FULL_1,
    {**FULL_1, "pp": 1},
    {**FULL_1, "vpp": 2, "schedule": "interleaved_1f1b"},
    {**FULL_1, "vpp": 1, "schedule": "interleaved_1f1b"},
    {**FULL_1, "vpp": 2, "schedule": "1f1b"},
    {"vpp": 2, "schedule": "interleaved_1f1b", "microbatch_group_size": 4},  # more chunk micro-batches in flight
    {"allow_tp_across_nodes": True},
    {"bucket_mb": 0.001},
    {"overlap_grad_reduce": False},
    {"overlap_p2p": False},
    {"fp8_all_gather": True},  # on this bf16 zero=1 base the plan is the same; the fp8 zero=3 base below differs
    {"first_stage_layers": 1},  # uneven splits (training/contract/stage_split.py): 1 + 3 layers
    {"last_stage_layers": 1, "pp": 2},
    {"embedding_in_split": True, "loss_in_split": True, "vpp": 3, "schedule": "interleaved_1f1b"},
]
MOE_CHANGES = [{"ep": 2}, {"ep": 4, "pp": 1}, {"ep": 2, "zero": 2}, {"ep": 2, "pp": 1}]


def _base(model: str):
    return compose_cfg(
        f"model={model}",
        "model.vocab_size=250",  # padded to 250 at tp=2, 252 at tp=4: the parameter count depends on tp
        "cluster=dgx_h100",
        "cluster.nodes=1",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.dp=null",
        "parallel.zero=1",
        "parallel.global_batch=16",
    )


def test_cached_plans_equal_fresh_ones_whatever_parallel_field_changes():
    covered = set()
    for model, changes in (("tiny", CHANGES), ("tiny_moe", MOE_CHANGES)):
        base = _base(model)
        cache = PlanCache(base)
        make_plan(base, cache=cache)  # the base layout's figures are in the cache now
        for change in changes:
            cfg = with_parallel(base, **change)
            assert derived_dp(cfg) >= 1, change
            cached, fresh = make_plan(cfg, cache=cache), make_plan(cfg)
            assert cached.to_json() == fresh.to_json(), change
            assert make_plan(base, cache=cache).to_json() == make_plan(base).to_json(), change
            covered |= set(change)
    assert covered == {f.name for f in fields(ParallelConfig)}, "a parallel field no change above tries"


def test_fp8_all_gather_is_in_the_key_on_a_zero3_fp8_base():
    """On a zero=3 fp8 base parallel.fp8_all_gather changes the figures (the FP8 weights gathered at 1 byte:
    zero3_gathered memory and the dp traffic fall): the cached plan of the changed layout is still the fresh one."""
    base = with_parallel(_base("tiny"), zero=3)
    base.train.precision = "fp8"
    cache = PlanCache(base)
    before = make_plan(base, cache=cache)
    cfg = with_parallel(base, fp8_all_gather=True)
    cached, fresh = make_plan(cfg, cache=cache), make_plan(cfg)
    assert cached.to_json() == fresh.to_json()
    assert [s.memory_bytes["zero3_gathered"] for s in fresh.stages] < [
        s.memory_bytes["zero3_gathered"] for s in before.stages
    ]
    assert fresh.comm_bytes["dp"] < before.comm_bytes["dp"]


def test_a_config_with_other_model_objects_bypasses_the_cache():
    base = _base("tiny")
    cache = PlanCache(base)
    make_plan(base, cache=cache)
    other = compose_cfg("model=tiny", "model.hidden_size=128", "cluster=dgx_h100", "cluster.nodes=1", "parallel.tp=2")
    other = with_parallel(other, **{f.name: getattr(base.parallel, f.name) for f in fields(ParallelConfig)})
    assert make_plan(other, cache=cache).to_json() == make_plan(other).to_json()
    assert make_plan(other).params_total != make_plan(base).params_total
