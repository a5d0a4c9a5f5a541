"""Checkpoint resharding with a hand-made tp-sharded model and the real DistributedOptimizer.

Every tensor's global value is a known function of (name, position), so after saving with one layout and
loading with another, each rank's local weights and Adam states must equal the slice that layout expects,
exactly; vocabulary padding rows (which depend on tp) must stay zero.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers.checkpoint import load_check, load_worker, save_worker
from helpers.dist import run_distributed
from training.checkpoint import storage


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    run_distributed(save_worker, 4, args=(run_dir, 2, 2, 1), timeout_s=180)
    return run_dir


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


def test_load_other_layouts_tp4_dp4_zero0(saved):
    run_distributed(load_worker, 4, args=(saved, [(4, 1, 1), (1, 4, 1), (2, 2, 0)]), timeout_s=300)
