"""Trust round two, checkpoint side (issue 22), in one process (stand-in model, real optimizer and DCP files):

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
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from test_checkpoint_safety import _reseal, _RunsCommand
from test_checkpoint_storage import _resumed_value, _save_steps
from training.checkpoint import CheckpointError, storage


def _plant_bytes_entry(step_path: str, canary: str) -> str:
    """What the audit did: one tensor key re-declared as bytes, pointing at a pickle appended to a shard."""
    meta_path = os.path.join(step_path, storage.DCP_METADATA)
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # genuine metadata written by DCP a moment ago
    key = sorted(k for k in metadata.state_dict_metadata if k.startswith("model/"))[0]
    shard = sorted(n for n in os.listdir(step_path) if n.endswith(".distcp"))[0]
    payload = pickle.dumps(_RunsCommand(f"touch {canary}"))
    offset = os.path.getsize(os.path.join(step_path, shard))
    with open(os.path.join(step_path, shard), "ab") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(relative_path=shard, offset=offset, length=len(payload))
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    _reseal(step_path)
    return key


def test_bytes_entry_in_metadata_is_refused_and_its_pickle_never_runs(tmp_path):
    run = str(tmp_path / "run")
    canary = tmp_path / "canary"
    _save_steps(run, [1])
    newest = storage.step_dir(run, 1)
    key = _plant_bytes_entry(newest, str(canary))
    assert storage.verify(newest).ok  # the manifest matches: only the reader stands in the way
    with pytest.raises(CheckpointError) as err:
        _resumed_value(run)
    msg = str(err.value)
    assert "BytesStorageMetadata" in msg and "nothing in it ran" in msg and "train.resume" in msg, msg
    assert not canary.exists()
    # The reader refuses a bytes read item on its own too (a second line of defence, no unpickler involved).
    from training.checkpoint.safe_read import SafeFileSystemReader

    reader = SafeFileSystemReader(newest)
    with open(os.path.join(newest, storage.DCP_METADATA), "rb") as f:
        reader.storage_data = pickle.load(f).storage_data
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex(key), storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
    with pytest.raises(CheckpointError, match="non-tensor .bytes. entries"):
        reader.read_data(LoadPlan([item]), planner=None)
    assert not canary.exists()
    # The same checkpoint through torch's own reader runs the payload: the test's attack is real.
    with pytest.raises(BaseException):  # noqa: B017 - DCP fails after unpickling (its error is a BaseException)
        dcp.load({key: torch.zeros(1)}, storage_reader=dcp.FileSystemReader(newest), no_dist=True)
    assert canary.exists()
