"""Checkpoint directories on disk: atomic commit, manifest, verification, `latest`, keep-last-K.

Layout of `run_dir/checkpoints/`:
  .tmp_step_<N>_<nonce>/   a save in progress (or one that crashed); never read, removed by the next commit
  step_<N>/                a complete checkpoint: DCP files + `.metadata`, state.json, config.json, manifest.json
  latest                   text file naming the newest complete checkpoint of the current line ("step_<N>"),
                           or "none" right after a fresh start (train.resume=none) before its first save
  abandoned/step_<N>_<time>/  checkpoints of a line that a rollback (train.resume=<step> or none) left: kept for
                           people, never resumed and never deleted by meshrun

History: each manifest records `previous`, the step `latest` named when it was committed. Resuming follows
`latest` and then that chain, never simply the highest step number, so after a rollback to step N the
checkpoints trained past N on the abandoned line are never picked up again (and are moved to abandoned/
at the new line's first save); pruning keeps the newest `keep_last` of the chain.

Trust: every file's CRC32 (computed while it was written, crc_writer.py) and size are in the manifest;
a manifest path outside the directory, or a symlink anywhere inside it, makes the checkpoint invalid.

A checkpoint is complete only once it has been renamed from its temporary name, and the rename happens
after every file in it is written and fsynced, so a crash at any point leaves the previous one intact.
Pure Python (no torch): the launcher may use it to report the run's checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from training.contract.rundir.files import rename_into_place, write_atomic
from training.contract.rundir.paths import RunPaths
from training.contract.rundir.resume_request import effective_resume

MANIFEST = "manifest.json"
STATE = "state.json"
CONFIG = "config.json"
DCP_METADATA = ".metadata"
ABANDONED = "abandoned"
FRESH = "none"
_STEP_RE = re.compile(r"^step_(\d+)$")
# The model keys a checkpoint's tensors depend on: a resume with any of them changed cannot load it (the
# engine checks them, training/checkpoint/manager.py, and so does the launcher before it writes anything).
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "seq_length",
    "vocab_size",
    "norm",
    "activation",
    "position",
    "tie_embeddings",
    "bias",
)
_TMP_PREFIX = ".tmp_step_"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or used; the message names the cause and the fix."""


@dataclass
class Verification:
    """Result of checking one checkpoint directory against its manifest."""

    path: str
    """The checkpoint directory."""
    ok: bool
    """True when every file of the manifest is present with its size and CRC32, and nothing is a symlink."""
    problems: list[str] = field(default_factory=list)
    """Human-readable reasons when not ok."""


def checkpoints_dir(run_dir: str) -> str:
    return RunPaths(run_dir).checkpoints


def step_dir(run_dir: str, step: int) -> str:
    return RunPaths(run_dir).checkpoint(step)


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
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True), fsync=True)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def build_manifest(directory: str, sums: dict[str, list[int]] | None = None) -> dict[str, dict[str, int]]:
    """Every file below `directory` (relative path -> size, crc32); fsyncs each file.

    `sums` holds (size, crc32) recorded while the ranks wrote their shards (crc_writer.py); only files
    without one (rank 0's small state.json and config.json, or a stream DCP seeked) are read here."""
    sums = sums or {}
    files: dict[str, dict[str, int]] = {}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory)
            if rel == MANIFEST:
                continue
            fsync_path(full)
            size = os.path.getsize(full)
            recorded = sums.get(rel)
            crc = recorded[1] if recorded and recorded[0] == size else _crc32(full)
            files[rel] = {"size": size, "crc32": crc}
    return files


def commit(
    tmp_dir: str, final_dir: str, latest_path: str, info: dict, sums: dict[str, list[int]] | None = None
) -> None:
    """Seal a fully written temporary checkpoint: manifest, fsync, rename, then point `latest` at it.

    Called on one rank (rank 0) after all ranks finished writing. The manifest records `previous` (the step
    `latest` named until now: the history resuming follows). An existing `final_dir` (a checkpoint of the same
    step on a line a rollback abandoned) is moved to abandoned/, never deleted.
    """
    run_dir = os.path.dirname(os.path.dirname(final_dir))
    manifest = {"files": build_manifest(tmp_dir, sums), "previous": read_latest(run_dir), **info}
    write_json_durable(os.path.join(tmp_dir, MANIFEST), manifest)
    fsync_path(tmp_dir)
    if os.path.exists(final_dir):
        abandon(run_dir, [int(_STEP_RE.match(os.path.basename(final_dir)).group(1))])
    rename_into_place(tmp_dir, final_dir)  # the whole checkpoint appears at once
    parent = os.path.dirname(final_dir)
    fsync_path(parent)
    _write_latest(latest_path, os.path.basename(final_dir))
    fsync_path(parent)


def _write_latest(latest_path: str, text: str) -> None:
    write_atomic(latest_path, text + "\n", fsync=True)


def set_latest(run_dir: str, step: int | None) -> None:
    """Point `latest` at `step` (a rollback), or at "none" (a fresh start: nothing to resume yet)."""
    os.makedirs(checkpoints_dir(run_dir), exist_ok=True)
    _write_latest(RunPaths(run_dir).latest, f"step_{step}" if step is not None else FRESH)
    fsync_path(checkpoints_dir(run_dir))


def abandon(run_dir: str, steps: list[int]) -> list[str]:
    """Move checkpoints off the current line to checkpoints/abandoned/step_<N>_<UTC time>/ (kept, never read)."""
    moved = []
    if not steps:
        return moved
    target = os.path.join(checkpoints_dir(run_dir), ABANDONED)
    os.makedirs(target, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for step in steps:
        dest = os.path.join(target, f"step_{step}_{stamp}")
        if os.path.exists(dest):
            dest = f"{dest}_{uuid.uuid4().hex[:6]}"
        rename_into_place(step_dir(run_dir, step), dest)
        moved.append(dest)
    fsync_path(target)
    fsync_path(checkpoints_dir(run_dir))
    return moved


def _symlinks(directory: str) -> list[str]:
    found = [directory] if os.path.islink(directory) else []
    for root, dirs, names in os.walk(directory):
        found += [os.path.join(root, n) for n in dirs + names if os.path.islink(os.path.join(root, n))]
    return [os.path.relpath(p, directory) for p in found]


def _outside(directory: str, rel: str) -> bool:
    """True for a manifest path that is absolute, climbs out (..), or is not in normal form."""
    return (
        not isinstance(rel, str)
        or not rel
        or os.path.isabs(rel)
        or os.path.normpath(rel) != rel
        or rel.split(os.sep)[0] == os.pardir
    )


def verify(directory: str, part: tuple[int, int] = (0, 1)) -> Verification:
    """Check a checkpoint directory: manifest readable, DCP metadata present, every file with its size and
    CRC32, no manifest path outside the directory and no symlink inside it (a checkpoint holds only its
    own files: a link could make a resume read, or a pruning delete, something elsewhere).
    part = (i, n): read the CRC of every n-th file (in name order) from the i-th only; the presence and size
    checks cover every file. The job's ranks each take a part, so no rank reads the whole checkpoint while
    the others wait (training/checkpoint/manager.py)."""
    mine, parts = part
    result = Verification(path=directory, ok=False)
    links = _symlinks(directory)
    if links:
        result.problems.append(f"symlinks are not allowed in a checkpoint: {links[:5]}")
        return result
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
    outside = [rel for rel in files if _outside(directory, rel)]
    if outside:
        result.problems.append(f"manifest names paths outside the checkpoint directory: {outside[:5]}")
        return result
    for index, (rel, entry) in enumerate(sorted(files.items())):
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            result.problems.append(f"{rel} missing")
            continue
        size = os.path.getsize(full)
        if size != entry.get("size"):
            result.problems.append(f"{rel} has {size} bytes, manifest says {entry.get('size')}")
        elif "crc32" not in entry:
            result.problems.append(f"{rel} has no checksum in the manifest")
        elif index % parts == mine and _crc32(full) != entry["crc32"]:
            result.problems.append(f"{rel} checksum mismatch")
    result.ok = not result.problems
    return result


def list_steps(run_dir: str) -> list[int]:
    """Steps of the committed checkpoint directories (complete or not verified yet), newest first."""
    base = checkpoints_dir(run_dir)
    if not os.path.isdir(base):
        return []
    steps = [int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(base)) if m]
    return sorted(steps, reverse=True)


def _read_latest_text(run_dir: str) -> str | None:
    try:
        with open(RunPaths(run_dir).latest) as f:
            return f.read().strip()
    except OSError:
        return None


def read_latest(run_dir: str) -> int | None:
    """The step named by checkpoints/latest, or None when absent, "none" (a fresh start) or unreadable."""
    m = _STEP_RE.match(_read_latest_text(run_dir) or "")
    return int(m.group(1)) if m else None


def previous_step(run_dir: str, step: int) -> int | None:
    """The step before `step` on its line: its manifest's `previous`; for a manifest without one (written
    by an older meshrun) or an unreadable one, the next lower checkpoint directory."""
    try:
        with open(os.path.join(step_dir(run_dir, step), MANIFEST)) as f:
            manifest = json.load(f)
        if "previous" in manifest:
            prev = manifest["previous"]
            return int(prev) if prev is not None and int(prev) < step else None
    except (OSError, ValueError, TypeError):
        pass
    lower = [s for s in list_steps(run_dir) if s < step]
    return lower[0] if lower else None


def history(run_dir: str) -> list[int]:
    """The current line, newest first: `latest`, then each checkpoint's `previous` while its directory exists.

    Without `latest` (a run dir of an older meshrun, or one whose latest was lost) every checkpoint
    directory, newest first; "none" (a fresh start not saved yet): nothing."""
    steps = list_steps(run_dir)
    text = _read_latest_text(run_dir)
    if text == FRESH:
        return []
    latest = read_latest(run_dir)
    if latest is None or latest not in steps:
        return steps
    chain: list[int] = []
    step: int | None = latest
    while step is not None and step in steps and step not in chain:
        chain.append(step)
        step = previous_step(run_dir, step)
    return chain


def candidates(run_dir: str) -> list[int]:
    """Steps to try when resuming (train.resume=auto), newest first; each must still pass `verify`.

    The history of `latest`, not the highest step number: after a rollback the newer checkpoints of the
    abandoned line are never candidates; a damaged newest one falls back to the one before it on the line.
    """
    return history(run_dir)


def planned_resume_step(run_dir: str, configured: Any) -> int | None:
    """The checkpoint an attempt about to start will resume from, as its ranks choose it (the run directory's
    resume request, training/contract/rundir/resume_request.py, then the newest checkpoint on the current line
    for auto, the named step for an explicit one); None for a fresh start. A damaged one is passed over by the
    ranks: their `resumed` event names the one loaded."""
    mode = effective_resume(run_dir, configured).strip().lower()
    if mode == "none":
        return None
    if mode == "auto":
        found = candidates(run_dir)
        return found[0] if found else None
    try:
        return int(mode)
    except ValueError:
        return None


def prune(run_dir: str, keep_last: int, protect: int | None = None) -> list[int]:
    """Keep the newest `keep_last` checkpoints of the current line (`latest` first; never `protect`); delete
    the older ones of the line; move every checkpoint that is not on the line (a rollback left it) to
    abandoned/. Temporary dirs are `remove_stale_tmp`'s job. Returns the deleted steps."""
    removed = []
    chain = history(run_dir)
    keep = set(chain[: max(1, keep_last)])
    if protect is not None:
        keep.add(protect)
    if read_latest(run_dir) is not None or _read_latest_text(run_dir) == FRESH:
        abandon(run_dir, [s for s in list_steps(run_dir) if s not in chain and s not in keep])
    for step in chain:
        if step not in keep:
            shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)
            removed.append(step)
    return removed


def remove_stale_tmp(run_dir: str, keep: str | None = None) -> list[str]:
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
