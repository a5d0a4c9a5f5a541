"""Checkpoint directories on disk: atomic commit, manifest, verification, `latest`, keep-last-K.

Layout of `run_dir/checkpoints/`:
  .tmp_step_<N>_<nonce>/   a save in progress (or one that crashed); never read, removed by the next commit
  step_<N>/                a complete checkpoint: DCP files + `.metadata`, state.json, config.json, manifest.json
  latest                   text file naming the newest complete checkpoint ("step_<N>")

A checkpoint is complete only once it has been renamed from its temporary name, and the rename happens
after every file in it is written and fsynced, so a crash at any point leaves the previous one intact.
Pure Python (no torch): the launcher may use it to report the run's checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "state.json"
CONFIG = "config.json"
DCP_METADATA = ".metadata"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_step_"
# Files up to this size get a CRC32 in the manifest (cheap); larger ones are checked by size only, so that
# verification never re-reads a multi-GB shard.
CRC_LIMIT_BYTES = 64 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or used; the message names the cause and the fix."""


@dataclass
class Verification:
    """Result of checking one checkpoint directory against its manifest."""

    path: str
    """The checkpoint directory."""
    ok: bool
    """True when every file of the manifest is present with its size (and CRC where recorded)."""
    problems: List[str] = field(default_factory=list)
    """Human-readable reasons when not ok."""


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoints_dir(run_dir), f"step_{step}")


def new_tmp_dir(run_dir: str, step: int) -> str:
    """A fresh temporary directory name for a save of `step` (rank 0 picks it, then broadcasts it)."""
    return os.path.join(checkpoints_dir(run_dir), f"{_TMP_PREFIX}{step}_{uuid.uuid4().hex[:8]}")


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory fsync makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: str, obj) -> None:
    """Write JSON to `path` via a temporary file + fsync + os.replace (readers see old or new, never half)."""
    tmp = f"{path}.tmp{uuid.uuid4().hex[:6]}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def build_manifest(directory: str) -> Dict[str, Dict[str, int]]:
    """Every file below `directory` (relative path -> size, crc32 for small files); fsyncs each file."""
    files: Dict[str, Dict[str, int]] = {}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory)
            if rel == MANIFEST:
                continue
            fsync_path(full)
            entry = {"size": os.path.getsize(full)}
            if entry["size"] <= CRC_LIMIT_BYTES:
                entry["crc32"] = _crc32(full)
            files[rel] = entry
    return files


def commit(tmp_dir: str, final_dir: str, latest_path: str, info: Dict) -> None:
    """Seal a fully written temporary checkpoint: manifest, fsync, rename, then point `latest` at it.

    Called on one rank (rank 0) after all ranks finished writing. An existing `final_dir` (the same step
    saved again after a resume) is moved aside first and deleted only after the new one is in place.
    """
    manifest = {"files": build_manifest(tmp_dir), **info}
    write_json_durable(os.path.join(tmp_dir, MANIFEST), manifest)
    fsync_path(tmp_dir)
    old = None
    if os.path.exists(final_dir):
        old = f"{final_dir}.old{uuid.uuid4().hex[:6]}"
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    parent = os.path.dirname(final_dir)
    fsync_path(parent)
    tmp_latest = f"{latest_path}.tmp{uuid.uuid4().hex[:6]}"
    with open(tmp_latest, "w") as f:
        f.write(os.path.basename(final_dir) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_latest, latest_path)
    fsync_path(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def verify(directory: str) -> Verification:
    """Check a checkpoint directory: manifest readable, DCP metadata present, every file with its size/CRC."""
    result = Verification(path=directory, ok=False)
    manifest_path = os.path.join(directory, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        result.problems.append(f"manifest unreadable ({exc})")
        return result
    if DCP_METADATA not in files:
        result.problems.append("DCP .metadata missing from the manifest")
    for rel, entry in sorted(files.items()):
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            result.problems.append(f"{rel} missing")
            continue
        size = os.path.getsize(full)
        if size != entry["size"]:
            result.problems.append(f"{rel} has {size} bytes, manifest says {entry['size']}")
        elif "crc32" in entry and _crc32(full) != entry["crc32"]:
            result.problems.append(f"{rel} checksum mismatch")
    result.ok = not result.problems
    return result


def list_steps(run_dir: str) -> List[int]:
    """Steps of the committed checkpoint directories (complete or not verified yet), newest first."""
    base = checkpoints_dir(run_dir)
    if not os.path.isdir(base):
        return []
    steps = [int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(base)) if m]
    return sorted(steps, reverse=True)


def read_latest(run_dir: str) -> Optional[int]:
    """The step named by checkpoints/latest, or None when absent or unreadable."""
    try:
        with open(os.path.join(checkpoints_dir(run_dir), LATEST)) as f:
            m = _STEP_RE.match(f.read().strip())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def candidates(run_dir: str) -> List[int]:
    """Steps to try when resuming, newest first; each must still pass `verify`.

    Not only the step `latest` names: a crash between the rename and the update of `latest` leaves a newer
    complete checkpoint, and a damaged newest one must fall back to the one before.
    """
    return list_steps(run_dir)


def prune(run_dir: str, keep_last: int, protect: Optional[int] = None) -> List[int]:
    """Delete all but the newest `keep_last` checkpoints (never `protect`); temporary dirs are
    `remove_stale_tmp`'s job."""
    removed = []
    steps = list_steps(run_dir)
    for step in steps[max(1, keep_last):]:
        if step != protect:
            shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)
            removed.append(step)
    return removed


def remove_stale_tmp(run_dir: str, keep: Optional[str] = None) -> List[str]:
    """Remove temporary dirs of crashed saves (call only when no save of this run is in flight)."""
    base = checkpoints_dir(run_dir)
    removed = []
    if not os.path.isdir(base):
        return removed
    for name in os.listdir(base):
        full = os.path.join(base, name)
        if (name.startswith(_TMP_PREFIX) or ".old" in name) and full != keep:
            shutil.rmtree(full, ignore_errors=True)
            removed.append(name)
    return removed


def dir_size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _d, ns in os.walk(directory) for n in ns)
