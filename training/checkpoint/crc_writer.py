"""A DCP FileSystemWriter that checksums every file while writing it.

Each rank's writer wraps the streams DCP opens: every byte written goes through zlib.crc32 on its way to
disk, so the manifest gets a CRC32 of every shard, whatever its size, without reading a shard back (a
multi-GB re-read would double the save's I/O). DCP writes each file front to back (`_write_item`:
`tell`, then sequential `write`s); a stream that is seeked has no streaming CRC and is left to the
manifest, which then reads that file once. At the end of its writes each rank leaves
`__crc_<rank>.json` (file name -> [size, crc32]) in the temporary directory; rank 0 folds these into the
manifest (storage.build_manifest) and deletes them before the checkpoint is sealed.

Speed: a large write's CRC32 is computed by a helper thread while the writing thread copies the same bytes
to the file (both release the GIL), so a save costs about the longer of the two, not their sum. After each
large write the kernel is asked to start writing the file's dirty pages to the device (Linux
sync_file_range), so the disk works while the rest of the file is being copied and the closing fsync
(still made, and still what makes the file durable) has little left to wait for. And
torch.save's own zip-record CRC32 (a second checksum of the same tensor bytes, which torch.load does not
check) is switched off while DCP writes shards: the manifest's CRC32 covers every byte of every file and is
verified before any load.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from training.contract.rundir.files import write_atomic

CRC_SIDECAR_PREFIX = "__crc_"

HELPER_MIN_BYTES = 1 << 20
"""Writes at least this large have their CRC32 computed in the helper thread, overlapping the write; below
it a thread hand-off costs more than it saves (torch.save's headers are a few dozen bytes)."""

_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _crc_helper() -> ThreadPoolExecutor:
    """The process's CRC helper threads (one per concurrent writing thread is enough; DCP uses few)."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checkpoint-crc")
        return _helper


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start write-out of dirty pages, do not wait for it


def _load_sync_file_range() -> Callable[..., int] | None:
    """libc's sync_file_range on Linux, else None (the closing fsync then does all the work)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing `fd`'s dirty pages to the device now (not waiting for it); pages
    already being written are skipped. Only a head start for the final fsync: errors are ignored."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # offset 0, length 0: the whole file


_zip_crc_users = 0
_zip_crc_saved = True
_zip_crc_lock = threading.Lock()


def _zip_crc_switch() -> tuple[Callable[[], bool], Callable[[bool], None]]:
    """(get, set) of torch.save's per-record CRC32 switch: torch.utils.serialization.config (torch >= 2.6), else
    torch.serialization's get/set_crc32_options (torch 2.4 and 2.5, which pyproject admits), else none (the
    records keep their CRCs: a slower save, the same files)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        import torch.serialization as ser

        if hasattr(ser, "get_crc32_options") and hasattr(ser, "set_crc32_options"):
            return ser.get_crc32_options, ser.set_crc32_options
        return (lambda: True), (lambda value: None)
    return (lambda: bool(config.save.compute_crc32)), (lambda value: setattr(config.save, "compute_crc32", value))


_get_zip_crc, _set_zip_crc = _zip_crc_switch()


@contextmanager
def no_zip_record_crc() -> Iterator[None]:
    """torch.save without its per-record CRC32 for the duration (nested and concurrent uses allowed).

    The setting is process-wide: a torch.save elsewhere in the process during a checkpoint write also leaves
    its zip CRC fields zero, which torch.load accepts (torch.serialization.set_crc32_options)."""
    global _zip_crc_users, _zip_crc_saved
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_saved = _get_zip_crc()
            _set_zip_crc(False)
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                _set_zip_crc(_zip_crc_saved)


class _CrcStream:
    """A binary write stream that keeps the CRC32 and byte count of what went through it."""

    def __init__(self, raw):
        self.raw, self.crc, self.size, self.linear = raw, 0, 0, True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= HELPER_MIN_BYTES:
            crc = _crc_helper().submit(zlib.crc32, view, self.crc)
            try:
                n = self.raw.write(view)
            finally:
                # Waited for even when the write failed: the caller may free or reuse the memory once
                # write() returns, so no thread may still be reading it then.
                self.crc = crc.result()
        else:
            n = self.raw.write(view)
            self.crc = zlib.crc32(view, self.crc)
        if n is not None and n != len(view):
            self.linear = False  # a short write: what reached the disk is not what was checksummed
        self.size += len(view)
        if len(view) >= HELPER_MIN_BYTES:
            start_writeback(self.raw.fileno())
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
        self.sums: dict[str, list[int]] = {}
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
    """FileSystemWriter whose files' CRC32s are computed as they are written (see the module docstring).

    `check`, when given, runs before any shard is written and may raise: a failure that happened before the
    write (an asynchronous save's host copy) then fails the save inside DCP's write step, which reports it
    on every rank instead of leaving the other ranks waiting in a collective."""

    def __init__(self, path: str, rank: int, check: Callable[[], None] | None = None, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _CrcFileSystem()
        self._crc_rank = rank
        self._check = check

    def write_data(self, plan, planner):
        if self._check is not None:
            self._check()
        with no_zip_record_crc():
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
        write_atomic(path, json.dumps(sums), fsync=True)


def read_sidecars(directory: str) -> dict[str, list[int]]:
    """Every rank's recorded (size, crc32) per file of `directory`; the sidecar files are removed."""
    sums: dict[str, list[int]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith(CRC_SIDECAR_PREFIX) and name.endswith(".json"):
            full = os.path.join(directory, name)
            with open(full) as f:
                sums.update(json.load(f))
            os.remove(full)
    return sums
