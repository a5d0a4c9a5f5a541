"""Hostile or damaged checkpoint and export files, in one process (stand-in model, real optimizer and DCP files):

- a checkpoint whose `.metadata` declares a tensor as a DCP "bytes" entry pointing at a pickle appended to a
  shard (DCP reads bytes entries with torch.load(weights_only=False)) is refused, and the pickle never runs;
- a save that fails on a full disk keeps ENOSPC and its hint in the message (not cut at the first ". ").
"""

from __future__ import annotations

import errno
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.checkpoint import RunsCommand, reseal, resumed_value, save_steps
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from training.checkpoint import CheckpointError, storage


def _plant_bytes_entry(step_path: str, canary: str) -> str:
    """What the audit did: one tensor key re-declared as bytes, pointing at a pickle appended to a shard."""
    meta_path = os.path.join(step_path, storage.DCP_METADATA)
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # genuine metadata written by DCP a moment ago
    key = sorted(k for k in metadata.state_dict_metadata if k.startswith("model/"))[0]
    shard = sorted(n for n in os.listdir(step_path) if n.endswith(".distcp"))[0]
    payload = pickle.dumps(RunsCommand(f"touch {canary}"))
    offset = os.path.getsize(os.path.join(step_path, shard))
    with open(os.path.join(step_path, shard), "ab") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(relative_path=shard, offset=offset, length=len(payload))
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    reseal(step_path)
    return key


def test_bytes_entry_in_metadata_is_refused_and_its_pickle_never_runs(tmp_path):
    run = str(tmp_path / "run")
    canary = tmp_path / "canary"
    save_steps(run, [1])
    newest = storage.step_dir(run, 1)
    key = _plant_bytes_entry(newest, str(canary))
    assert storage.verify(newest).ok  # the manifest matches: only the reader stands in the way
    with pytest.raises(CheckpointError) as err:
        resumed_value(run)
    msg = str(err.value)
    assert "BytesStorageMetadata" in msg and "nothing in it ran" in msg and "train.resume" in msg, msg
    assert not canary.exists()
    # The reader refuses a bytes read item on its own too (a second line of defence, no unpickler involved).
    from training.checkpoint.safe_read import SafeFileSystemReader

    reader = SafeFileSystemReader(newest)
    with open(os.path.join(newest, storage.DCP_METADATA), "rb") as f:
        reader.storage_data = pickle.load(f).storage_data
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(key),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex(key),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    with pytest.raises(CheckpointError, match="non-tensor .bytes. entries"):
        reader.read_data(LoadPlan([item]), planner=None)
    assert not canary.exists()
    # The same checkpoint through torch's own reader runs the payload: the test's attack is real.
    with pytest.raises(BaseException):  # noqa: B017 - DCP fails after unpickling (its error is a BaseException)
        dcp.load({key: torch.zeros(1)}, storage_reader=dcp.FileSystemReader(newest), no_dist=True)
    assert canary.exists()


def test_short_error_keeps_torch_save_full_disk_message():
    """torch.save onto a full device (/dev/full) fails with "[enforce fail at ...] . unexpected pos": the
    whole line is kept (it was cut at the first ". "), and only torch.load's weights_only advice is dropped."""
    from training.checkpoint.manager import _short

    with pytest.raises(RuntimeError) as err:
        torch.save(torch.zeros(100_000), "/dev/full")
    assert "unexpected pos" in _short(err.value), _short(err.value)
    with pytest.raises(pickle.UnpicklingError) as err:
        torch.load(__import__("io").BytesIO(pickle.dumps(RunsCommand("true"))), weights_only=True)
    assert "weights_only=False" not in _short(err.value) and "Weights only load failed" in _short(err.value)


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs filled to its last few KiB: a real full filesystem (needs the right to mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    try:
        with open(mnt / "fill", "wb") as f:
            f.write(b"\0" * (1024 * 1016))
        yield str(mnt)
    finally:
        os.system(f"umount {mnt}")


def test_save_on_full_disk_names_enospc_and_keeps_previous(full_disk):
    run = os.path.join(full_disk, "run")
    with pytest.raises(CheckpointError) as err:
        save_steps(run, [1])
    msg = str(err.value)
    assert ("ENOSPC" in msg or "No space left" in msg) and "free space under run.dir" in msg, msg
    assert not [n for n in os.listdir(storage.checkpoints_dir(run)) if n.startswith(".tmp_step_")]
    assert os.strerror(errno.ENOSPC) in msg or "ENOSPC" in msg


# ---- the unclear list: each a clear error instead of a traceback ------------------------------------------
def _safetensors(path, header: dict, data: bytes) -> None:
    import json
    import struct

    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_malformed_overlapping_and_unknown_dtype_safetensors_are_hferrors(tmp_path):
    from safetensors.torch import save_file

    from training.hf.hf_config import HFError
    from training.hf.safetensors_index import read_header

    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)}, str(good))
    assert set(read_header(str(good))) == {"a", "b"}  # a real file passes
    cases = {
        "overlap": (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            "overlap",
        ),
        "dtype": ({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, "does not define"),
        "malformed": ({"a": {"dtype": "F32", "shape": "four", "data_offsets": [0, 16]}}, "malformed"),
        "offsets": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}, "malformed"),
        "size": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, "claims bytes 0..12"),
        "list": ([1, 2], "not a JSON object"),
    }
    for name, (header, expect) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        _safetensors(path, header, b"\0" * 32)
        with pytest.raises(HFError, match=expect):
            read_header(str(path))


def test_exported_weights_follow_the_umask_and_a_dangling_output_link_is_refused(tmp_path):
    from training.hf.export import export, write_weights
    from training.hf.hf_config import HFError

    old = os.umask(0o022)
    try:
        write_weights({"w": torch.zeros(4)}, str(tmp_path), 1 << 20)
        assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == 0o644
        os.umask(0o077)
        (tmp_path / "b").mkdir()
        write_weights({"w": torch.zeros(4)}, str(tmp_path / "b"), 1 << 20)
        assert os.stat(tmp_path / "b" / "model.safetensors").st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
    link = tmp_path / "hf_out"
    os.symlink(tmp_path / "nowhere", link)
    with pytest.raises(HFError, match="is a symbolic link to nothing"):
        export(str(tmp_path / "run"), str(link))
    assert not (tmp_path / "nowhere").exists()


def test_events_list_line_is_skipped_and_a_failed_local_run_shows_its_reason(tmp_path):
    from launcher.manage.status import run_status
    from training.contract.rundir.events import append_event, read_events

    run = str(tmp_path / "run")
    append_event(run, "started", launcher_pid=os.getpid(), world_size=1, attempt=0)
    with open(os.path.join(run, "events.jsonl"), "a") as f:
        f.write("[1, 2]\n7\n")
    append_event(run, "failed", rank=0, exit_code=1, reason="rank 0 was killed by SIGKILL; see logs/rank_0.log")
    assert [ev["event"] for ev in read_events(run)] == ["started", "failed"]
    status = run_status(run)
    assert status["state"] == "FAILED" and status["reason"].startswith("rank 0 was killed by SIGKILL"), status


def _forge(step_path: str, case: str) -> None:
    """The hostile audit's L5, L8, L9, L11: DCP's own metadata, edited and resealed as someone who can write
    run.dir would."""
    meta_path = os.path.join(step_path, storage.DCP_METADATA)
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)
    if case == "state_dict_metadata_int":
        metadata.state_dict_metadata = 5
    elif case == "storage_data_list":
        metadata.storage_data = [1, 2]
    elif case == "rank_state_2_40":
        metadata.state_dict_metadata["rank_state/0"].size = torch.Size([2**40])
    elif case == "fifo":
        index = sorted(metadata.storage_data, key=lambda i: i.fqn)[0]
        info = metadata.storage_data[index]
        metadata.storage_data[index] = _StorageInfo(relative_path="pipe", offset=info.offset, length=info.length)
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    reseal(step_path)
    if case == "fifo":
        os.mkfifo(os.path.join(step_path, "pipe"))  # not in the manifest, as the audit left it


@pytest.mark.parametrize("case", ["state_dict_metadata_int", "storage_data_list", "rank_state_2_40", "fifo"])
def test_malformed_metadata_is_a_checkpoint_error_not_a_traceback_or_a_hang(tmp_path, case):
    """D13 (L8, L9, L11): a tensor table that is an int, storage records that are a list, a rank_state of 2^40
    bytes ended in TypeError, AttributeError and the allocator's RuntimeError (exit 1); D6 (L5): a record naming a
    FIFO hung the resume in open() (363 s after SIGTERM). Each is a CheckpointError (exit 2) with the fix now.
    The resume runs in a thread here, so a hang fails the test instead of blocking the suite."""
    import threading

    run = str(tmp_path / "run")
    save_steps(run, [1])
    _forge(storage.step_dir(run, 1), case)
    outcome: dict = {}

    def resume() -> None:
        try:
            outcome["value"] = resumed_value(run)
        except BaseException as exc:  # noqa: BLE001 - what the resume raised is the test's subject
            outcome["error"] = exc

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():
        with open(os.path.join(storage.step_dir(run, 1), "pipe"), "wb"):
            pass  # unblock the reader that hangs
        pytest.fail(f"{case}: the resume hangs")
    error = outcome.get("error")
    assert isinstance(error, CheckpointError), (case, repr(error))
    assert "train.resume" in str(error) or "another" in str(error), str(error)
