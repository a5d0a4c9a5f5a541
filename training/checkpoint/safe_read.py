"""Reading a DCP checkpoint without executing anything from it.

torch.distributed.checkpoint's FileSystemReader reads `.metadata` with plain `pickle.load`: a crafted file
there runs code on every rank at resume (a pickle may call any importable function). `SafeFileSystemReader`
reads it with an unpickler that resolves only the classes a DCP metadata file is made of (listed below, found
by disassembling metadata written by torch.distributed.checkpoint with `pickletools`), refuses everything else
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

import io
import os
import pickle
from typing import Any, Dict, Set, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from training.checkpoint.storage import CheckpointError

# (module, name) pairs a DCP .metadata pickle references: the metadata dataclasses, the storage record of
# the file system writer, torch dtypes and Size, torch.serialization's layout lookup (a dict lookup by name,
# registered with copyreg for torch.layout), the checkpoint id (a path) and plain containers.
_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: Set[Tuple[str, str]] = {
    (_METADATA, "Metadata"),
    (_METADATA, "TensorStorageMetadata"),
    (_METADATA, "TensorProperties"),
    (_METADATA, "ChunkStorageMetadata"),
    (_METADATA, "MetadataIndex"),
    (_METADATA, "StorageMeta"),
    (_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class RefusedPickle(pickle.UnpicklingError):
    """The metadata referenced something a DCP metadata file never needs."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedPickle(f"{module}.{name}")


def load_metadata(path: str) -> Metadata:
    """Unpickle a DCP `.metadata` file with only the classes it needs; CheckpointError otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedPickle as exc:
        raise CheckpointError(
            f"{path} references {exc}, which a checkpoint's metadata never contains: the file was not written by "
            "meshrun and was refused unread (nothing in it ran). Someone who can write to run.dir changed it: "
            "check who can, delete this checkpoint directory, and resume from another (train.resume=<step>) "
            "or start fresh (train.resume=none)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbage bytes: a damaged file, not an attack
        raise CheckpointError(
            f"{path} is not a readable checkpoint metadata file ({type(exc).__name__}: {exc}); "
            "resume from another checkpoint (train.resume=<step>) or start fresh "
            "(train.resume=none)"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not checkpoint metadata; delete the "
            "checkpoint directory and resume from another"
        )
    _check_storage_paths(path, metadata)
    return metadata


def _check_storage_paths(path: str, metadata: Metadata) -> None:
    """Every shard file the metadata names must be a plain file name in the checkpoint directory."""
    storage: Dict[Any, Any] = metadata.storage_data or {}
    for info in storage.values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", "..") or os.path.isabs(rel):
            raise CheckpointError(
                f"{path} points a tensor at {rel!r}, outside its checkpoint directory; refused. "
                "Delete this checkpoint directory and resume from another (train.resume=<step>)"
            )


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
