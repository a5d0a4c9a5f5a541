"""Checkpoint resharding with a hand-made tp-sharded model and the real DistributedOptimizer.

Every tensor's global value is a known function of (name, position), so after saving with one layout and
loading with another, each rank's local weights and Adam states must equal the slice that layout expects,
exactly; vocabulary padding rows (which depend on tp) must stay zero.

One 4-rank spawn saves at tp=2 x dp=2 zero=1 and then loads the other 4-rank layouts in the same ranks (a launch
is the expensive part); the single-process load runs in this process.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.checkpoint import build, expected_flat, global_value, load_check, local_slice
from helpers.dist import run_distributed

from training.checkpoint import storage

LAYOUTS = [(4, 1, 1), (1, 4, 1), (2, 2, 0)]  # (tp, dp, zero), loaded after the tp=2 x dp=2 zero=1 save


def _save_then_load(run_dir):
    """tests/helpers/checkpoint.py's save_worker (without tearing the world down), then load_check of every
    LAYOUTS entry once every rank's save has returned (a failed check raises in its rank: the spawn fails with
    that rank's traceback). Returns the layouts checked."""
    import torch
    import torch.distributed as dist

    from training.checkpoint import CheckpointManager

    tp, dp, zero = 2, 2, 1
    mesh, cfg, model, opt = build(tp, dp, zero)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(local_slice(global_value(n, "w"), n, tp, mesh.tp_rank))
    opt.exp_avg.copy_(expected_flat(opt, "m", tp, mesh.tp_rank))
    opt.exp_avg_sq.copy_(expected_flat(opt, "v", tp, mesh.tp_rank))
    opt.step_count = 7
    CheckpointManager(run_dir, mesh, cfg).save(5, [model], opt, {"consumed_samples": 40, "note": "x"}, reason="test")
    dist.barrier()
    loads = []
    for layout in LAYOUTS:
        load_check(run_dir, *layout)
        loads.append(layout)
    mesh.destroy()  # the one process group, and with it every layout's groups
    return loads


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    return run_dir, run_distributed(_save_then_load, 4, args=(run_dir,), timeout_s=300)


@pytest.fixture(scope="module")
def saved(spawned):
    return spawned[0]


def test_saved_checkpoint_is_committed_and_verifies(saved):
    ck = storage.checkpoints_dir(saved)
    assert storage.read_latest(saved) == 5 and storage.list_steps(saved) == [5]
    assert storage.verify(storage.step_dir(saved, 5)).ok
    assert not [n for n in os.listdir(ck) if n.startswith(".tmp")]
    with open(os.path.join(storage.step_dir(saved, 5), storage.STATE)) as f:
        state = json.load(f)
    assert state["layout"]["tp"] == 2 and state["consumed_samples"] == 40


def test_load_single_process_tp1_zero0(saved):
    load_check(saved, 1, 1, 0)


def test_load_other_layouts_tp4_dp4_zero0(spawned):
    _, per_rank = spawned
    assert per_rank == [LAYOUTS] * 4  # every rank checked every layout (a failed check fails the spawn)
