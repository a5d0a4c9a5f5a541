"""Checkpoint storage and manager behaviour in one process (stand-in model, real optimizer, no spawn):
atomic commit, keep-last-K, verification of a truncated shard, full disk, resume modes, config changes, async."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers.checkpoint import fill, resumed_value, save_steps, setup_run

from training.checkpoint import CheckpointError, CheckpointManager, storage
from training.checkpoint.layout import flat_range_rects
from training.contract.rundir.events import read_events
from training.parallel.mesh import ProcessMesh


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
    save_steps(run, [1, 2, 3, 4], keep_last=2)
    assert storage.list_steps(run) == [4, 3] and storage.read_latest(run) == 4
    assert sorted(os.listdir(storage.checkpoints_dir(run))) == ["latest", "step_3", "step_4"]
    assert storage.verify(storage.step_dir(run, 4)).ok
    assert resumed_value(run) == (4, 4.0)
    assert [e["step"] for e in read_events(run) if e["event"] == "checkpoint"] == [1, 2, 3, 4]


def test_truncated_newest_shard_falls_back_to_previous(tmp_path):
    run = str(tmp_path)
    save_steps(run, [1, 2])
    newest = storage.step_dir(run, 2)
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    path = os.path.join(newest, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    problems = storage.verify(newest).problems
    assert problems and shard in problems[0]
    assert resumed_value(run) == (1, 1.0)
    bad = [e for e in read_events(run) if e["event"] == "checkpoint_invalid"]
    assert bad and bad[0]["step"] == 2
    with pytest.raises(CheckpointError, match="step_2 is damaged"):
        resumed_value(run, resume="2")


def test_resume_modes_and_changed_model_shape(tmp_path):
    run = str(tmp_path)
    save_steps(run, [1, 2])
    assert resumed_value(run, resume="none") is None
    assert resumed_value(run, resume="1") == (1, 1.0)
    with pytest.raises(CheckpointError, match="no checkpoint step_7.*available: \\[2, 1\\]"):
        resumed_value(run, resume="7")
    cfg, model, opt, _ = setup_run(run)
    cfg.model.hidden_size = 128
    with pytest.raises(CheckpointError, match="model.hidden_size: checkpoint 64, now 128.*train.resume=none"):
        CheckpointManager(run, ProcessMesh.single(), cfg).maybe_resume([model], opt, {})


def test_async_save_commits_after_wait_and_copies_first(tmp_path):
    run = str(tmp_path)
    cfg, model, opt, ck = setup_run(run, async_save=True)
    fill(model, opt, 3.0)
    stats = ck.save(3, [model], opt, {"consumed_samples": 24})
    fill(model, opt, 9.0)  # changed right after the call returned: the checkpoint must hold 3.0
    ck.wait()
    assert stats.total_s >= stats.blocked_s > 0
    assert resumed_value(run) == (3, 3.0)


def test_full_disk_is_a_clear_error_and_keeps_previous(tmp_path):
    mnt = str(tmp_path / "small")
    os.makedirs(mnt)
    # One checkpoint of the stand-in model is a few KB; 1 MB holds the first save but not a bigger second one.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    try:
        run = os.path.join(mnt, "run")
        save_steps(run, [1])
        with open(os.path.join(mnt, "filler"), "wb") as f:  # leave less free space than one checkpoint
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            f.write(b"\0" * max(0, free - 4096))
        with pytest.raises(CheckpointError, match="No space left.*free space.*step_1\\) is untouched"):
            save_steps(run, [2])
        assert storage.list_steps(run) == [1] and storage.verify(storage.step_dir(run, 1)).ok
        assert not [n for n in os.listdir(storage.checkpoints_dir(run)) if n.startswith(".tmp")]
        assert resumed_value(run) == (1, 1.0)
    finally:
        subprocess.run(["umount", mnt])


def test_damaged_shard_that_passes_the_size_check_is_a_clear_error(tmp_path):
    # Every shard has a CRC32 now, whatever its size (computed while writing): damage that keeps the size is
    # caught by verify. Damage that happened before the manifest was sealed (the manifest rewritten to match)
    # passes verify and must still end in a CheckpointError naming the fix, not in DCP's traceback.
    run = str(tmp_path)
    save_steps(run, [1])
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
        resumed_value(run)
