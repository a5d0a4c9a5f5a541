"""Elastic resizing (launcher/slurm/elastic.py) of layouts with tp or pp > 1, and with fewer free nodes than
cluster.elastic.min_nodes: the decision an attempt's epilogue takes, on Slurm node states given to it.

- tp=2 x pp=2 on 4 nodes of 2 GPUs (dp=2): a lost node leaves 3 free, whose 6 ranks are no multiple of
  tp x pp = 4, so the next job runs on 2 nodes (dp=1), tp and pp and the global batch kept, gradient
  accumulation doubled; every count it skips is one the planner refuses;
- tp=2 (pp=1) on 3 nodes: one node lost, 2 nodes at dp=2, tp kept;
- fewer free nodes than min_nodes: the next job asks for min_nodes (it waits in the queue for them) and
  never for fewer, and never for a count whose layout is invalid.
"""

from __future__ import annotations

import pytest

from launcher.slurm.elastic import layout_errors, plan_resize
from training.contract.config import Config
from training.contract.layout_text import layout_fields

SUBMITTED = [{"event": "submitted", "nodes": 4}]


def _cfg(nodes=4, tp=2, pp=2, global_batch=8, min_nodes=2) -> Config:
    cfg = Config()
    c, p = cfg.cluster, cfg.parallel
    c.kind, c.partition, c.nodes, c.gpus_per_node = "slurm", "debug", nodes, 2
    p.tp, p.pp, p.sp, p.zero, p.micro_batch, p.global_batch = tp, pp, False, 1, 1, global_batch
    cfg.model.num_layers = 4
    c.elastic.min_nodes, c.elastic.wait_min = min_nodes, 0.0
    return cfg


def _states(**kw):
    return lambda partition: dict(kw)


def test_tp2_pp2_skips_a_node_count_whose_ranks_do_not_divide_tp_x_pp():
    cfg = _cfg()
    assert layout_fields(cfg)["dp"] == 2 and layout_fields(cfg)["grad_accum"] == 4
    assert layout_errors(cfg, 3) and not layout_errors(cfg, 2)  # 6 ranks: no multiple of 4
    r = plan_resize(
        cfg,
        SUBMITTED,
        ["n1", "n2", "n3", "n4"],
        ["n2"],
        ["n2"],
        states_fn=_states(n1="alloc", n2="drng", n3="alloc", n4="alloc"),
        sleep=pytest.fail,
    )
    assert r.event == "shrunk" and r.exclude == ["n2"]
    assert {k: r.new[k] for k in ("nodes", "ranks", "tp", "pp", "dp", "global_batch", "grad_accum")} == {
        "nodes": 2,
        "ranks": 4,
        "tp": 2,
        "pp": 2,
        "dp": 1,
        "global_batch": 8,
        "grad_accum": 8,
    }
    assert "3 of the 4 node(s)" in r.reason  # three were free; the layout took two of them
    assert r.cfg.cluster.nodes == 2 and (r.cfg.parallel.tp, r.cfg.parallel.pp) == (2, 2)


def test_tp2_shrinks_by_one_node_keeping_tp():
    cfg = _cfg(nodes=3, tp=2, pp=1, global_batch=6)
    r = plan_resize(
        cfg,
        [{"event": "submitted", "nodes": 3}],
        ["n1", "n2", "n3"],
        ["n3"],
        ["n3"],
        states_fn=_states(n1="alloc", n2="alloc", n3="down"),
        sleep=pytest.fail,
    )
    assert (r.old["dp"], r.old["grad_accum"]) == (3, 2)
    assert {k: r.new[k] for k in ("nodes", "tp", "pp", "dp", "global_batch", "grad_accum")} == {
        "nodes": 2,
        "tp": 2,
        "pp": 1,
        "dp": 2,
        "global_batch": 6,
        "grad_accum": 3,
    }


@pytest.mark.parametrize("min_nodes", [2, 4])
def test_fewer_free_nodes_than_min_nodes_asks_for_min_nodes_never_fewer(min_nodes):
    cfg = _cfg(min_nodes=min_nodes)
    lost = ["n2", "n3", "n4"]
    r = plan_resize(
        cfg,
        SUBMITTED,
        ["n1", "n2", "n3", "n4"],
        lost,
        lost,
        states_fn=_states(n1="alloc", n2="drng", n3="down", n4="down"),
        sleep=pytest.fail,
    )
    if min_nodes == 4:  # the full count is the minimum: nothing to resize, the job waits for its 4 nodes
        assert r is None
    else:
        assert r.event == "shrunk" and r.new["nodes"] == 2 and r.new["dp"] == 1  # 1 free: waits for 2
        assert "1 of the 4 node(s) the run asks for are free (n1;" in r.reason
        assert not layout_errors(cfg, r.new["nodes"])
