"""Loading a meshrun checkpoint without importing torch.distributed.checkpoint (DCP).

A resume is on the critical path of every requeue (preemption signal -> resumed step), and importing DCP,
with the DTensor and sympy code it pulls in, costs about as much CPU as a third of torch's own import
(docs/PERFORMANCE.md, "Preemption path"). The files are DCP's, written by dcp.save through
training/checkpoint/crc_writer.py, and their format is small: `.metadata` (a pickle of DCP's metadata
dataclasses) lists, per state-dict key, the chunks saved (offsets and sizes in the stored global tensor) and
where each chunk's `torch.save` record lies in a shard file (relative path, offset, length). This module
reads exactly that:

- `read_metadata` unpickles `.metadata` with the restricted unpickler of training/checkpoint/safe_read.py's
  rules (the same classes allowed, the same refusal and messages), but resolves DCP's metadata classes to the
  small stand-ins below, so nothing of DCP is imported;
- `load` copies, for every piece a rank holds (training/checkpoint/layout.py), the overlap of every saved
  chunk of its key into the piece's live tensor, each chunk read once with `torch.load(weights_only=True)`
  from a view of its file region. That is what DCP's default load planner and FileSystemReader do, resharding
  included, without the planning collectives.

`supported` says whether a checkpoint uses only what this reader handles (tensor entries, no storage
transforms); anything else is loaded through DCP as before (training/checkpoint/manager.py).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from training.checkpoint.storage import CheckpointError

# (module, name) pairs a DCP .metadata pickle references: the metadata dataclasses, the storage record of
# the file system writer, torch dtypes and Size, torch.serialization's layout lookup (a dict lookup by name,
# registered with copyreg for torch.layout), the checkpoint id (a path) and plain containers.
_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
ALLOWED: set[tuple[str, str]] = {
    (_METADATA, "Metadata"),
    (_METADATA, "TensorStorageMetadata"),
    (_METADATA, "TensorProperties"),
    (_METADATA, "ChunkStorageMetadata"),
    (_METADATA, "MetadataIndex"),
    (_METADATA, "StorageMeta"),
    (_METADATA, "_MEM_FORMAT_ENCODING"),
    (_FILESYSTEM, "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class RefusedPickle(pickle.UnpicklingError):
    """The metadata referenced something a DCP metadata file never needs."""


def check_class(module: str, name: str) -> None:
    """Raise RefusedPickle unless (module, name) is a class a DCP metadata file is made of (or a torch dtype)."""
    if (module, name) in ALLOWED:
        return
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return
    raise RefusedPickle(f"{module}.{name}")


class _Record:
    """A stand-in for one of DCP's metadata dataclasses: pickle's BUILD fills its attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class Metadata(_Record):
    state_dict_metadata: dict[str, Any]
    storage_data: Any = None


class TensorStorageMetadata(_Record):
    properties: Any
    size: Sequence[int]
    chunks: list[Any]


class ChunkStorageMetadata(_Record):
    offsets: Sequence[int]
    sizes: Sequence[int]


class TensorProperties(_Record):
    dtype: torch.dtype

    def __setstate__(self, state: Any) -> None:
        # DCP pickles (dtype, layout, requires_grad, memory format code, pin_memory): only the dtype is used here.
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.dtype = state[0]


class MetadataIndex(_Record):
    """The key of storage_data: a key's chunk by its offsets (DCP's `index` is a search hint, not identity)."""

    fqn: str
    offset: Sequence[int] | None = None

    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.fqn, None if self.offset is None else tuple(self.offset))

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self.key() == other.key()


class StorageMeta(_Record):
    pass


class StorageInfo(_Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None


def _memory_format_code(value: Any) -> Any:
    return value  # DCP's _MEM_FORMAT_ENCODING(value): only read by TensorProperties, which ignores it here


_STAND_INS: dict[tuple[str, str], Any] = {
    (_METADATA, "Metadata"): Metadata,
    (_METADATA, "TensorStorageMetadata"): TensorStorageMetadata,
    (_METADATA, "TensorProperties"): TensorProperties,
    (_METADATA, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_METADATA, "MetadataIndex"): MetadataIndex,
    (_METADATA, "StorageMeta"): StorageMeta,
    (_METADATA, "_MEM_FORMAT_ENCODING"): _memory_format_code,
    (_FILESYSTEM, "_StorageInfo"): StorageInfo,
}


class _LeanUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        check_class(module, name)
        return _STAND_INS.get((module, name)) or super().find_class(module, name)


def unpickle_metadata(path: str, unpickler: Any, metadata_type: type) -> Any:
    """`path` unpickled by `unpickler` (a pickle.Unpickler class that refuses with RefusedPickle), checked to be
    a `metadata_type` whose shards are plain files of its directory; CheckpointError otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = unpickler(io.BytesIO(data)).load()
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
    if not isinstance(metadata, metadata_type):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not checkpoint metadata; delete the "
            "checkpoint directory and resume from another"
        )
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(
            f"{path}: its tensor table is a {type(getattr(metadata, 'state_dict_metadata', None)).__name__}, not a "
            "table; the metadata is damaged. Delete this checkpoint directory and resume from another "
            "(train.resume=<step>)"
        )
    check_storage_paths(path, metadata)
    return metadata


def check_storage_paths(path: str, metadata: Any) -> None:
    """Every shard file the metadata names must be a plain file name in the checkpoint directory, and a regular
    file (a FIFO named there would block the resume for ever; a device would never end)."""
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise CheckpointError(
            f"{path}: its storage records are a {type(storage).__name__}, not a table; the metadata is damaged. "
            "Delete this checkpoint directory and resume from another (train.resume=<step>)"
        )
    directory = os.path.dirname(path) if os.path.basename(path) == ".metadata" else path
    for info in storage.values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", "..") or os.path.isabs(rel):
            raise CheckpointError(
                f"{path} points a tensor at {rel!r}, outside its checkpoint directory; refused. "
                "Delete this checkpoint directory and resume from another (train.resume=<step>)"
            )
        target = os.path.join(directory, rel)
        if os.path.lexists(target) and not (os.path.isfile(target) and not os.path.islink(target)):
            raise CheckpointError(
                f"{path} points a tensor at {rel!r}, which is not a regular file (a FIFO, device or link); "
                "refused. Delete this checkpoint directory and resume from another (train.resume=<step>)"
            )


def read_metadata(path: str) -> Metadata:
    """A checkpoint's `.metadata` as the stand-ins above (no DCP import); CheckpointError when refused or damaged."""
    return unpickle_metadata(path, _LeanUnpickler, Metadata)


def supported(metadata: Metadata, keys: Sequence[str]) -> bool:
    """Whether `load` can read `keys` of this checkpoint: every one a tensor entry whose chunks all have a
    storage record without transforms (DCP's storage extensions); else the caller loads through DCP."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return False
    records = {index.key(): info for index, info in storage.items() if isinstance(index, MetadataIndex)}
    for key in keys:
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            return False
        for chunk in entry.chunks:
            info = records.get((key, tuple(chunk.offsets)))
            if not isinstance(info, StorageInfo) or getattr(info, "transform_descriptors", None):
                return False
    return True


class _FileRegion(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start + length) of an open file (what torch.load reads)."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got or 0
        return got or 0


def load(directory: str, metadata: Metadata, destinations: Sequence[tuple[str, torch.Tensor, Sequence[int]]]) -> None:
    """Fill each destination (state-dict key, the local tensor, its offsets in the stored global tensor) from
    the checkpoint in `directory`: the overlap of every saved chunk of the key is copied in place. Raises
    CheckpointError when a destination lies outside its stored tensor or is not fully covered by saved chunks."""
    records = {index.key(): info for index, info in metadata.storage_data.items()}
    by_key: dict[str, list[tuple[torch.Tensor, Sequence[int]]]] = {}
    for key, tensor, offsets in destinations:
        by_key.setdefault(key, []).append((tensor, offsets))
    files: dict[str, Any] = {}
    try:
        for key, dests in by_key.items():
            entry = metadata.state_dict_metadata[key]
            size = tuple(entry.size)
            chunks: dict[int, torch.Tensor] = {}  # this key's chunks read so far (each read once)
            for dest, offsets in dests:
                offsets = tuple(offsets)
                shape = tuple(dest.shape)
                if len(offsets) != len(size) or any(o + s > g for o, s, g in zip(offsets, shape, size)):
                    raise CheckpointError(
                        f"{key}: the region {offsets} + {shape} lies outside the stored tensor of shape {size}"
                    )
                covered = 0
                for i, chunk in enumerate(entry.chunks):
                    c_off, c_size = tuple(chunk.offsets), tuple(chunk.sizes)
                    lo = [max(a, b) for a, b in zip(offsets, c_off)]
                    hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, shape, c_off, c_size)]
                    if any(h <= low for low, h in zip(lo, hi)):
                        continue
                    if i not in chunks:
                        chunks[i] = _read_chunk(directory, files, records[(key, c_off)], c_size, key)
                    src, dst = chunks[i], dest
                    for d, (low, h) in enumerate(zip(lo, hi)):
                        src = src.narrow(d, low - c_off[d], h - low)
                        dst = dst.narrow(d, low - offsets[d], h - low)
                    dst.copy_(src)
                    n = 1
                    for low, h in zip(lo, hi):
                        n *= h - low
                    covered += n
                if covered != dest.numel():
                    raise CheckpointError(
                        f"{key}: the saved chunks cover {covered} of the {dest.numel()} elements at {offsets}"
                    )
    finally:
        for f in files.values():
            f.close()


def _read_chunk(directory: str, files: dict[str, Any], info: StorageInfo, sizes: Sequence[int], key: str):
    path = os.path.join(directory, info.relative_path)
    if path not in files:
        from training.contract.rundir.files import open_regular

        files[path] = open_regular(path, binary=True, follow=False)  # never blocks on a FIFO
    tensor = torch.load(
        io.BufferedReader(_FileRegion(files[path], int(info.offset), int(info.length))),
        map_location="cpu",
        weights_only=True,
    )
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(sizes):
        raise CheckpointError(
            f"{key}: the record at {info.relative_path}:{info.offset} is not the chunk of shape {tuple(sizes)} "
            "the metadata lists"
        )
    return tensor
