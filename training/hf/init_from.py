"""`train.init_from=DIR`: fill this rank's parameters from a Hugging Face model directory.

Each rank opens the safetensors files with safe_open and reads, per parameter, only the row or column ranges
its tp shard needs (get_slice), and only for the layers of its pipeline stage: no rank materialises the whole
model. The launcher has already derived the model config from DIR/config.json and checked every tensor's
shape (launcher/hf/init_from.py); the same checks run here, so a rank started by hand fails just as clearly.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack

import torch

from training.hf.convert import local_from_hf
from training.hf.hf_config import HFError, effective, model_fields_from_hf, read_hf_config
from training.hf.safetensors_index import TensorEntry, check_tensors


class SliceReader:
    """read(expected name, rows, cols) over the files of one Hugging Face directory (files opened lazily)."""

    def __init__(self, entries: dict[str, TensorEntry], stack: ExitStack):
        self.entries, self.stack = entries, stack
        self.handles: dict[str, object] = {}

    def _handle(self, path: str):
        if path not in self.handles:
            from safetensors import safe_open

            self.handles[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        return self.handles[path]

    def __call__(self, name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        entry = self.entries[name]
        sl = self._handle(entry.file).get_slice(entry.key)
        if cols is not None:
            return sl[rows if rows is not None else slice(None), cols]
        return sl[rows] if rows is not None else sl[:]


def check_model_matches(cfg, directory: str) -> str:
    """The family of DIR; an HFError when cfg.model disagrees with DIR/config.json in a field that shapes weights."""
    hf = read_hf_config(directory)
    family, fields, free = model_fields_from_hf(hf, f"{directory}/config.json")
    now = {k: getattr(cfg.model, k) for k in fields}
    wrong = [
        f"model.{k}: config.json {effective(k, fields)!r}, run {effective(k, now)!r}"
        for k in fields
        if k not in free and effective(k, fields) != effective(k, now)
    ]
    if wrong:
        raise HFError(
            f"train.init_from={directory}: the run's model differs from its config.json "
            f"({'; '.join(wrong)}); start through meshrun, which takes the model from config.json"
        )
    return family


@torch.no_grad()
def load_init_from(cfg, mesh, chunks: list[torch.nn.Module]) -> int:
    """Copy this rank's slices of cfg.train.init_from's weights into `chunks`; returns the elements read."""
    directory = cfg.train.init_from
    family = check_model_matches(cfg, directory)
    entries = check_tensors(directory, cfg.model, family)
    total = 0
    with ExitStack() as stack:
        read = SliceReader(entries, stack)
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                local = local_from_hf(
                    name, p.global_shape, p.tp_shard_dim, mesh.tp, mesh.tp_rank, read, cfg.model, family
                )
                if tuple(local.shape) != tuple(p.shape):
                    raise HFError(
                        f"train.init_from={directory}: {name} came out as {list(local.shape)}, this rank "
                        f"holds {list(p.shape)}; the weights do not match config.json"
                    )
                p.copy_(local.to(p.dtype))
                total += local.numel()
    return total


def maybe_init_from(cfg, run_dir: str, mesh, chunks: list[torch.nn.Module]) -> bool:
    """load_init_from on a fresh start; a run with a checkpoint to resume takes its weights from that instead."""
    from training.checkpoint import storage

    # With a checkpoint to resume, its weights replace these right after; still load them while the directory
    # exists, so that a run whose every checkpoint turns out damaged starts from the pretrained weights, not
    # from random ones. Once the run has checkpoints, the directory may be gone.
    if (
        str(cfg.train.resume).strip().lower() != "none"
        and storage.candidates(run_dir)
        and not os.path.isdir(str(cfg.train.init_from))
    ):
        return False
    n = load_init_from(cfg, mesh, chunks)
    if mesh.rank == 0:
        print(f"initialised from {cfg.train.init_from} ({n} elements on rank 0)", file=sys.stderr)
    return True
