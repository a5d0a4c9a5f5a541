"""Keys the typed config does not have, and the nearest real key for each (no torch, no Hydra import).

Hydra's schema rejects `parallel.tpp=2`, but `+parallel.tpp=2` (the `+` that Hydra's own error message
suggests) adds the key to the composed config, and turning that config into the dataclasses then drops it
without a word. Every typed group is fixed: only dict fields (cluster.env, cluster.sbatch_extra, ...) take
new keys. This module finds the keys that would be dropped and suggests the nearest real one.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from launcher.cli.options import AppConfig


def all_keys(cls=AppConfig, prefix: str = "") -> list[str]:
    """Every key of the typed config, groups (parallel, cluster.preflight) and leaves alike."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out += all_keys(hints[f.name], key + ".")
    return out


def nearest_key(key: str, known: Iterable[str] | None = None) -> str | None:
    """The real key closest to a misspelt one: first among the keys of the same group, then anywhere."""
    known = list(known if known is not None else all_keys())
    group, _, leaf = key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == group]
    match = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.6)
    if match:
        return f"{group}.{match[0]}" if group else match[0]
    # A leaf name given under the wrong group (cluster.tp): the same leaf elsewhere.
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_keys(node: Any, cls=AppConfig, prefix: str = "") -> list[str]:
    """Keys of a composed config (a mapping: DictConfig or dict) that cls does not declare, depth first."""
    if not isinstance(node, Mapping) and not hasattr(node, "keys"):
        return []
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    out: list[str] = []
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in names:
            out.append(full)
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            value = node[key]
            if value is not None:
                out += unknown_keys(value, tp, full + ".")
    return out


def describe(keys: list[str]) -> list[tuple[str, str | None]]:
    """(unknown key, nearest real key or None) for each."""
    known = all_keys()
    return [(k, nearest_key(k, known)) for k in keys]


def message(keys: list[str]) -> str:
    """The error text: each unknown key with its suggestion, and where the keys are listed."""
    parts = []
    for key, near in describe(keys):
        parts.append(f"{key!r} is not a config key" + (f" (did you mean {near}?)" if near else ""))
    return (
        "; ".join(parts) + ". Typed groups take no new keys, even with a leading '+' (only dict fields such as "
        "cluster.env do); `meshrun action=keys` lists every key"
    )


def argv_keys(argv: Iterable[str]) -> list[str]:
    """The keys of command-line overrides (key=value, +key=value, ++key=value, ~key) that the typed config lacks;
    Hydra's own keys (hydra.*) and flags are left alone."""
    known = set(all_keys())
    dict_fields = _dict_fields()
    out = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg and not arg.startswith("~"):
            continue
        key = arg.lstrip("+~").partition("=")[0].strip()
        if not key or key.startswith("hydra") or "/" in key or key in known:
            continue
        if any(key.startswith(d + ".") for d in dict_fields):
            continue
        out.append(key)
    return out


def _dict_fields(cls=AppConfig, prefix: str = "") -> list[str]:
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _dict_fields(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is dict:
            out.append(f"{prefix}{f.name}")
    return out


# Characters Hydra's override grammar gives a meaning to (lists, dicts, functions, interpolation, quoting):
# a value holding any of them, or a space, must be quoted for Hydra as well as for the shell.
_GRAMMAR = set("()[]{},:='\"$ \\")


def quoting_hint(argv: Iterable[str]) -> str:
    """For the first key=value whose value Hydra's grammar would parse (spaces, brackets, commas, quotes): how to
    quote it, and the file alternative for prompts; empty when no value needs it."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.startswith("-") or not set(value) & _GRAMMAR:
            continue
        if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) > 1:
            continue  # already quoted for Hydra
        if (
            (value[:1], value[-1:]) in (("[", "]"), ("{", "}"))
            or value.startswith("${")
            or all(ch.isalnum() or ch in "._-/,+" for ch in value)
        ):
            continue  # a list, a dict, an interpolation, a sweep's values: meant for the grammar
        inner = value.replace("\\", "\\\\").replace('"', '\\"')
        text = (
            f"the value of {key.lstrip('+~')} holds characters Hydra's override grammar reads (spaces, ( ) [ ] "
            f"{{ }} , : = quotes): quote it for Hydra inside the shell's quotes, e.g. '{key}=\"{inner}\"'"
        )
        if key.lstrip("+~") == "generate.prompt":
            text += ", or put the text in a file: generate.prompt_file=prompt.txt"
        return text
    return ""
