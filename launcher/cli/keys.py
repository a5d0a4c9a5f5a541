"""`meshrun action=keys [keys.group=G]`: every config key with its type, default and docstring.

The docstrings are the attribute docstrings of the schema's modules (launcher/cli/options.py SCHEMA_MODULES: the
string under each field), read from their source with `ast`, so the printed text is exactly what the code documents.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterator
from enum import Enum

from launcher.cli.actions import action_doc
from launcher.cli.options import SCHEMA_MODULES, AppConfig
from training.contract.exit_codes import EXIT_INVALID


@functools.lru_cache(maxsize=1)
def field_docstrings() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the docstring written under the field in the schema's modules (parsed once per
    process: action=keys asks once per dataclass)."""
    docs: dict[tuple[str, str], str] = {}
    body = [
        node for name in SCHEMA_MODULES for node in ast.parse(inspect.getsource(importlib.import_module(name))).body
    ]
    for node in body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, following in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = inspect.cleandoc(following.value.value)
    # The actions' summaries come from the action table itself (launcher/cli/actions.py), never a second list.
    docs[("Config", "action")] += "\n" + action_doc()
    return docs


def _type_name(tp) -> str:
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "|".join(m.value for m in tp)
    if isinstance(tp, type):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"{_type_name(rest[0])} or null" if len(rest) == 1 else str(tp)
    if origin in (list, list):
        return f"list[{_type_name(args[0])}]"
    if origin in (dict, dict):
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    return str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    return _show(value)


def _show(value) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    return "null" if value is None else repr(value)


def effective_value(cfg: AppConfig, key: str) -> str:
    """A key's value in a composed config (the presets of conf/config.yaml and the command line applied), shown
    as the built-in default is."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return _show(obj)


def iter_keys(cls=AppConfig, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, docstring) for every leaf key, depth first in declaration order."""
    docs = field_docstrings()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, key + ".")
            continue
        yield key, _type_name(tp), _default(f), docs.get((_declared_in(cls, f.name), f.name), "")


def _declared_in(cls: type, name: str) -> str:
    """The name of the class that declares field `name` (AppConfig inherits Config's fields and their docstrings)."""
    return next(c.__name__ for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


GROUPS = ("model", "parallel", "cluster", "train", "data", "run")


def format_keys(
    group: str = "", presets: Callable[[str], list[str]] | None = None, effective: AppConfig | None = None
) -> str:
    """The text `action=keys` prints; `presets(group)` lists a group's presets when given. With `effective` (the
    composed config of this invocation) each key shows the value a launch with these arguments uses, and the
    built-in default of the schema, and beside it `(effective: V)` where the presets or the command line
    make it differ."""
    lines: list[str] = []
    current = None
    for key, tp, default, doc in iter_keys():
        head = key.split(".", 1)[0] if "." in key else ""
        if group and head != group:
            continue
        if head != current:
            current = head
            title = head or "top level"
            if head and presets is not None and head in GROUPS:
                names = presets(head)
                if names:
                    title += f" (presets: {', '.join(names)})"
            lines.append(("\n" if lines else "") + f"== {title}")
        value = effective_value(effective, key) if effective is not None else default
        lines.append(f"{key}: {tp} = {default}" + (f"    (effective: {value})" if value != default else ""))
        for text in doc.splitlines():
            lines.append(f"    {text}")
    return "\n".join(lines)


def print_keys(
    group: str, presets: Callable[[str], list[str]] | None = None, effective: AppConfig | None = None
) -> None:
    # Every section of the config (the groups, and action sections such as export and generate).
    sections = sorted({key.split(".", 1)[0] for key, *_ in iter_keys() if "." in key})
    if group and group not in sections:
        print(
            f"meshrun: keys.group={group!r} is not a config group; use one of {', '.join(sections)} "
            f"(or leave it empty for every key)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    if effective is not None:
        print(
            "== key: type = built-in default (training/contract/config.py, launcher/cli/options.py)    (effective: the value a launch with these "
            "arguments uses, after conf/config.yaml's presets and the command line, where it differs)"
        )
    print(format_keys(group, presets, effective))


def keys_action(cfg: AppConfig, run_dir: str | None = None) -> None:
    """action=keys (the action table, launcher/cli/actions.py)."""
    from launcher.cli.fast import presets  # the packaged presets (launcher/cli/fast.py composed without Hydra)

    if "hydra" in sys.modules:
        from hydra.core.global_hydra import GlobalHydra

        if GlobalHydra.instance().is_initialized():  # Hydra's view of the conf tree (a --config-dir's presets too)
            from launcher.cli.app import _presets as presets
    return print_keys(cfg.keys.group, presets=presets, effective=cfg)
