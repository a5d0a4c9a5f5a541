"""meshrun's own diagnosis of the command line, before Hydra composes anything (no torch, no Hydra import).

Hydra's messages for a bare word (`meshrun plan`: "missing EQUAL at '<EOF>'"), an unknown preset (a search path
dump) or a value outside a choice field's set come first and name Hydra's grammar, not what to type. These
cheap checks catch the common cases first and alone: each names the nearest real action, preset or value and a
`fix:` line that is the user's own command with the one argument corrected. Anything they do not recognise is
left to Hydra and the typed config, as before.
"""

from __future__ import annotations

import difflib
import importlib.resources
import shlex
from collections.abc import Sequence

from launcher.cli.actions import BY_NAME
from launcher.cli.options import CHOICE_FIELDS, choices

GROUPS = ("model", "parallel", "cluster", "train", "data")
# Hydra's flags that take a value (the next argument), and the ones that add config directories of one's own.
_FLAGS_WITH_VALUE = {"--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--cfg", "-c"}
_FLAGS_WITH_VALUE |= {"--package", "-p", "--experimental-rerun", "--info", "-i"}
_OWN_PRESETS = ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath")


def presets(group: str) -> list[str]:
    """The packaged presets of a config group (conf/<group>/*.yaml, installed as meshrun_conf)."""
    try:
        folder = importlib.resources.files("meshrun_conf") / group
        return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        return []


def nearest(word: str, known: Sequence[str]) -> str | None:
    """The closest of known to word (`llama3-8b` -> llama3_8b, `allgather` -> all_gather), or None."""
    canon = {k.replace("-", "_").lower(): k for k in known}
    w = word.replace("-", "_").lower()
    if w in canon:
        return canon[w]
    squeezed = {k.replace("_", ""): v for k, v in canon.items()}
    if w.replace("_", "") in squeezed:
        return squeezed[w.replace("_", "")]
    match = difflib.get_close_matches(w, list(canon), n=1, cutoff=0.6)
    return canon[match[0]] if match else None


def _overrides(argv: Sequence[str]) -> list[tuple[int, str]]:
    """(index, argument) of the overrides, Hydra's flags and their values skipped."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _FLAGS_WITH_VALUE
        else:
            out.append((i, arg))
    return out


def _fix(argv: Sequence[str], index: int, replacement: str) -> str:
    words = list(argv)
    words[index] = replacement
    return "meshrun " + " ".join(shlex.quote(w) for w in words)


def _values(value: str) -> list[str] | None:
    """A plain value or a sweep's comma list; None for Hydra's functions, interpolations and lists."""
    if any(c in value for c in "${}[]()'\"*"):
        return None
    return value.split(",")


def _unknown_key(argv: Sequence[str]) -> str | None:
    """A key the typed config lacks (`parallel.tpp=2`, `+parallel.tpp=2`): meshrun's words instead of Hydra's
    'use +parallel.tpp=2', which typed groups refuse anyway (launcher/cli/unknown_keys.py)."""
    from launcher.cli.unknown_keys import argv_keys, message, nearest_key

    unknown = argv_keys(argv)
    if not unknown:
        return None
    for i, arg in _overrides(argv):
        key, sep, value = arg.lstrip("+~").partition("=")
        if key.strip() == unknown[0]:
            near = nearest_key(unknown[0])
            fix = _fix(argv, i, f"{near}={value}") if near and sep else "meshrun action=keys"
            return f"{message(unknown)}\nfix: {fix}"
    return None


def problem(argv: Sequence[str]) -> str | None:
    """The first argument meshrun can diagnose, as 'what is wrong (did you mean ...)\\nfix: meshrun ...'."""
    found = _unknown_key(argv)
    if found:
        return found
    actions = list(BY_NAME)
    own_presets = any(a.split("=")[0].lstrip("+~") in _OWN_PRESETS for a in argv)
    for i, arg in _overrides(argv):
        key, sep, value = arg.partition("=")
        if not sep:
            if arg.startswith("~"):
                continue  # Hydra's deletion takes no value
            guess = nearest(arg, actions)
            if guess:
                return (
                    f"{arg!r} is not an override: an action is chosen with action=<name> (did you mean "
                    f"action={guess}?)\nfix: {_fix(argv, i, f'action={guess}')}"
                )
            return (
                f"{arg!r} is not an override: every argument is key=value (`meshrun --help` lists the actions and "
                "presets)\nfix: meshrun --help"
            )
        key = key.lstrip("+")
        values = _values(value)
        if values is None:
            continue
        if key == "action":
            known, what = actions, "action"
        elif key in GROUPS and not own_presets:
            known, what = presets(key), f"{key} preset"
        elif key in CHOICE_FIELDS:
            known, what = list(choices(key)), f"value of {key}"
        elif key == "parallel.cp_comm":
            from training.contract.layout_rules import CP_COMMS

            known, what = list(CP_COMMS), f"value of {key}"
        else:
            continue
        if not known:
            continue
        for v in values:
            if v in known:
                continue
            guess = nearest(v, known)
            listed = ", ".join(known)
            if guess is None:
                fix = _fix(argv, i, f"{key}={known[0]}") if what.startswith("value") else "meshrun --help"
                return f"{v!r} is not {_a(what)}: expected one of [{listed}]\nfix: {fix}"
            fixed = ",".join(guess if x == v else x for x in values)
            prefix = arg[: len(arg) - len(arg.lstrip("+"))]
            return (
                f"{v!r} is not {_a(what)} (did you mean {guess}?): expected one of [{listed}]\n"
                f"fix: {_fix(argv, i, f'{prefix}{key}={fixed}')}"
            )
    return None


def _a(what: str) -> str:
    return ("an " if what[0] in "aeiou" else "a ") + what
