"""Checkpoint trust boundary and history, in one process (stand-in model, real optimizer and DCP files):

- `.metadata` is read with a restricted unpickler: a crafted pickle that would run a command is refused with
  a message, and the command never runs; a metadata that points a tensor outside its directory is refused;
- a manifest path outside the checkpoint directory, or a symlink inside it, makes the checkpoint invalid;
- every file's CRC32 is in the manifest, computed while the shard was written (no re-read);
- resume follows `latest` and its history: a rollback (train.resume=<step> or none) is never undone by a later
  `auto`, and the checkpoints past it are moved to checkpoints/abandoned/, never deleted; pruning keeps the
  newest keep_last of the line.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
from helpers.checkpoint import RunsCommand, fill, reseal, resumed_value, save_steps, setup_run

from training.checkpoint import CheckpointError, storage
from training.contract.rundir.events import read_events
from training.contract.rundir.paths import RunPaths


def _resume_and_save(run_dir, steps, **train):
    """What the loop does: resume (auto), then save; each save continues the line it resumed."""
    cfg, model, opt, ck = setup_run(run_dir, **train)
    ck.maybe_resume([model], opt, {"consumed_samples": 0})
    for s in steps:
        fill(model, opt, float(s))
        ck.save(s, [model], opt, {"consumed_samples": 8 * s})
    ck.wait()


def _abandoned(run):
    base = os.path.join(storage.checkpoints_dir(run), storage.ABANDONED)
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def test_crafted_metadata_pickle_is_refused_and_never_runs(tmp_path):
    run = str(tmp_path / "run")
    canary = tmp_path / "canary"
    save_steps(run, [1])
    newest = storage.step_dir(run, 1)
    with open(os.path.join(newest, storage.DCP_METADATA), "wb") as f:
        pickle.dump(RunsCommand(f"touch {canary}"), f)
    reseal(newest)
    assert storage.verify(newest).ok  # the manifest matches: only the unpickler stands in the way
    with pytest.raises(CheckpointError) as err:
        resumed_value(run)
    msg = str(err.value)
    assert "posix.system" in msg and "nothing in it ran" in msg and "train.resume" in msg, msg
    assert not canary.exists()
    # The same bytes through plain pickle would have run it: the test's payload is real.
    with open(os.path.join(newest, storage.DCP_METADATA), "rb") as f:
        pickle.load(f)
    assert canary.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    run = str(tmp_path / "run")
    save_steps(run, [1])
    newest = storage.step_dir(run, 1)
    path = os.path.join(newest, storage.DCP_METADATA)
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # a genuine metadata file, written by DCP a moment ago
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    reseal(newest)
    with pytest.raises(CheckpointError, match="points a tensor at '../../../etc/passwd', outside"):
        resumed_value(run)


def test_manifest_path_outside_and_symlink_inside_are_invalid(tmp_path):
    run = str(tmp_path / "run")
    save_steps(run, [1, 2, 3], keep_last=5)
    # step_3: the manifest names a file outside the directory.
    s3 = storage.step_dir(run, 3)
    with open(os.path.join(s3, storage.MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"]["../step_2/state.json"] = {"size": 1, "crc32": 0}
    storage.write_json_durable(os.path.join(s3, storage.MANIFEST), manifest)
    assert "outside the checkpoint directory" in storage.verify(s3).problems[0]
    # step_2: a shard replaced by a symlink to an identical copy elsewhere (sizes and CRCs still match).
    s2 = storage.step_dir(run, 2)
    shard = next(n for n in os.listdir(s2) if n.endswith(".distcp"))
    os.replace(os.path.join(s2, shard), str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), os.path.join(s2, shard))
    assert "symlinks are not allowed" in storage.verify(s2).problems[0]
    # auto skips both (each reported) and resumes step_1; naming one explicitly is an error.
    assert resumed_value(run) == (1, 1.0)
    assert [e["step"] for e in read_events(run) if e["event"] == "checkpoint_invalid"] == [3, 2]
    with pytest.raises(CheckpointError, match="step_2 is damaged.*symlinks"):
        resumed_value(run, resume="2")


def test_every_shard_checksummed_while_writing(tmp_path, monkeypatch):
    reads = []
    real = storage._crc32
    monkeypatch.setattr(storage, "_crc32", lambda p: reads.append(os.path.basename(p)) or real(p))
    run = str(tmp_path / "run")
    save_steps(run, [1])
    assert sorted(reads) == ["config.json", "state.json"]  # rank 0's own small files only: no shard re-read
    with open(os.path.join(storage.step_dir(run, 1), storage.MANIFEST)) as f:
        files = json.load(f)["files"]
    assert {".metadata", "__0_0.distcp", "state.json", "config.json"} == set(files)
    for rel, entry in files.items():  # the streamed CRC equals one computed from the bytes on disk
        assert entry["crc32"] == real(os.path.join(storage.step_dir(run, 1), rel)), rel
    assert not [n for n in os.listdir(storage.step_dir(run, 1)) if n.startswith("__crc_")]


def test_rollback_is_kept_by_later_auto_and_newer_ones_are_abandoned_not_deleted(tmp_path):
    run = str(tmp_path / "run")
    save_steps(run, [1, 2, 3, 4], keep_last=10)
    assert resumed_value(run, resume="2") == (2, 2.0)
    assert storage.read_latest(run) == 2
    rollback = [e for e in read_events(run) if e["event"] == "rollback"]
    assert rollback and rollback[-1]["step"] == 2 and rollback[-1]["abandoned_steps"] == [4, 3]
    # A later attempt with auto (a requeue) stays on the new line even before its first save.
    assert resumed_value(run) == (2, 2.0)
    # The new line saves step 3 (the abandoned line's step_3 exists) and step 5.
    _resume_and_save(run, [3, 5], keep_last=10)
    assert storage.list_steps(run) == [5, 3, 2, 1] and storage.history(run) == [5, 3, 2, 1]
    moved = _abandoned(run)
    assert [n.split("_")[1] for n in moved] == ["3", "4"], moved
    for name in moved:  # kept whole: each still verifies against its own manifest
        assert storage.verify(os.path.join(storage.checkpoints_dir(run), storage.ABANDONED, name)).ok
    assert resumed_value(run) == (5, 5.0)
    # Pruning keeps `latest` and the keep_last - 1 before it on the line, and never touches abandoned/.
    _resume_and_save(run, [6], keep_last=2)
    assert storage.list_steps(run) == [6, 5] and len(_abandoned(run)) == 2


def test_fresh_start_is_kept_by_later_auto(tmp_path):
    run = str(tmp_path / "run")
    save_steps(run, [1, 2])
    assert resumed_value(run, resume="none") is None
    assert resumed_value(run) is None  # a requeue before the first save must not resume the old line
    assert storage.list_steps(run) == [2, 1]  # nothing moved or deleted yet
    save_steps(run, [1], keep_last=3)
    assert storage.list_steps(run) == [1] and [n.split("_")[1] for n in _abandoned(run)] == ["1", "2"]
    assert resumed_value(run) == (1, 1.0)


def test_history_without_latest_or_previous_falls_back_to_directories(tmp_path):
    """Run dirs of an older meshrun: no `previous` in the manifests; `latest` lost: newest directory first."""
    run = str(tmp_path / "run")
    save_steps(run, [1, 2, 3], keep_last=5)
    for step in (1, 2, 3):
        path = os.path.join(storage.step_dir(run, step), storage.MANIFEST)
        with open(path) as f:
            manifest = json.load(f)
        del manifest["previous"]
        storage.write_json_durable(path, manifest)
    assert storage.history(run) == [3, 2, 1]
    os.remove(RunPaths(run).latest)
    assert storage.candidates(run) == [3, 2, 1]
