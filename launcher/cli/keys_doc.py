"""docs/KEYS.md: every config key with its type, default and docstring, generated from `action=keys`' listing
(launcher/cli/keys.py iter_keys, the dataclasses of launcher/cli/options.py AppConfig) and the packaged presets.

    make keys-doc                                  # or: .venv/bin/python -m launcher.cli.keys_doc
    .venv/bin/python -m launcher.cli.keys_doc --check   # exit 1 when docs/KEYS.md is not what this generates

tests/launcher/cli/test_keys_doc.py fails when docs/KEYS.md is stale (a key, a default, a docstring or a preset changed).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from launcher.cli.keys import GROUPS, iter_keys

KEYS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "KEYS.md")
REGENERATE = "make keys-doc  (or: .venv/bin/python -m launcher.cli.keys_doc)"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(presets: Callable[[str], list[str]] | None = None) -> str:
    """The text of docs/KEYS.md: one table per section, keys in declaration order."""
    lines = [
        "# Every key",
        "",
        "Generated from the config schema (training/contract/config.py, the ranks' keys; launcher/cli/options.py, the",
        "command line's own; as `meshrun action=keys` prints it) by",
        "`make keys-doc`; do not edit by hand. Set a key on the command line as `section.key=value` and pick a",
        "preset of a group as `group=preset`; `meshrun action=keys keys.group=G` prints one section with the values",
        "your command line would use.",
    ]
    current = None
    for key, tp, default, doc in iter_keys():
        head = key.split(".", 1)[0] if "." in key else ""
        if head != current:
            current = head
            lines += ["", f"## {head or 'top level'}", ""]
            names = presets(head) if presets is not None and head in GROUPS else []
            if names:
                lines += [f"Presets (`{head}=NAME`): {', '.join(f'`{n}`' for n in names)}.", ""]
            lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        lines.append(f"| `{key}` | {_cell(tp)} | `{_cell(default)}` | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def _packaged_presets(group: str) -> list[str]:
    from launcher.cli.precheck import presets

    return presets(group)


def generated() -> str:
    return markdown(_packaged_presets)


def main(argv: list[str]) -> int:
    text = generated()
    if "--check" in argv:
        try:
            with open(KEYS_MD, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
        if current != text:
            print(f"docs/KEYS.md is stale; regenerate it with: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    with open(KEYS_MD, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {KEYS_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
