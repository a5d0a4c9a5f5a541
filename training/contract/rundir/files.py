"""The one place that writes meshrun's own files of a run directory (pure Python: launcher and ranks): config,
plan, summary, events, metrics, rank logs, the lock, the resume request, the cancel mark, recommend.json,
report.html and each Slurm attempt's prologue.json. (Checkpoints are written into a fresh temporary directory
and checked for links when read, training/checkpoint/storage.py; TensorBoard, W&B and submitit write their
own files.)

A run directory may have been touched by someone else (a copied run, a shared file system, a planted link).
A symbolic link there would turn an append to metrics.jsonl or a rewrite of plan.json into a write to
whatever the link names, outside run.dir. So every write here refuses to follow one:

- appends and in-place writes open with O_NOFOLLOW (the kernel refuses a link as the last component) and
  refuse a linked parent directory below the run directory (logs/ -> elsewhere);
- whole-file writes go to a fresh temporary name (O_CREAT | O_EXCL | O_NOFOLLOW: never an existing file or
  link) and are renamed over the target (a rename replaces a link itself, never its target).

Files are created with mode 0666 and the umask decides, as for every other file of the run.

The same helpers are the project's one way to replace a whole file or directory anywhere (checkpoints, their
`latest` pointer and CRC sidecars, datasets, the code snapshot, replicas, plots, profiler traces, runs/latest):
`write_atomic` for data in memory, `atomic_path` for a writer that wants a file name, `rename_into_place` for
a file or directory finished under a temporary name, `replace_dir` for a directory that may already exist, and
`symlink_atomic` for a link. No other module calls os.replace.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO

from training.contract.rundir.paths import LOGS_DIR, top_level_names

# The names meshrun writes at the top of a run directory (and the directories it writes into), from the map
# (training/contract/rundir/paths.py): checked for links before a launch writes anything
# (training/contract/rundir/config_files.py), so a planted link is an exit 2, not a rank's traceback halfway
# through a run.
RUN_FILES = top_level_names()


class LinkRefused(OSError):
    """A write inside run.dir met a symbolic link; the message names it and the fix."""


def _refusal(path: str) -> LinkRefused:
    return LinkRefused(
        errno.ELOOP,
        f"{path} is a symbolic link (or lies under one): meshrun never writes through "
        "a link inside run.dir, which could point anywhere. Remove the link (and check "
        "who could create it), or choose another run.dir",
    )


class NotRegular(OSError):
    """A file meshrun reads is a FIFO, a device or a socket (a FIFO blocks a reader for ever, /dev/zero never
    ends): refused, as a missing file would be."""


def open_regular(path: str, binary: bool = False, follow: bool = True) -> IO:
    """`path` opened for reading only if it is a regular file (after following a link, unless follow=False):
    never blocks on a FIFO (O_NONBLOCK, cleared once the file is known to be regular), never reads a device.
    NotRegular otherwise, FileNotFoundError and the like as open() raises them."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(errno.EINVAL, f"{path} is not a regular file (a FIFO, device or socket): refused")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if binary:
        return os.fdopen(fd, "rb")
    return os.fdopen(fd, "r", encoding="utf-8", errors="replace")


def _check_parent(path: str) -> None:
    parent = os.path.dirname(path)
    if parent and os.path.islink(parent):
        raise _refusal(parent)


def _open_fd(path: str, flags: int) -> int:
    _check_parent(path)
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refusal(path) from None
        raise


def open_append(path: str, binary: bool = False) -> IO:
    """`path` opened for appending (created when absent), never through a link."""
    fd = _open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "ab" if binary else "a")


def append_bytes(path: str, data: bytes) -> None:
    """One write() on an O_APPEND file (several processes appending at once never interleave within it)."""
    fd = _open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def open_rw(path: str) -> int:
    """A read-write descriptor on `path` (created when absent, not truncated), never through a link."""
    return _open_fd(path, os.O_RDWR | os.O_CREAT)


def write_atomic(
    path: str, data: str | bytes, fsync: bool = False, mode: int | None = None, check_links: bool = True
) -> None:
    """Replace `path` with data: a fresh temporary file, then a rename (readers see old or new, never half;
    a link at `path` is replaced, its target untouched). fsync: durable before the rename (checkpoint
    manifests). mode: the file's permissions exactly (0o600 for secrets), else the umask's default.
    check_links=False: a file outside run.dir (a dataset's description), whose directory may be a link."""
    if check_links:
        _check_parent(path)
    tmp = f"{path}.tmp{uuid.uuid4().hex[:8]}"
    fd = _open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        os.write(fd, data.encode() if isinstance(data, str) else data)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def write_lines_atomic(path: str, lines: Iterable[str]) -> None:
    write_atomic(path, "".join(lines))


@contextmanager
def atomic_path(path: str, suffix: str = "", fsync: bool = False) -> Iterator[str]:
    """A fresh temporary name beside `path` for a writer that wants a file name (a plot, a profiler trace, a
    streamed corpus); when the block ends without an error the file is renamed over `path` (fsync: made durable
    first), after an error it is removed. suffix: kept at the end of the name (a writer that picks its format
    from the extension)."""
    tmp = f"{path}.tmp{uuid.uuid4().hex[:8]}{suffix}"
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def rename_into_place(src: str, dst: str) -> None:
    """The atomic step of a write of a whole file or directory written under a temporary name: one rename (a
    directory replaces only an absent or empty `dst`; `replace_dir` replaces a full one)."""
    os.replace(src, dst)


def replace_dir(tmp_dir: str, target: str) -> None:
    """Put the finished directory `tmp_dir` in place of `target`, which may exist: the old one is renamed aside,
    the new one renamed in, then the old one removed (a reader sees the old or the new directory whole, never a
    mix of both)."""
    old = f"{target}.old{uuid.uuid4().hex[:8]}"
    if os.path.lexists(target):
        os.replace(target, old)
    os.replace(tmp_dir, target)
    shutil.rmtree(old, ignore_errors=True)


def symlink_atomic(name: str, link: str) -> None:
    """Make `link` a symbolic link to `name`: a fresh link under a temporary name, renamed over `link` (a reader
    finds the old or the new link, never none)."""
    head, tail = os.path.split(link)
    tmp = os.path.join(head, f".{tail}.tmp{uuid.uuid4().hex[:8]}")  # hidden: a listing of runs/ never shows it
    os.symlink(name, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise


def links_in(run_dir: str) -> list:
    """The names of RUN_FILES (and logs/*) that are symbolic links in run_dir: what a launch refuses."""
    found = [name for name in RUN_FILES if os.path.islink(os.path.join(run_dir, name))]
    logs = os.path.join(run_dir, LOGS_DIR)
    if os.path.isdir(logs) and not os.path.islink(logs):
        found += [f"{LOGS_DIR}/{n}" for n in sorted(os.listdir(logs)) if os.path.islink(os.path.join(logs, n))]
    return found
