"""The run directory's map (training/contract/rundir/paths.py): every file and folder a real run leaves in run.dir
is named by RunPaths, and RUN_FILES (the names checked for planted links before a launch) covers every
top-level one.

One tiny local CPU run (one rank, two steps, a checkpoint, TensorBoard, a profiled step and the NVTX counts)
started as a user starts it, `python -m launcher`.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import ROOT
from helpers.local_run import PYTHON, TINY_RUN

from training.contract.rundir.files import RUN_FILES
from training.contract.rundir.paths import RunPaths, top_level_names

STEPS = 2


def _named(paths: RunPaths, ranks: int, attempts: int, steps: list[int]) -> set[str]:
    """Every path RunPaths gives for this run: each property, each method for its ranks, attempts and steps."""
    named: set[str] = set()
    for attr, value in vars(RunPaths).items():
        if isinstance(value, property):
            named.add(getattr(paths, attr))
    for rank in range(ranks):
        named |= {
            paths.rank_log(rank),
            paths.preflight_log(rank),
            paths.profile_trace(rank),
            paths.memory_snapshot(rank),
            paths.nvtx_counts(rank),
        }
        for n in range(attempts):
            named |= {paths.rank_record(n, rank), paths.rank_cause(n, rank)}
    for n in range(attempts):
        named |= {paths.attempt(n), paths.prologue(n), paths.epilogue_pid(n)}
    named |= {paths.checkpoint(step) for step in steps}
    return named


@pytest.mark.slow
def test_every_file_of_a_run_is_named_by_run_paths(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [
            PYTHON,
            "-m",
            "launcher",
            f"run.dir={run}",
            *TINY_RUN,
            "cluster=local",
            "cluster.peak_tflops=1",
            f"train.steps={STEPS}",
            f"train.profile_steps=[{STEPS},{STEPS}]",
            "train.nvtx=true",
        ],
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    paths = RunPaths(str(run))
    named = _named(paths, ranks=1, attempts=1, steps=[STEPS])
    # Folders whose files another writer names: a checkpoint's shards and manifest (training/checkpoint/), and
    # TensorBoard's event files (their names carry a time and a host).
    opaque = {paths.checkpoint(STEPS), paths.tensorboard}

    left: list[str] = []
    for root, dirs, files in os.walk(run):
        for name in dirs + files:
            full = os.path.join(root, name)
            if any(full.startswith(folder + os.sep) for folder in opaque):
                continue
            left.append(full)
    unnamed = sorted(os.path.relpath(f, run) for f in left if f not in named)
    assert not unnamed, f"files of run.dir that RunPaths does not name: {unnamed}"
    # What this run is for: a checkpoint, its `latest`, the rank's log, the profile files.
    for must in (paths.latest, paths.rank_log(0), paths.profile_trace(0), paths.nvtx_counts(0), paths.summary):
        assert must in left, must

    top = sorted(os.listdir(run))
    assert set(top) <= set(RUN_FILES), sorted(set(top) - set(RUN_FILES))


def test_run_files_are_the_maps_top_level_names():
    assert RUN_FILES == top_level_names()
    assert len(set(RUN_FILES)) == len(RUN_FILES)
    assert all(os.sep not in name for name in RUN_FILES)
    # The folders a launch writes into are among them; `attempts`, which nothing creates, is not.
    assert {"logs", "checkpoints", "slurm", "tensorboard", "profile", "report", "code"} <= set(RUN_FILES)
    assert "attempts" not in RUN_FILES
    paths = RunPaths("/r")
    assert paths.attempt(3) == "/r/slurm/attempt_3"
    assert paths.rank_log(1) == "/r/logs/rank_1.log"
    assert paths.latest == "/r/checkpoints/latest"
