"""Uneven pipeline stages in the planner (training/contract/stage_split.py, launcher/plan/): each stage's memory
from its own layers, the fit decided on the worst stage, plan.json `stage_layers`, the table's per-rank layers;
the Llama-3-405B shape (126 layers) on the large H100 preset at tp8 pp16, with and without vpp, at 8K and at
128K context with cp; action=recommend and parallel=auto finding the uneven layouts."""

from __future__ import annotations

import json

import pytest
from helpers.cli import compose_cfg, run_cli

from launcher.plan.estimate import format_plan, make_plan, with_parallel
from launcher.plan.model_size import params_total, rank_layers, stage_params
from launcher.plan.validate import validate
from training.contract.stage_split import split_options

L405 = (
    "model=llama3_405b",
    "cluster=h100_roce_large",
    "parallel=default",
    "parallel.tp=8",
    "parallel.pp=16",
    "parallel.sp=true",
    "parallel.zero=1",
    "parallel.dp=null",
    "parallel.micro_batch=1",
)
SPLIT = ("parallel.embedding_in_split=true", "parallel.loss_in_split=true")
FIRST_LAST = ("parallel.first_stage_layers=7", "parallel.last_stage_layers=7")
VPP2 = ("parallel.vpp=2", "parallel.schedule=interleaved_1f1b")
LONG = ("model.seq_length=131072", "parallel.cp=16", "cluster.nodes=256", "parallel.global_batch=16")
SHORT = ("cluster.nodes=32", "parallel.global_batch=64")


def test_405b_preset_has_the_published_shape():
    m = compose_cfg(*L405, *SHORT, *SPLIT).model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == (
        126,
        16384,
        53248,
        128,
        8,
    )
    assert (m.vocab_size, m.rope_base, m.norm, m.activation, m.tie_embeddings) == (
        128256,
        500000.0,
        "rmsnorm",
        "swiglu",
        False,
    )
    assert 405e9 < params_total(compose_cfg(*L405, *SHORT, *SPLIT)) < 406e9
    c = compose_cfg(*L405, *SHORT).cluster
    assert c.gpus_per_node == 8 and c.preflight.busbw_inter_gbps == 400  # 8 x 400 Gb/s per node


def test_even_split_of_126_layers_at_pp16_is_refused_with_the_split_that_works():
    report = validate(compose_cfg(*L405, *SHORT, "parallel.recompute=full"))
    (err,) = [i for i in report.errors if i.key == "parallel.pp"]
    assert "num_layers=126 is not divisible by pp x vpp = 16 x 1" in err.message
    assert "parallel.embedding_in_split=true parallel.loss_in_split=true" in err.fix
    assert "parallel.first_stage_layers=7 parallel.last_stage_layers=7" in err.fix


@pytest.mark.parametrize(
    "name,extra,counts",
    [
        ("8k", SHORT + SPLIT, [7] + [8] * 14 + [7]),
        ("8k first/last", SHORT + FIRST_LAST, [7] + [8] * 14 + [7]),
        ("8k vpp2", SHORT + SPLIT + VPP2, [3] + [4] * 30 + [3]),
        ("128k cp16", LONG + SPLIT, [7] + [8] * 14 + [7]),
    ],
)
def test_405b_plans_at_tp8_pp16_and_says_what_fits(name, extra, counts):
    cfg = compose_cfg(*L405, *extra, "parallel.recompute=full")
    report = validate(cfg)
    assert not report.errors, (name, [(i.key, i.message) for i in report.errors])
    plan = report.plan
    assert plan is not None and plan.fits, name
    assert plan.stage_layers == counts and sum(counts) == 126
    # each stage's memory is its own layers': the first and last rank hold 7, the middle ones 8
    assert [st.layers for st in plan.stages] == rank_layers(cfg) == [7] + [8] * 14 + [7]
    totals = [st.memory_bytes["total"] for st in plan.stages]
    assert plan.memory_bytes["total"] == max(totals) and plan.worst_stage == totals.index(max(totals))
    assert plan.fits == (max(totals) + plan.reserve_bytes <= plan.gpu_memory_bytes)
    table = format_plan(plan)
    assert "stage split" in table and "rank 0: 7 layers" in table and "rank 15: 7 layers" in table
    # Without recompute the worst stage does not fit, and the refusal names options that make it fit.
    no_recompute = validate(with_parallel(cfg, recompute="none"))
    (err,) = [i for i in no_recompute.errors if i.code == "no_fit"]
    assert "(fits)" in err.fix and "parallel.recompute=full" in err.fix, err.fix


def test_stage_memory_follows_each_stages_layers():
    base = compose_cfg(
        "model=llama3_70b", "cluster=dgx_h100", "cluster.nodes=4", "parallel=default", "parallel.tp=8", "parallel.pp=4"
    )
    even = make_plan(base)
    uneven = make_plan(with_parallel(base, first_stage_layers=16, last_stage_layers=16))  # 16, 24, 24, 16
    assert [s.layers for s in even.stages] == [20] * 4 and [s.layers for s in uneven.stages] == [16, 24, 24, 16]
    per_layer = stage_params(base, 1).layer_params // 20
    for e, u in zip(even.stages, uneven.stages):
        assert u.params - e.params == (u.layers - e.layers) * per_layer
        assert (u.memory_bytes["activations"] > e.memory_bytes["activations"]) == (u.layers > e.layers)
    # 1F1B: the first stage holds pp micro-batches in flight, so it is the even split's worst; fewer layers there
    # move the worst to stage 1 and lower it (what the split is for)
    assert even.worst_stage == 0 and uneven.worst_stage == 1
    assert uneven.memory_bytes["total"] < even.memory_bytes["total"]
    # the slowest stage paces the pipeline: 24 layers take longer than 20
    assert uneven.predicted_step_parts_s["compute"] > even.predicted_step_parts_s["compute"]
    # an uneven split with the even counts is the even plan
    same = make_plan(with_parallel(base, first_stage_layers=20, last_stage_layers=20))
    assert same.memory_bytes == even.memory_bytes and same.predicted_step_s == even.predicted_step_s
    assert even.split == {} and same.split == {"first_stage_layers": 20, "last_stage_layers": 20}


def test_plan_json_has_stage_layers(tmp_path):
    r = run_cli("action=plan", "model=tiny", "parallel.pp=2", "parallel.first_stage_layers=1", f"run.dir={tmp_path}/p")
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "p" / "plan.json") as f:
        plan = json.load(f)
    assert plan["stage_layers"] == [1, 3] and [s["layers"] for s in plan["stages"]] == [1, 3]
    assert plan["split"] == {"first_stage_layers": 1}
    assert "rank 0: 1 layer," in r.stdout and "rank 1: 3 layers" in r.stdout


def test_split_options_try_the_even_split_first_then_megatrons_forms():
    assert split_options(128, 16, 1) == [{}]
    assert split_options(126, 16, 1) == [{"embedding_in_split": True, "loss_in_split": True}]
    assert split_options(126, 16, 2) == [{"embedding_in_split": True, "loss_in_split": True}]
    assert split_options(7, 2, 1) == [{"embedding_in_split": True}]  # first_stage_layers=3: the same 3 + 4
    assert split_options(26, 5, 1) == [{"first_stage_layers": 4, "last_stage_layers": 4}]  # 4 + 6 x 3 + 4
    assert split_options(96, 64, 1) == []  # no split worth searching


def test_recommend_and_auto_find_uneven_405b_layouts(tmp_path):
    args = ("model=llama3_405b", "cluster=h100_roce_large", "cluster.nodes=16", "parallel.global_batch=16")
    r = run_cli("action=recommend", *args, "recommend.probe=false", f"run.dir={tmp_path}/r", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "r" / "recommend.json") as f:
        cands = [c for c in json.load(f)["candidates"] if c["fits"]]
    at_pp16 = [c for c in cands if c["pp"] == 16]
    assert at_pp16, "no pp16 layout of 126 layers fits"
    for c in at_pp16:  # 126 layers over 16 stages: only with a split
        lay = c
        assert lay["embedding_in_split"] or lay["first_stage_layers"], lay
        assert "parallel.embedding_in_split=true" in c["overrides"] or "parallel.first_stage_layers=" in c["overrides"]
    assert any(c["pp"] == 16 and c["vpp"] > 1 for c in at_pp16)
    # parallel=auto (the preset's default) runs the same search and plans the chosen split
    p = run_cli("action=plan", *args, "parallel.tp=8", "parallel.pp=16", f"run.dir={tmp_path}/p", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(tmp_path / "p" / "plan.json") as f:
        plan = json.load(f)
    assert plan["pp"] == 16 and plan["fits"] and sum(plan["stage_layers"]) == 126
    assert plan["split"] and "parallel.pp=16" in plan["auto"]["chosen"]["overrides"]


def test_auto_keeps_a_split_the_command_line_gives(tmp_path):
    args = ("model=llama3_405b", "cluster=h100_roce_large", "cluster.nodes=16", "parallel.global_batch=16")
    pins = ("parallel.tp=8", "parallel.pp=8", "parallel.first_stage_layers=18", "parallel.last_stage_layers=18")
    p = run_cli("action=plan", *args, *pins, f"run.dir={tmp_path}/p", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(tmp_path / "p" / "plan.json") as f:
        plan = json.load(f)
    assert plan["split"] == {"first_stage_layers": 18, "last_stage_layers": 18}
    assert plan["stage_layers"] == [18] + [15] * 6 + [18]
    assert "parallel.first_stage_layers=18 parallel.last_stage_layers=18" in plan["auto"]["chosen"]["overrides"]


def test_interleaved_peak_counts_unequal_chunks_in_megatrons_order():
    from launcher.plan.memory import _interleaved_peak_layers

    for p, v, m, r in [(4, 2, 8, 0), (4, 2, 8, 3), (2, 3, 6, 1), (4, 2, 4, 0), (8, 4, 16, 5)]:
        warm = (p - r - 1) * 2 + (v - 1) * p  # equal chunks: the plan's in-flight count times the rank's layers
        assert _interleaved_peak_layers([2] * v, p, r, m, p) == 2 * min(m * v, warm + 1)
    # the last rank of pp4 vpp2 with loss_in_split: chunks of 2 and 1 layers; 4 warm-up forwards of chunk 0 and
    # one of chunk 1 (9), then the steady state's forward of chunk 0 comes before the backward of chunk 1 frees one
    # layer's worth: 10, where equal chunks would give 7.5 (the engine's saved bytes agree:
    # tests/engine/test_uneven_stages.py)
    assert _interleaved_peak_layers([2, 1], 4, 3, 8, 4) == 10


def test_layout_texts_carry_the_split_and_compose_back():
    from training.contract.layout_text import format_layout, layout_of

    cfg = compose_cfg(*L405, *SHORT, *FIRST_LAST)
    lay = layout_of(cfg)
    assert "first7 last7" in format_layout(lay, "short")
    over = format_layout(lay, "overrides")
    assert "parallel.first_stage_layers=7 parallel.last_stage_layers=7" in over
    assert "parallel.embedding_in_split=false parallel.loss_in_split=false" in over  # replaces a split given before
    back = compose_cfg(*L405, *SHORT, *SPLIT, *over.split())
    assert layout_of(back) == lay
    even = layout_of(compose_cfg("model=tiny"))
    assert "first_stage_layers" not in format_layout(even, "overrides") and not even.split_set
