"""Starting again on an existing run directory: its saved configuration, with the new command line on top.

A user resumes with `meshrun run.dir=D` and nothing else: every key comes from `D/config.json` (what the run
really used, presets and overrides resolved). Overrides given now are applied on top, each exactly as it
composed in this invocation: a key override replaces that key; a preset choice (`model=gpt2_125m`) replaces the
whole group. A changed parallel layout or rank count is announced as a reshard (the checkpoint is resharded on
load, training/checkpoint/). Per-invocation keys (action, dry_run, wait, keys, run.dir) always come from now.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from training.contract.config import Config, config_from_dict, config_to_dict
from training.contract.layout_text import format_layout, layout_of
from training.contract.rundir.paths import RunPaths

GROUPS = ("model", "parallel", "cluster", "train", "data")
# Chosen anew by every invocation, never inherited from the saved run (with the command line's own option groups,
# launcher/cli/options.py, which config.json does not keep).
PER_INVOCATION = ("action", "dry_run", "wait", "keys", "run", "prepare", "status", "runs", "logs", "cancel")


def _override_key(text: str) -> tuple[str, bool]:
    """('parallel.tp', False) for 'parallel.tp=2'; ('model', True) for the group choice 'model=tiny'."""
    key = text.split("=", 1)[0].lstrip("+~").strip()
    if key.startswith("override "):
        key = key[len("override ") :].strip()
    return key, key in GROUPS


def _get_path(data: dict[str, Any], path: Sequence[str]) -> tuple[bool, Any]:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any, present: bool) -> None:
    for part in path[:-1]:
        data = data.setdefault(part, {})
    if present:
        data[path[-1]] = value
    else:
        data.pop(path[-1], None)


def layout_text(cfg: Config) -> str:
    """The layout in its short form (training/contract/layout_text.py), plus the ranks it runs on."""
    c = cfg.cluster
    return f"{format_layout(layout_of(cfg), 'short')} on {c.nodes}x{c.gpus_per_node} ranks"


def _sharding(cfg: Config) -> tuple[Any, ...]:
    """What decides how a checkpoint is cut: a change here is a reshard on load (batch sizes and recompute are not)."""
    lay = layout_of(cfg)
    return (
        lay.tp,
        lay.pp,
        lay.vpp,
        lay.cp,
        lay.dp,
        lay.ep,
        lay.zero,
        lay.sp,
        cfg.cluster.nodes,
        cfg.cluster.gpus_per_node,
    )


def merge_saved(saved: dict[str, Any], now: Config, overrides: Sequence[str]) -> tuple[Config, list[str]]:
    """The saved run's config with this command line's overrides (as composed in `now`) applied on top.

    Returns the config and the keys that changed against the saved run."""
    current = config_to_dict(now)
    merged = json.loads(json.dumps(saved))
    for key in PER_INVOCATION:
        if key in current:
            merged[key] = current[key]
    for text in overrides:
        key, is_group = _override_key(text)
        if not key or key.startswith("hydra") or key.split(".", 1)[0] in PER_INVOCATION:
            continue
        path = key.split(".")
        present, value = _get_path(current, path)
        _set_path(merged, path, value, present)
    if not any(_override_key(text)[0] in ("train.resume", "train") for text in overrides):
        # An explicit train.resume is a one-time choice of the launch that gave it (training/contract/rundir/resume_request.py):
        # starting again without one resumes from `latest`, it does not roll back or restart a second time.
        merged.setdefault("train", {})["resume"] = "auto"
    changed = sorted(_diff(saved, merged))
    return config_from_dict(merged), [k for k in changed if k.split(".", 1)[0] not in PER_INVOCATION]


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def saved_config(run_dir: str) -> dict[str, Any] | None:
    """The run's config.json as plain dicts, or None for a new run directory."""
    path = RunPaths(run_dir).config
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _refuse(message: str) -> None:
    from training.contract.exit_codes import EXIT_INVALID

    print(f"meshrun: {message}; nothing was written.", file=sys.stderr)
    raise SystemExit(EXIT_INVALID)


def _type_problems(obj: Any, prefix: str = "") -> list[str]:
    """Fields of a config rebuilt from config.json whose value has the wrong type (a string where a number
    belongs): config_from_dict checks names, not types, and such a value would fail later inside a rank."""
    import dataclasses

    out: list[str] = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints.get(f.name)
        if dataclasses.is_dataclass(value):
            out += _type_problems(value, f"{prefix}{f.name}.")
            continue
        allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        simple = [t for t in allowed if t in (int, float, bool, str, type(None))]
        if len(simple) != len(allowed):
            continue  # lists, dicts, enums: checked by the planner's own rules
        ok = any(isinstance(value, t) and not (t in (int, float) and isinstance(value, bool)) for t in simple)
        ok = ok or (float in simple and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            out.append(f"{prefix}{f.name}={value!r} (expected {' or '.join(t.__name__ for t in simple)})")
    return out


def checkpoint_conflict(run_dir: str, cfg: Config) -> str:
    """ "" when the checkpoint this launch would resume can take cfg's model; else why not, with the fix.
    Checked before anything is written: a launch that failed on it used to leave its model in config.json."""
    from training.checkpoint import storage

    mode = str(cfg.train.resume).strip().lower()
    if mode == "none":
        return ""
    steps = [int(mode)] if mode.isdigit() else storage.candidates(run_dir)
    now = config_to_dict(cfg).get("model", {})
    for step in steps:
        try:
            with open(os.path.join(storage.step_dir(run_dir, step), storage.CONFIG)) as f:
                saved = json.load(f).get("model", {})
        except (OSError, ValueError, AttributeError):
            continue  # damaged or missing: the engine skips it too (checkpoint_invalid)
        diff = [
            f"model.{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
            for k in storage.SHAPE_FIELDS
            if saved.get(k) != now.get(k)
        ]
        if diff:
            return (
                f"the checkpoint step_{step} in {run_dir} was written for another model shape "
                f"({'; '.join(diff)}): restore those settings, or start fresh with train.resume=none or a new "
                f"run.dir"
            )
        return ""
    return ""


def resume_config(run_dir: str, now: Config, overrides: Sequence[str]) -> Config:
    """`now` for a new run directory; for an existing run, its saved config with `overrides` on top
    (the resume and any reshard are announced on stderr). A config.json that cannot be read, names keys
    this version does not know or holds a value of the wrong type exits 2 naming the file (it is never
    replaced by the command line's defaults), and so does a model the checkpoint cannot take."""
    path = RunPaths(run_dir).config
    try:
        saved = saved_config(run_dir)
    except (OSError, ValueError) as exc:
        _refuse(
            f"{path} cannot be read ({exc}): restore it (a copy is in every checkpoint: "
            f"{run_dir}/checkpoints/step_<N>/config.json) or choose another run.dir"
        )
    if saved is None:
        if not os.path.isdir(RunPaths(run_dir).checkpoints):
            return now
        _refuse(
            f"{run_dir} has checkpoints but no config.json: restore it from the newest checkpoint "
            f"(cp {run_dir}/checkpoints/step_<N>/config.json {path}) or choose another run.dir"
        )
    if not isinstance(saved, dict):
        _refuse(
            f"{path} holds a JSON {type(saved).__name__}, not a configuration: restore it from "
            f"{run_dir}/checkpoints/step_<N>/config.json or choose another run.dir"
        )
    try:
        old = config_from_dict(saved)
        cfg, changed = merge_saved(saved, now, overrides)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        _refuse(
            f"{path} does not match this meshrun's configuration ({str(exc).strip(chr(39))}): fix or remove that "
            f"key in the file (`meshrun action=keys` lists the keys), or choose another run.dir"
        )
    wrong = _type_problems(old)
    if wrong:
        _refuse(
            f"{path} holds values of the wrong type: {'; '.join(wrong[:5])}: fix them in the file (or "
            f"restore it from {run_dir}/checkpoints/step_<N>/config.json)"
        )
    if now.action == "train":
        conflict = checkpoint_conflict(run_dir, cfg)
        if conflict:
            _refuse(conflict)
    note = f"meshrun: resuming {run_dir} with its saved configuration"
    note += f"; changed now: {', '.join(changed)}" if changed else " (no changes)"
    print(note, file=sys.stderr)
    if _sharding(old) != _sharding(cfg):
        print(
            f"meshrun: layout {layout_text(old)} -> {layout_text(cfg)}: the checkpoint is resharded on load",
            file=sys.stderr,
        )
    return cfg
