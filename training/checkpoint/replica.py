"""A second copy of every complete checkpoint (train.checkpoint_replica_dir), and resuming from it.

After rank 0 commits a checkpoint, a background thread copies the sealed step_<N> directory (manifest and CRC32s
included) to REPLICA/step_<N>: into a temporary directory first, verified there against the manifest, then renamed,
so a replica directory that exists is complete (never written in place). The replica keeps the same number of
checkpoints as the primary (train.keep_last). When the primary's checkpoint fails verification on resume (a bad
disk, a truncated file), the replica's copy of that step is verified, copied back next to it under a temporary name
and renamed into place; the damaged directory is moved to checkpoints/abandoned/, never deleted. No torch here.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

from training.checkpoint import storage
from training.contract.rundir.events import append_event
from training.contract.rundir.files import replace_dir

_STEP_RE = re.compile(r"^step_(\d+)$")


def replica_root(replica_dir: str, run_dir: str) -> str:
    """The replica directory: absolute, or relative to run.dir."""
    return replica_dir if os.path.isabs(replica_dir) else os.path.normpath(os.path.join(run_dir, replica_dir))


def replica_steps(root: str) -> list[int]:
    """Steps held in the replica, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted((int(m.group(1)) for m in map(_STEP_RE.match, names) if m), reverse=True)


def _copy_verified(src: str, dst: str, tmp_parent: str) -> str | None:
    """Copy directory src to dst through a temporary directory in tmp_parent, verified before the rename;
    returns None or the problem (dst untouched then)."""
    os.makedirs(tmp_parent, exist_ok=True)
    tmp = os.path.join(tmp_parent, f".tmp-{os.path.basename(dst)}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        shutil.copytree(src, tmp, symlinks=True)
        result = storage.verify(tmp)
        if not result.ok:
            return "; ".join(result.problems[:3])
        for name in os.listdir(tmp):
            storage.fsync_path(os.path.join(tmp, name))
        storage.fsync_path(tmp)
        replace_dir(tmp, dst)  # an older copy of the same step (a requeue saved it again) is replaced whole
        storage.fsync_path(tmp_parent)
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Replicator:
    """Rank 0's background copier: one thread, saves copied in order; joined at interpreter exit."""

    def __init__(self, run_dir: str, replica_dir: str, keep_last: int):
        self.run_dir, self.root, self.keep_last = run_dir, replica_root(replica_dir, run_dir), max(1, keep_last)
        os.makedirs(self.root, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-replica")
        self.futures: list[Future] = []

    def submit(self, step: int) -> Future:
        fut = self._pool.submit(self._copy, step)
        self.futures.append(fut)
        return fut

    def _copy(self, step: int) -> str | None:
        t0 = time.monotonic()
        src = storage.step_dir(self.run_dir, step)
        problem = _copy_verified(src, os.path.join(self.root, f"step_{step}"), self.root)
        if problem is not None:
            append_event(self.run_dir, "checkpoint_replica_failed", step=step, replica_dir=self.root, error=problem)
            print(
                f"warning: copying checkpoint step_{step} to the replica {self.root} failed: {problem}; the "
                "primary is complete",
                file=sys.stderr,
            )
            return problem
        for old in replica_steps(self.root)[self.keep_last :]:
            shutil.rmtree(os.path.join(self.root, f"step_{old}"), ignore_errors=True)
        append_event(
            self.run_dir,
            "checkpoint_replica",
            step=step,
            replica_dir=self.root,
            seconds=round(time.monotonic() - t0, 3),
            bytes=storage.dir_size(os.path.join(self.root, f"step_{step}")),
        )
        return None

    def wait(self) -> None:
        for fut in self.futures:
            fut.result()


def restore(run_dir: str, replica_dir: str, step: int) -> str | None:
    """Replace the primary's damaged (or missing) step_<N> with the replica's verified copy; None on success,
    else why not. The damaged directory goes to checkpoints/abandoned/."""
    root = replica_root(replica_dir, run_dir)
    src = os.path.join(root, f"step_{step}")
    if not os.path.isdir(src):
        return f"the replica {root} has no step_{step}"
    result = storage.verify(src)
    if not result.ok:
        return f"the replica's step_{step} is damaged too ({'; '.join(result.problems[:3])})"
    dst = storage.step_dir(run_dir, step)
    if os.path.exists(dst):
        storage.abandon(run_dir, [step])  # kept, never deleted: a person may want to look at it
    problem = _copy_verified(src, dst, storage.checkpoints_dir(run_dir))
    if problem is None:
        append_event(run_dir, "checkpoint_restored", step=step, replica_dir=root)
    return problem
