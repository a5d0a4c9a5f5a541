"""The full parameters of a meshrun checkpoint, on one process, whatever layout wrote it.

A checkpoint describes every saved piece as a rectangle of the parameter's stored global tensor (training/
checkpoint/layout.py: vocabulary padding removed, one writer per replica), so loading it into plain full-size
tensors is the same resharding a resume does, to a world of one: DCP copies the overlapping parts of whatever
chunks tp / pp / dp / zero produced. Tensors are read with DCP's own reader (no pickle: nothing but tensors
and the JSON files beside them is loaded).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from training.checkpoint import storage
from training.checkpoint.safe_read import SafeFileSystemReader
from training.checkpoint.storage import CheckpointError
from training.contract.config import Config, config_from_dict

MODEL = "model/"
MASTER = "optim/master/"


def resolve_step(run_dir: str, step: int | None, key: str) -> tuple[int, str]:
    """(step, its directory): the given step, or the newest complete checkpoint of the run's line."""
    if not os.path.isdir(storage.checkpoints_dir(run_dir)):
        raise CheckpointError(
            f"{storage.checkpoints_dir(run_dir)} does not exist: run.dir={run_dir} has no "
            f"checkpoints; point run.dir at a run that has saved one"
        )
    if step is not None:
        path = storage.step_dir(run_dir, step)
        if not os.path.isdir(path):
            have = storage.list_steps(run_dir) or "none"
            raise CheckpointError(
                f"{key}={step}: {path} does not exist (available: {have}); choose one of those "
                f"steps, or leave {key} unset for the latest"
            )
        result = storage.verify(path)
        if not result.ok:
            raise CheckpointError(
                f"{key}={step}: checkpoint {path} is damaged ({'; '.join(result.problems[:3])}); choose another step"
            )
        return step, path
    for candidate in storage.candidates(run_dir):
        path = storage.step_dir(run_dir, candidate)
        result = storage.verify(path)
        if result.ok:
            return candidate, path
        print(
            f"note: checkpoint {path} is damaged ({'; '.join(result.problems[:3])}); trying the one before it",
            file=sys.stderr,
        )
    raise CheckpointError(
        f"{storage.checkpoints_dir(run_dir)} holds no complete checkpoint; train first (or "
        f"give {key}=N of a complete one)"
    )


def read_checkpoint(
    run_dir: str, step: int | None = None, key: str = "export.step", masters: bool = False
) -> tuple[Config, int, dict[str, torch.Tensor]]:
    """(the checkpoint's config, its step, parameter name -> full tensor without vocabulary padding).

    masters=True takes the fp32 master copy of each parameter where the checkpoint has one (bf16 / fp16 runs)."""
    import torch.distributed.checkpoint as dcp

    step, path = resolve_step(run_dir, step, key)
    with open(os.path.join(path, storage.CONFIG)) as f:
        cfg = config_from_dict(json.load(f))
    # The restricted reader: a checkpoint's .metadata is a pickle, and loading one must run no code from it.
    reader = SafeFileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged .metadata that still matched its manifest
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); choose another step") from exc
    saved = metadata.state_dict_metadata
    names = [k[len(MODEL) :] for k in saved if k.startswith(MODEL)]
    keys = {n: (MASTER + n if masters and MASTER + n in saved else MODEL + n) for n in names}
    state = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in keys.values()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading on one process" is the point here
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(
                f"checkpoint {path} passed its manifest check but could not be loaded "
                f"({str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else exc!r}); "
                f"choose another step"
            ) from exc
    return cfg, step, {n: state[k] for n, k in keys.items()}
