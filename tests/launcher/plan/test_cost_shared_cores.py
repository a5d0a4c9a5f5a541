"""Issue 28: CPU ranks that share fewer cores than there are ranks (launcher/plan/cost_model.py shared_cores_s,
the probe's `cores`): a pipeline's bubble costs nothing when the waiting rank's core goes to the busy one, while
a layout whose ranks all compute at once keeps its step; and calibration runs write no checkpoint
(train.checkpointing=false, checked by validate)."""

from __future__ import annotations

import pytest
from helpers.cli import compose_cfg

from launcher.launch.calibrate import _run_config
from launcher.plan.cost_model import Rates, shared_cores_s
from launcher.plan.estimate import make_plan
from launcher.plan.validate import validate

SMALL = (
    "data=synthetic",
    "model.num_layers=4",
    "model.hidden_size=128",
    "model.seq_length=128",
    "cluster.gpus_per_node=2",
    "parallel.global_batch=16",
    "parallel.sp=false",
)
PIPELINE = ("parallel.tp=1", "parallel.pp=2", "parallel.dp=1", "parallel.micro_batch=16", "parallel.zero=0")
DATA_PARALLEL = ("parallel.tp=1", "parallel.pp=1", "parallel.dp=2", "parallel.micro_batch=8", "parallel.zero=1")


def _rates(cores: float) -> Rates:
    return Rates(
        flops=2e10, intra_bw=1e9, inter_bw=1e9, latency_s=1e-3, overhead_s=1e-3, optimizer_s_per_param=1e-8, cores=cores
    )


def _parts(layout, cores: float):
    return make_plan(compose_cfg(*SMALL, *layout), rates=_rates(cores)).predicted_step_parts_s


def test_dedicated_cores_change_nothing():
    for layout in (PIPELINE, DATA_PARALLEL):
        assert "shared_cores" not in _parts(layout, 0.0)
        assert _parts(layout, 2.0) == _parts(layout, 0.0)  # as many cores as ranks


def test_one_core_for_two_ranks_takes_a_single_micro_batch_pipelines_bubble_off():
    own, shared = _parts(PIPELINE, 0.0), _parts(PIPELINE, 1.0)
    assert own["bubble"] == pytest.approx(own["compute"])  # one micro-batch over two stages: a full bubble
    # Each stage runs alone at twice the shared rate: the step is the mean stage's work plus its communication,
    # so the bubble goes, and the last stage's output layer counts for half (it is one stage's work of two).
    assert -1.1 * own["bubble"] < shared["shared_cores"] < -0.9 * own["bubble"]
    plan = make_plan(compose_cfg(*SMALL, *PIPELINE), rates=_rates(1.0))
    assert plan.predicted_step_s == pytest.approx(sum(v for k, v in shared.items() if k != "recompute"))


def test_one_core_for_two_ranks_leaves_data_parallel_work_as_it_is():
    own, shared = _parts(DATA_PARALLEL, 0.0), _parts(DATA_PARALLEL, 1.0)
    assert shared.get("shared_cores", 0.0) == pytest.approx(0.0, abs=1e-12)  # both ranks compute all the time
    assert sum(shared.values()) == pytest.approx(sum(own.values()))


def test_shared_cores_bounds():
    parts = {"compute": 1.0, "bubble": 1.0, "optimizer": 0.1, "pp": 0.2, "recompute": 0.0}
    assert shared_cores_s(parts, 1.0, 2, 0.0) == 0.0
    assert shared_cores_s(parts, 1.0, 2, 2.0) == 0.0
    # critical path at the alone speed: (1 + 1 + 0.1) / 2 + 0.2 = 1.25; the mean rank's work 1 + 0.1 + 0.2 = 1.3
    assert shared_cores_s(parts, 1.0, 2, 1.0) == pytest.approx(1.3 - 2.3)
    # the critical path wins when the ranks get nearly a core each
    assert shared_cores_s(parts, 1.0, 2, 1.9) == pytest.approx((2.1 * 1.9 / 2 + 0.2) - 2.3)


def test_calibration_runs_write_no_checkpoint_and_validate_rejects_saving_without_checkpointing():
    cfg = compose_cfg(*SMALL, *DATA_PARALLEL)
    run = _run_config(cfg, cfg, "/tmp/unused", 4)
    assert run.train.checkpointing is False and not validate(run).errors
    bad = compose_cfg(*SMALL, *DATA_PARALLEL, "train.checkpointing=false", "train.checkpoint_every=5")
    errors = validate(bad).errors
    assert [i.key for i in errors] == ["train.checkpoint_every"]
    assert "train.checkpointing=false" in errors[0].message and "train.checkpoint_every=0" in errors[0].fix
