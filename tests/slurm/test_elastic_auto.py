"""Elastic resizing of a run whose layout parallel=auto chose (launcher/slurm/elastic.py, launcher/recommend/auto.py
replan), with the planner and Slurm node states given to the decision (no cluster):

- config.json records that parallel=auto chose the layout and which keys the command line pinned
  (parallel.auto_pinned); a named preset records nothing (null);
- an 8-node llama3_8b / llama3_70b auto run on dgx_h100 that can get only 4 nodes is re-planned there by the same
  rule (the layout parallel=auto chooses on 4 nodes, global batch kept), the chosen layout fits, plan.json's `auto`
  and the `shrunk` event's `replanned` say what and why; growing back to 8 nodes chooses the first layout again.
  llama3_70b's 8-node layout (tp2 x pp8 x cp4 = 64 ranks) cannot shrink by dp at all: only the re-plan reaches
  4 nodes, and elastic_checks accepts min_nodes=4 for the auto run but not for the same layout given by hand;
- a pinned key stays through the re-plan;
- a named preset's run only shrinks dp (today's rule).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers.cli import compose_cfg, meshrun

from launcher.plan.validate import validate
from launcher.recommend.auto import choose
from launcher.slurm.elastic import apply_resize, elastic_checks, layout_errors, plan_resize
from training.contract.config import Config
from training.contract.layout_text import layout_fields
from training.contract.rundir.events import read_events

NODES = [f"n{i}" for i in range(1, 9)]
SUBMITTED = [{"event": "submitted", "nodes": 8}]


def _auto(model: str, *extra: str) -> Config:
    """The config an 8-node parallel=auto launch writes into config.json (with cluster.elastic.min_nodes=4)."""
    over = [f"model={model}", "cluster=dgx_h100", "cluster.nodes=8", "cluster.elastic.min_nodes=4", *extra]
    choice = choose(compose_cfg(*over), over)
    assert choice is not None and choice.chosen is not None
    return choice.cfg


def _four_free(partition):
    """Four of the eight nodes drained: the next job can get only four."""
    return {n: ("alloc" if i < 4 else "drain") for i, n in enumerate(NODES)}


def _all_free(partition):
    return {n: "idle" for n in NODES}


def _shrink(cfg: Config):
    return plan_resize(cfg, SUBMITTED, NODES, NODES[4:], NODES[4:], states_fn=_four_free, sleep=pytest.fail)


def _keys(lay):
    return {k: lay[k] for k in ("tp", "pp", "cp", "dp", "zero", "micro_batch")}


def test_config_json_records_the_pins_of_an_auto_layout_and_null_for_a_preset(tmp_path):
    common = ("action=plan", "model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=8")
    p = meshrun(*common, "parallel.tp=2", f"run.dir={tmp_path / 'auto'}", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())["parallel"]
    assert saved["auto"] is False and saved["auto_pinned"] == "tp" and saved["tp"] == 2
    named = ("parallel=tp2", "parallel.zero=1", "parallel.global_batch=128", f"run.dir={tmp_path / 'named'}")
    q = meshrun(*common, *named, cwd=str(tmp_path))
    assert q.returncode == 0, q.stderr
    assert json.loads((tmp_path / "named" / "config.json").read_text())["parallel"]["auto_pinned"] is None


@pytest.mark.parametrize("model", ["llama3_8b", "llama3_70b"])
def test_auto_run_shrunk_from_8_to_4_nodes_is_replanned_and_grows_back(tmp_path, model):
    cfg = _auto(model)
    assert cfg.parallel.auto_pinned == ""  # parallel=auto with nothing pinned
    r = _shrink(cfg)
    assert r.event == "shrunk" and r.new["nodes"] == 4 and r.replanned is not None
    # The same rule on 4 nodes: what a fresh parallel=auto launch there chooses, at the run's global batch.
    fresh = _auto(model, "cluster.nodes=4", f"parallel.global_batch={cfg.parallel.global_batch}")
    assert _keys(r.new) == _keys(layout_fields(fresh))
    assert r.new["global_batch"] == r.old["global_batch"] == cfg.parallel.global_batch
    report = validate(r.cfg)
    assert not report.errors and report.plan is not None and report.plan.fits
    assert r.cfg.parallel.auto_pinned == "" and r.cfg.parallel.auto is False  # still re-planned next time
    assert r.replanned["chosen"]["layout"] in r.reason and r.replanned["why"]
    assert r.replanned["pinned"] == {"global_batch": cfg.parallel.global_batch}
    if model == "llama3_70b":  # tp x pp x cp of the 8-node layout fills 64 ranks: dp alone cannot shrink it
        mp = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
        assert mp > 32 and r.new["tp"] * r.new["pp"] * r.new["cp"] <= 32
        assert not layout_errors(cfg, 4)  # the re-plan is what makes 4 nodes valid
    # Recorded: config.json (the new layout, the record kept), plan.json's `auto`, the `shrunk` event.
    apply_resize(str(tmp_path), r, new_job_id="2")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["cluster"]["nodes"] == 4 and saved["parallel"]["auto_pinned"] == ""
    assert (saved["parallel"]["tp"], saved["parallel"]["pp"]) == (r.new["tp"], r.new["pp"])
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["fits"] and plan["auto"]["chosen"]["layout"] == r.replanned["chosen"]["layout"]
    (event,) = [e for e in read_events(str(tmp_path)) if e["event"] == "shrunk"]
    assert event["replanned"]["chosen"]["layout"] == r.replanned["chosen"]["layout"]
    assert "parallel=auto re-planned 4 node(s)" in event["replanned"]["text"]
    # Growing back to the full count chooses the first layout again.
    g = plan_resize(r.cfg, SUBMITTED, NODES[:4], NODES[4:], states_fn=_all_free, sleep=pytest.fail)
    assert g.event == "grown" and g.new == layout_fields(cfg) and g.replanned is not None


def test_auto_layout_passes_elastic_checks_where_the_same_layout_given_by_hand_is_refused():
    cfg = _auto("llama3_70b")
    assert elastic_checks(cfg) == []  # 4 to 7 nodes: each re-planned, each fits
    given = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, auto_pinned=None))
    errors = elastic_checks(given)
    assert len(errors) == 1 and "not a multiple of tp x pp x cp" in errors[0]


def test_pinned_keys_stay_through_the_replan():
    cfg = _auto("llama3_70b", "parallel.tp=8")
    assert cfg.parallel.auto_pinned == "tp" and cfg.parallel.tp == 8
    r = _shrink(cfg)
    assert r.replanned is not None and r.new["tp"] == 8 and r.new["nodes"] == 4
    assert r.replanned["pinned"] == {"tp": 8, "global_batch": cfg.parallel.global_batch}
    assert "kept parallel.tp=8 parallel.global_batch=" in r.reason
    assert not validate(r.cfg).errors


def test_named_preset_run_only_shrinks_dp():
    cfg = compose_cfg(
        "model=llama3_8b",
        "cluster=dgx_h100",
        "cluster.nodes=8",
        "cluster.elastic.min_nodes=4",
        "parallel=tp2",
        "parallel.zero=1",
    )
    assert cfg.parallel.auto is False and cfg.parallel.auto_pinned is None
    cfg.parallel.global_batch = 128
    r = _shrink(cfg)
    assert r.event == "shrunk" and r.replanned is None and "parallel=auto" not in r.reason
    assert {k: r.new[k] for k in ("tp", "pp", "cp", "zero", "micro_batch", "global_batch")} == {
        k: r.old[k] for k in ("tp", "pp", "cp", "zero", "micro_batch", "global_batch")
    }
    assert (r.old["dp"], r.new["dp"]) == (32, 16)
