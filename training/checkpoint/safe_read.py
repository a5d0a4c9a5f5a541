"""Reading a DCP checkpoint without executing anything from it.

torch.distributed.checkpoint's FileSystemReader reads `.metadata` with plain `pickle.load`: a crafted file
there runs code on every rank at resume (a pickle may call any importable function). `SafeFileSystemReader`
reads it with an unpickler that resolves only the classes a DCP metadata file is made of (listed in
training/checkpoint/lean_read.py, which shares these rules with the resume's DCP-free reader; found by
disassembling metadata written by torch.distributed.checkpoint with `pickletools`), refuses everything else
with a message that says what it found and what to do, and checks that every shard the metadata points at is a
plain file name inside the checkpoint directory. The tensors themselves are read by DCP with
`torch.load(weights_only=True)`, which already refuses code.

DCP's "bytes" entries (BytesStorageMetadata) are the exception: DCP reads each with
`torch.load(weights_only=False)`, which runs whatever pickle the entry points at. meshrun's checkpoints hold
tensors only (its scalars live in state.json, the rng state in a uint8 tensor), so a metadata file that
declares a bytes entry was not written by meshrun: the unpickler refuses the class, and `read_data` refuses
any bytes read item as well, so nothing in a checkpoint is ever read through a path that unpickles.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from training.checkpoint.lean_read import ALLOWED as _ALLOWED
from training.checkpoint.lean_read import RefusedPickle, check_class, unpickle_metadata
from training.checkpoint.storage import CheckpointError

__all__ = ["RefusedPickle", "SafeFileSystemReader", "load_metadata", "_ALLOWED"]


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes of training/checkpoint/lean_read.py's ALLOWED list (DCP's own classes)."""

    def find_class(self, module: str, name: str) -> Any:
        check_class(module, name)
        return super().find_class(module, name)


def load_metadata(path: str) -> Metadata:
    """Unpickle a DCP `.metadata` file with only the classes it needs; CheckpointError otherwise."""
    return unpickle_metadata(path, _MetadataUnpickler, Metadata)


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read by `load_metadata` (no code from the checkpoint runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = load_metadata(os.path.join(str(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, after refusing any bytes item (DCP would unpickle it with weights_only=False)."""
        from torch.distributed.checkpoint.planner import LoadItemType

        byte_items = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if byte_items:
            raise CheckpointError(
                f"{self.path} declares {len(byte_items)} non-tensor (bytes) entries, first "
                f"{byte_items[0].dest_index.fqn!r}; meshrun's checkpoints hold tensors only and DCP would unpickle "
                "them with code allowed, so the checkpoint was refused unread. Delete this checkpoint directory and "
                "resume from another (train.resume=<step>) or start fresh (train.resume=none)"
            )
        return super().read_data(plan, planner)
