"""DCP's collectives under the rehearsal: each dcp.save is recorded as one `dcp_save` call on the save's group, at
the manager's line (training/rehearse/runner.py RecordingFiles.write; docs/REHEARSAL.md says why DCP's own
exchanges cannot run on the fake backend), so a member that never enters the save is a mismatch there."""

from __future__ import annotations

import os

import pytest
from helpers.cli import compose_cfg

from training.contract.exit_codes import EXIT_OK, EXIT_REHEARSAL_DEFECT
from training.rehearse import checks
from training.rehearse.main import rehearse
from training.rehearse.runner import RecordingFiles

DP2 = (
    "cluster.device=cuda",
    "data=synthetic",
    "train.precision=bf16",
    "parallel.micro_batch=1",
    "model=tiny",
    "parallel.tp=1",
    "parallel.dp=2",
    "parallel.global_batch=4",
    "cluster.gpus_per_node=2",
)


def _rehearse(tmp_path, *overrides):
    cfg = compose_cfg(*DP2, *overrides)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg.run.dir = run_dir
    return rehearse(cfg, run_dir, workers=1, quiet=True, dedup=False)


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_each_save_is_one_dcp_call_on_its_group(tmp_path, monkeypatch, async_save):
    seen: dict = {}
    real = checks.check_matching

    def capture(calls, world):
        seen.update(calls)
        return real(calls, world)

    monkeypatch.setattr(checks, "check_matching", capture)
    doc, code = _rehearse(tmp_path, f"train.async_save={async_save}")
    assert code == EXIT_OK, doc["defects"]
    assert sorted(seen) == [0, 1]
    for calls in seen.values():
        dcp = [c for c in calls if c.op == "dcp_save"]
        assert len(dcp) == 1 and dcp[0].phase == "save", dcp
        assert sorted(dcp[0].group) == [0, 1] and dcp[0].site.startswith("training/checkpoint/manager.py:"), dcp


def test_a_member_that_skips_the_save_is_a_mismatch(tmp_path, monkeypatch):
    real = RecordingFiles.write

    def write(self, state, tmp, rank, *args, **kwargs):
        if rank == 1:
            return None  # rank 1 never enters dcp.save
        return real(self, state, tmp, rank, *args, **kwargs)

    monkeypatch.setattr(RecordingFiles, "write", write)
    doc, code = _rehearse(tmp_path)
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "mismatch" and "dcp_save" in d["message"] and "[save]" in d["message"], d
