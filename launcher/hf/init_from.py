"""`train.init_from=DIR` in the launcher: the model config comes from DIR/config.json, checked before a launch.

Pure Python (no torch): config.json and the safetensors headers say everything needed. A model override on
this command line (`model.hidden_size=...`, or a preset `model=NAME`) that disagrees with config.json is exit
2 listing every difference; a directory without config.json, an architecture meshrun cannot express, a
missing shard or a tensor whose shape disagrees with config.json is exit 2 naming the file and the fix.
Model keys that shape no weight (dropout, attention kernel, init_std, and seq_length for rotary models) stay
overridable.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from training.checkpoint.storage import read_latest, step_dir
from training.contract.config import Activation, Config, ModelConfig, Norm, Position
from training.contract.exit_codes import EXIT_INVALID
from training.hf.hf_config import HFError, conflicts, model_fields_from_hf, read_hf_config
from training.hf.safetensors_index import check_tensors

_CHOICES = {"norm": Norm, "activation": Activation, "position": Position}


def model_overrides(cfg: Config, overrides: Sequence[str]) -> dict[str, Any]:
    """The model fields this command line set, with their composed values; a preset choice sets them all."""
    out: dict[str, Any] = {}
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~").strip()
        if key.startswith("override "):
            key = key[len("override ") :].strip()
        if key == "model":
            out.update({n: getattr(cfg.model, n) for n in names if n != "name"})
        elif key.startswith("model.") and key[len("model.") :] in names:
            out[key[len("model.") :]] = getattr(cfg.model, key[len("model.") :])
    return out


def derive_model(cfg: Config, overrides: Sequence[str]) -> Config:
    """cfg with its model taken from train.init_from's config.json; raises HFError on any conflict."""
    directory = os.path.abspath(cfg.train.init_from)
    path = os.path.join(directory, "config.json")
    hf = read_hf_config(directory)
    family, fields, free = model_fields_from_hf(hf, path)
    given = model_overrides(cfg, overrides)
    wrong = conflicts(fields, free, given)
    if wrong:
        raise HFError(
            f"train.init_from={directory}: the model comes from {path}, and these overrides disagree with "
            f"it: {'; '.join(wrong)}; drop them (or train.init_from)"
        )
    model = dataclasses.replace(cfg.model)
    for key, value in fields.items():
        if key in free and key in given:
            continue
        setattr(model, key, _CHOICES[key](value) if key in _CHOICES else value)
    if "name" not in given:
        model.name = os.path.basename(directory.rstrip(os.sep)) or model.name
    check_tensors(directory, model, family)  # every shard there, every shape as config.json says
    train = dataclasses.replace(cfg.train, init_from=directory)
    return dataclasses.replace(cfg, model=model, train=train)


def _resumes(run_dir: str) -> bool:
    """Whether run_dir has a checkpoint to resume (checkpoints/latest names an existing step_<N>)."""
    step = read_latest(run_dir)
    return step is not None and os.path.isdir(step_dir(run_dir, step))


def apply_init_from(cfg: Config, overrides: Sequence[str], run_dir: str = "") -> Config:
    """derive_model, or exit 2 with its message (nothing launched, nothing written). A run that resumes from its
    own checkpoint keeps its saved model and never reads DIR again (it may be gone by then)."""
    if not cfg.train.init_from or (run_dir and _resumes(run_dir) and str(cfg.train.resume) != "none"):
        return cfg
    try:
        return derive_model(cfg, overrides)
    except HFError as exc:
        print(f"meshrun: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID) from None
