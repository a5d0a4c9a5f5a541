"""The file I/O of a checkpoint save and resume, apart from CheckpointManager's logic (training/checkpoint/manager.py).

CheckpointManager does every collective, every decision and every state_dict itself and reaches the files only
through one `CheckpointFiles` (its `files` attribute): the shard writes (DCP with the CRC writer), rank 0's
sealing of a save, the listing and verification of the checkpoints, and the reads of a resume. The rehearsal
(training/rehearse/runner.py: RecordingFiles) replaces this object only, so the save and resume it runs on meta
tensors are the manager's own code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from training.checkpoint import storage
from training.contract.rundir.paths import RunPaths


class CheckpointFiles:
    """The checkpoint directories on disk (run.dir/checkpoints, training/checkpoint/storage.py)."""

    def write(
        self, state: dict[str, Any], tmp: str, rank: int, check: Callable[[], None] | None, group, dcp: Any
    ) -> None:
        """This rank's shards of `state` into the temporary directory `tmp` (dcp.save: collective over `group`);
        `check` runs before anything is written (an async save's failed host copy). `dcp`: the
        torch.distributed.checkpoint module the manager imported on first use (tests hand it a stand-in)."""
        from training.checkpoint.crc_writer import CrcFileSystemWriter

        writer = CrcFileSystemWriter(tmp, rank, check=check, sync_files=True)
        dcp.save(state, storage_writer=writer, process_group=group)

    def seal(
        self, run_dir: str, tmp: str, info: dict[str, Any], config: dict[str, Any], step: int, keep_last: int
    ) -> int:
        """Rank 0: state.json and config.json into `tmp`, the manifest, the rename to step_<step>, `latest`, the
        pruning; the committed directory's bytes."""
        from training.checkpoint.crc_writer import read_sidecars

        sums = read_sidecars(tmp)  # every rank's CRC32s, computed while writing
        storage.write_json_durable(os.path.join(tmp, storage.STATE), info)
        with open(os.path.join(tmp, storage.CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        storage.commit(
            tmp,
            storage.step_dir(run_dir, step),
            RunPaths(run_dir).latest,
            {"step": step, "previous": info["previous"]},
            sums,
        )
        size = storage.dir_size(storage.step_dir(run_dir, step))
        storage.prune(run_dir, keep_last, protect=step)
        storage.remove_stale_tmp(run_dir)
        return size

    def list_steps(self, run_dir: str) -> list[int]:
        return storage.list_steps(run_dir)

    def candidates(self, run_dir: str) -> list[int]:
        return storage.candidates(run_dir)

    def verify(self, directory: str, share: tuple[int, int]) -> list[str]:
        """This rank's share of the manifest check (storage.verify): the problems found."""
        return storage.verify(directory, share).problems

    def read_json(self, path: str) -> Any:
        with open(path) as f:
            return json.load(f)

    def read_metadata(self, path: str) -> Any:
        from training.checkpoint import lean_read

        return lean_read.read_metadata(path)

    def load(self, path: str, metadata: Any, destinations: Sequence[tuple[str, torch.Tensor, Any]]) -> None:
        from training.checkpoint import lean_read

        lean_read.load(path, metadata, destinations)
