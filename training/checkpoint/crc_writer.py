"""A DCP FileSystemWriter that checksums every file while writing it.

Each rank's writer wraps the streams DCP opens: every byte written goes through zlib.crc32 on its way to
disk, so the manifest gets a CRC32 of every shard, whatever its size, without reading a shard back (a
multi-GB re-read would double the save's I/O). DCP writes each file front to back (`_write_item`:
`tell`, then sequential `write`s); a stream that is seeked has no streaming CRC and is left to the
manifest, which then reads that file once. At the end of its writes each rank leaves
`__crc_<rank>.json` (file name -> [size, crc32]) in the temporary directory; rank 0 folds these into the
manifest (storage.build_manifest) and deletes them before the checkpoint is sealed.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from contextlib import contextmanager
from typing import Any, Dict, List

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

CRC_SIDECAR_PREFIX = "__crc_"


class _CrcStream:
    """A binary write stream that keeps the CRC32 and byte count of what went through it."""

    def __init__(self, raw):
        self.raw, self.crc, self.size, self.linear = raw, 0, 0, True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self.raw.write(view)
        if n is not None and n != len(view):
            self.linear = False  # a short write: what reached the disk is not what was checksummed
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return len(view) if n is None else n

    def seek(self, *args):
        self.linear = False
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


class _CrcFileSystem(FileSystem):
    """DCP's FileSystem, recording (size, crc32) of every file it writes, under its final name."""

    def __init__(self):
        super().__init__()
        self.sums: Dict[str, List[int]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _CrcStream(raw)
            yield stream
        if stream.linear:
            with self._lock:
                self.sums[os.path.basename(str(path))] = [stream.size, stream.crc]

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.sums.pop(os.path.basename(str(path)), None)
            if entry is not None:
                self.sums[os.path.basename(str(new_path))] = entry


class CrcFileSystemWriter(dcp.FileSystemWriter):
    """FileSystemWriter whose files' CRC32s are computed as they are written (see the module docstring)."""

    def __init__(self, path: str, rank: int, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _CrcFileSystem()
        self._crc_rank = rank

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # the base class writes synchronously, then returns
        self._dump()
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)  # the coordinator writes .metadata through the same fs
        self._dump()

    def _dump(self) -> None:
        with self.fs._lock:
            sums = dict(self.fs.sums)
        path = os.path.join(str(self.path), f"{CRC_SIDECAR_PREFIX}{self._crc_rank}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(sums, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def read_sidecars(directory: str) -> Dict[str, List[int]]:
    """Every rank's recorded (size, crc32) per file of `directory`; the sidecar files are removed."""
    sums: Dict[str, List[int]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith(CRC_SIDECAR_PREFIX) and name.endswith(".json"):
            full = os.path.join(directory, name)
            with open(full) as f:
                sums.update(json.load(f))
            os.remove(full)
    return sums

