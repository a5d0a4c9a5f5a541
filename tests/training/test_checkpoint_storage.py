"""Checkpoint storage and manager behaviour in one process (stand-in model, real optimizer, no spawn):
atomic commit, keep-last-K, verification of a truncated shard, full disk, resume modes, config changes, async."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from test_checkpoint_reshard import StandInModel, _cfg
from training.checkpoint import CheckpointError, CheckpointManager, storage
from training.checkpoint.layout import flat_range_rects
from training.events import read_events
from training.mesh import ProcessMesh
from training.optim import DistributedOptimizer


def _setup(run_dir, **train):
    cfg = _cfg(1, 1, 0)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    model = StandInModel(1, 0)
    mesh = ProcessMesh.single()
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    return cfg, model, opt, CheckpointManager(run_dir, mesh, cfg)


def _fill(model, opt, value):
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.fill_(value)
    opt.exp_avg.fill_(value + 0.5)
    opt.step_count = int(value)


def _save_steps(run_dir, steps, **train):
    cfg, model, opt, ck = _setup(run_dir, **train)
    for s in steps:
        _fill(model, opt, float(s))
        ck.save(s, [model], opt, {"consumed_samples": 8 * s})
    ck.wait()
    return ck


def _resumed_value(run_dir, **train):
    cfg, model, opt, ck = _setup(run_dir, **train)
    got = ck.maybe_resume([model], opt, {"consumed_samples": 0})
    if got is None:
        return None
    value = next(iter(model.parameters())).flatten()[0].item()
    assert opt.exp_avg[0].item() == value + 0.5 and opt.step_count == int(value)
    return got[0], value


def test_flat_range_rects_cover_exactly():
    for shape in [(5,), (3, 4), (2, 3, 4)]:
        t = torch.arange(int(torch.tensor(shape).prod())).view(shape)
        for s in range(t.numel()):
            for e in range(s + 1, t.numel() + 1):
                got = []
                for offs, sizes, flat in flat_range_rects(shape, s, e):
                    piece = t[tuple(slice(o, o + z) for o, z in zip(offs, sizes))]
                    assert piece.flatten()[0].item() == flat
                    got += piece.flatten().tolist()
                assert got == list(range(s, e))


def test_commit_latest_keep_last_and_no_tmp_left(tmp_path):
    run = str(tmp_path)
    _save_steps(run, [1, 2, 3, 4], keep_last=2)
    assert storage.list_steps(run) == [4, 3] and storage.read_latest(run) == 4
    assert sorted(os.listdir(storage.checkpoints_dir(run))) == ["latest", "step_3", "step_4"]
    assert storage.verify(storage.step_dir(run, 4)).ok
    assert _resumed_value(run) == (4, 4.0)
    assert [e["step"] for e in read_events(run) if e["event"] == "checkpoint"] == [1, 2, 3, 4]


def test_truncated_newest_shard_falls_back_to_previous(tmp_path):
    run = str(tmp_path)
    _save_steps(run, [1, 2])
    newest = storage.step_dir(run, 2)
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    path = os.path.join(newest, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    problems = storage.verify(newest).problems
    assert problems and shard in problems[0]
    assert _resumed_value(run) == (1, 1.0)
    bad = [e for e in read_events(run) if e["event"] == "checkpoint_invalid"]
    assert bad and bad[0]["step"] == 2
    with pytest.raises(CheckpointError, match="step_2 is damaged"):
        _resumed_value(run, resume="2")


def test_resume_modes_and_changed_model_shape(tmp_path):
    run = str(tmp_path)
    _save_steps(run, [1, 2])
    assert _resumed_value(run, resume="none") is None
    assert _resumed_value(run, resume="1") == (1, 1.0)
    with pytest.raises(CheckpointError, match="no checkpoint step_7.*available: \\[2, 1\\]"):
        _resumed_value(run, resume="7")
    cfg, model, opt, _ = _setup(run)
    cfg.model.hidden_size = 128
    with pytest.raises(CheckpointError, match="model.hidden_size: checkpoint 64, now 128.*train.resume=none"):
        CheckpointManager(run, ProcessMesh.single(), cfg).maybe_resume([model], opt, {})


def test_async_save_commits_after_wait_and_copies_first(tmp_path):
    run = str(tmp_path)
    cfg, model, opt, ck = _setup(run, async_save=True)
    _fill(model, opt, 3.0)
    stats = ck.save(3, [model], opt, {"consumed_samples": 24})
    _fill(model, opt, 9.0)  # changed right after the call returned: the checkpoint must hold 3.0
    ck.wait()
    assert stats.total_s >= stats.blocked_s > 0
    assert _resumed_value(run) == (3, 3.0)


def test_full_disk_is_a_clear_error_and_keeps_previous(tmp_path):
    mnt = str(tmp_path / "small")
    os.makedirs(mnt)
    # One checkpoint of the stand-in model is a few KB; 1 MB holds the first save but not a bigger second one.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    try:
        run = os.path.join(mnt, "run")
        _save_steps(run, [1])
        with open(os.path.join(mnt, "filler"), "wb") as f:  # leave less free space than one checkpoint
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            f.write(b"\0" * max(0, free - 4096))
        with pytest.raises(CheckpointError, match="No space left.*free space.*step_1\\) is untouched"):
            _save_steps(run, [2])
        assert storage.list_steps(run) == [1] and storage.verify(storage.step_dir(run, 1)).ok
        assert not [n for n in os.listdir(storage.checkpoints_dir(run)) if n.startswith(".tmp")]
        assert _resumed_value(run) == (1, 1.0)
    finally:
        subprocess.run(["umount", mnt])


def test_damaged_shard_that_passes_the_size_check_is_a_clear_error(tmp_path):
    # Every shard has a CRC32 now, whatever its size (computed while writing): damage that keeps the size is
    # caught by verify. Damage that happened before the manifest was sealed (the manifest rewritten to match)
    # passes verify and must still end in a CheckpointError naming the fix, not in DCP's traceback.
    run = str(tmp_path)
    _save_steps(run, [1])
    newest = storage.step_dir(run, 1)
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    path = os.path.join(newest, shard)
    with open(path, "r+b") as f:
        f.write(b"\0" * os.path.getsize(path))
    assert storage.verify(newest).problems == [f"{shard} checksum mismatch"]
    manifest = os.path.join(newest, storage.MANIFEST)
    with open(manifest) as f:
        sealed = json.load(f)
    sealed["files"] = storage.build_manifest(newest)
    storage.write_json_durable(manifest, sealed)
    assert storage.verify(newest).ok
    with pytest.raises(CheckpointError, match="could not be loaded.*train.resume"):
        _resumed_value(run)
