"""The read-only commands without Hydra: `meshrun --help`, `action=keys`, `action=status`, `action=logs` and
`action=runs` answer in well under half a second (bench/bench_cli.py measures them beside `import hydra`).

Hydra's own path composes the config twice per process (once to learn the run mode, once to run) and its
`--help` deep-copies the structured config once per config group option (75 times): seconds on a loaded machine.
These commands only read files, so they compose once, here: conf/config.yaml's default presets, the command
line's group choices and `group.key=value` overrides, typed by the dataclasses of launcher/cli/options.py AppConfig.
Anything this simple composition does not cover (Hydra flags such as --config-dir, sweeps, interpolations, list or
dict values, a `+`/`~` prefix, a preset with other defaults) returns None and the command takes Hydra's path, which
also gives the error messages. tests/launcher/cli/test_cli_fast.py holds this composition equal to Hydra's.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.resources
import os
import types
import typing
from collections.abc import Sequence
from enum import Enum
from typing import Any

from launcher.cli.actions import BY_NAME, help_lines
from launcher.cli.precheck import presets

FAST_ACTIONS = ("keys", "status", "logs", "runs")
"""The actions that read files only (the action table, launcher/cli/actions.py)."""
GROUPS = ("model", "parallel", "cluster", "train", "data")
_PLAIN = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./:@%+")


def _conf(*parts: str) -> Any:
    return importlib.resources.files("meshrun_conf").joinpath(*parts)


__all__ = ["presets", "compose", "fast_path", "help_text"]


def _yaml(*parts: str) -> dict[str, Any]:
    import yaml

    with _conf(*parts).open() as f:
        data = yaml.safe_load(f) or {}
    return data if isinstance(data, dict) else {}


def _root_choices() -> dict[str, str] | None:
    """conf/config.yaml's default preset of each group."""
    choices: dict[str, str] = {}
    for entry in _yaml("config.yaml").get("defaults", []):
        if isinstance(entry, dict):
            for key, value in entry.items():
                if key in GROUPS:
                    choices[key] = str(value)
    return choices if set(choices) == set(GROUPS) else None


def _preset(group: str, name: str, overridden: dict[str, str]) -> dict[str, Any] | None:
    """A preset's keys; its `override /G@_global_.G: X` defaults go into overridden (None: another form)."""
    data = _yaml(group, f"{name}.yaml")
    for entry in data.pop("defaults", []) or []:
        if not isinstance(entry, dict) or len(entry) != 1:
            return None
        ((key, value),) = entry.items()
        head = str(key).split()
        if len(head) != 2 or head[0] != "override":
            return None
        target, _, package = head[1].lstrip("/").partition("@")
        if target not in GROUPS or package != f"_global_.{target}":
            return None
        overridden.setdefault(target, str(value))
    return data


def _field_type(cls: Any, path: Sequence[str]) -> Any:
    hints = typing.get_type_hints(cls)
    if path[0] not in hints:
        return None
    tp = hints[path[0]]
    return (
        _field_type(tp, path[1:])
        if len(path) > 1 and dataclasses.is_dataclass(tp)
        else (tp if len(path) == 1 else None)
    )


def _typed(tp: Any, text: str) -> Any:
    """text as a value of type tp (raises ValueError when it is not one, or tp is not a scalar)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        if text in ("null", "None"):
            return None
        tp = next(a for a in args if a is not type(None))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(text).value
    if tp is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    if tp is str:
        return text
    raise ValueError(f"not a scalar field: {tp}")


def _set(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for part in path[:-1]:
        data = data.setdefault(part, {})
    data[path[-1]] = value


def compose(argv: Sequence[str]) -> Any | None:
    """The AppConfig Hydra would compose for argv, or None where this composition does not apply."""
    from launcher.cli.options import AppConfig, app_config_from_dict

    choices, keys = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not value or not set(arg) <= _PLAIN | {"="} or "=" in value or "," in value:
            return None
        if key in GROUPS:
            if value not in presets(key):
                return None
            choices[key] = value
        elif "." in key or key == "action":
            keys.append((key, value))
        else:
            return None
    root = _root_choices()
    if root is None:
        return None
    overridden: dict[str, str] = {}
    groups: dict[str, Any] = {}
    for group in ("model", "cluster", "train", "data", "parallel"):  # parallel last: a cluster may choose it
        name = choices.get(group) or overridden.get(group) or root[group]
        data = _preset(group, name, overridden)
        if data is None:
            return None
        groups[group] = data
    from launcher.cli.early import unique_suffix

    now = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    merged: dict[str, Any] = {**groups, "run": {"dir": f"runs/{now}-{unique_suffix()}"}}
    for key, value in keys:
        path = key.split(".")
        tp = _field_type(AppConfig, path)
        if tp is None:
            return None
        try:
            _set(merged, path, _typed(tp, value))
        except (ValueError, KeyError, StopIteration):
            return None
    try:
        return app_config_from_dict(_enums(AppConfig, merged))
    except (KeyError, TypeError, ValueError):
        return None


def _scalar(tp: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def _enums(cls: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Choice fields as their Enum members and float fields as floats (what Hydra's schema gives)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        tp = hints.get(key)
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _enums(tp, value)
        elif isinstance(tp, type) and issubclass(tp, Enum) and value is not None:
            value = tp(value)
        elif _scalar(tp) is float and isinstance(value, (int, str)) and not isinstance(value, bool):
            value = float(value)  # PyYAML reads 1e-5 as a string (YAML 1.1), Hydra's schema as a float
        out[key] = value
    return out


def help_text() -> str:
    """`meshrun --help`: conf/config.yaml's help template, the presets listed from conf/ directly."""
    template = _yaml("config.yaml")["hydra"]["help"]["template"]
    groups = "\n".join(f"{g}: {', '.join(presets(g))}" for g in sorted(GROUPS))
    flags = (
        "--help,-h : this help\n--hydra-help : Hydra's help (its flags: --cfg job, --config-dir DIR, -m, ...)\n"
        "--version : meshrun's version"
    )
    # The actions' lines come from the action table, as Hydra's help gets them (launcher/cli/schema.py's resolver).
    text = template.replace("${meshrun_actions:}", help_lines())
    return text.replace("$APP_CONFIG_GROUPS", groups + "\n").replace("$FLAGS_HELP", flags)


def fast_path(argv: Sequence[str]) -> bool:
    """Run argv here when it is --help or a read-only action this composition covers; False: take Hydra's path."""
    if list(argv) in (["--help"], ["-h"]):
        print(help_text())
        raise SystemExit(0)
    actions = [a.partition("=")[2] for a in argv if a.startswith("action=")]
    if len(actions) != 1 or actions[0] not in FAST_ACTIONS:
        return False
    spec = BY_NAME[actions[0]]
    if spec.locks or spec.config == "launch":
        return False
    cfg = compose(argv)
    if cfg is None:
        return False
    function = getattr(importlib.import_module(spec.module), spec.function)
    if spec.config == "composed":
        function(cfg, None)
        return True
    # As launcher/cli/app.py's run_action: run.dir made absolute, runs/latest followed.
    from launcher.manage.latest import resolve_latest

    run_dir = resolve_latest(os.path.abspath(cfg.run.dir))
    cfg.run.dir = run_dir
    function(cfg, run_dir)
    return True
