"""The configuration files of a run directory: config.json for the ranks, config.yaml for people (written here
only); and the checks of a run.dir path before a launch writes there (path_problem, foreign_problem)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import yaml  # PyYAML, which OmegaConf itself depends on

from training.contract.config import Config, config_to_dict
from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import CHECKPOINTS_DIR, EVENTS_FILE, LOCK_FILE, PLAN_FILE, RunPaths
from training.contract.rundir.secret_env import split_given, write_secrets


def write_config(cfg: Config, run_dir: str) -> None:
    """run_dir/config.json (what every rank reads) and run_dir/config.yaml (the same for people, docs/USER_CONTRACTS.md),
    each written to a temporary name and renamed (a reader never sees half a file). Secret env values
    (cluster.secret_keys) are replaced by a placeholder and kept in run_dir/secrets.json (0600), with the
    values the command line gave for placeholders (launcher/cli/secret_args.py)."""
    os.makedirs(run_dir, exist_ok=True)
    public, secret = split_given(cfg.cluster.env, cfg.cluster.secret_keys)
    write_secrets(run_dir, secret)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, env=public))
    plain = config_to_dict(cfg)
    # json.dumps without indent: json's C encoder runs only for a one-shot dumps without one (json.dump
    # to a file always encodes in Python); config.yaml is the copy for people. Never through a link.
    write_atomic(RunPaths(run_dir).config, json.dumps(plain, sort_keys=True))
    write_atomic(RunPaths(run_dir).config_yaml, config_yaml(plain))


# Plain dicts, not OmegaConf.structured, which a sweep would pay once per point; libyaml's emitter where PyYAML
# has it (the same YAML, faster than the pure-Python one). Figures: docs/PERFORMANCE.md "Plan sweep".
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# (top-level key, repr of its value) -> that section's YAML text. Bounded: cleared when full.
_SECTIONS: dict = {}
_MAX_SECTIONS = 512


def config_yaml(plain: dict) -> str:
    """yaml.dump(plain) in block style, key order kept, built from cached top-level sections.

    A block mapping's text is its items' texts one after another, so dumping {key: value} per top-level
    key gives the same text. PyYAML builds its node tree in Python even with libyaml's emitter
    (docs/PERFORMANCE.md "Plan sweep"); the points of a sweep differ in a section or two (parallel, cluster), so the
    others come from the cache. The key is the value's repr, which tells 1, 1.0 and True apart."""
    if not plain:
        return yaml.dump(plain, Dumper=_DUMPER)
    if len(_SECTIONS) > _MAX_SECTIONS:
        _SECTIONS.clear()
    parts = []
    for key, value in plain.items():
        signature = (key, repr(value))
        text = _SECTIONS.get(signature)
        if text is None:
            text = _SECTIONS[signature] = yaml.dump({key: value}, Dumper=_DUMPER, sort_keys=False)
        parts.append(text)
    return "".join(parts)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def path_problem(path: str, key: str = "run.dir") -> str:
    """ "" for a usable run or sweep directory; else why not: a control character (a newline, a tab, ...) in
    a path breaks every log line and shell line that names it, and is never intended."""
    if _CONTROL.search(str(path)):
        return (
            f"{key}={str(path)!r} contains a control character (newline, tab, escape, ...): choose a "
            f"directory name without them (for a sweep: hydra.sweep.dir and hydra.sweep.subdir)"
        )
    return ""


# Files only meshrun writes: a directory holding one of them is a run directory (a copy of one included).
_RUN_MARKERS = (LOCK_FILE, EVENTS_FILE, PLAN_FILE, CHECKPOINTS_DIR)


def foreign_problem(run_dir: str) -> str:
    """ "" for a new, empty or meshrun run directory; else why a launch must not write there: a directory
    meshrun did not create (a model download, a project folder) would lose its own config.json, and a
    symbolic link among the files meshrun writes would send a write outside run.dir (training/contract/rundir/files.py)."""
    from training.contract.rundir.files import links_in

    if os.path.islink(run_dir):
        return (
            f"run.dir={run_dir} is a symbolic link: meshrun writes a run only into a real directory. Give the "
            f"link's target (realpath) as run.dir, or choose another run.dir"
        )
    if not os.path.isdir(run_dir):
        return "" if not os.path.exists(run_dir) else f"run.dir={run_dir} exists and is not a directory; choose another"
    try:
        names = sorted(os.listdir(run_dir))
    except OSError as exc:
        return f"run.dir={run_dir} cannot be listed ({exc.strerror}); fix its permissions or choose another run.dir"
    if names and not any(m in names for m in _RUN_MARKERS):
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return (
            f"run.dir={run_dir} is an existing directory meshrun did not create (it holds {shown} and none of "
            f"{', '.join(_RUN_MARKERS)}): a launch there would overwrite its files (config.json, plan.json). "
            f"Choose a new or empty run.dir; nothing was written"
        )
    links = links_in(run_dir)
    if links:
        return (
            f"run.dir={run_dir} holds symbolic links where meshrun writes ({', '.join(links[:5])}): a write "
            f"would land outside run.dir. Remove them (and check who could create them), or choose another run.dir; "
            f"nothing was written"
        )
    if not os.access(run_dir, os.W_OK):
        return (
            f"run.dir={run_dir} is not writable by you: make it writable (chmod u+w {run_dir}) or choose "
            f"another run.dir; nothing was written"
        )
    return ""
