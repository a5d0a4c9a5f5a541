"""docs/KEYS.md is the schema's key listing (launcher/cli/keys_doc.py): every key of training/contract/config.py
with its type, default and docstring, and every packaged preset; a key added or changed without regenerating it
fails here with the command that regenerates it."""

from __future__ import annotations

import os

from helpers import ROOT

from launcher.cli.keys import iter_keys
from launcher.cli.keys_doc import KEYS_MD, REGENERATE, generated


def test_keys_md_is_generated_from_the_schema():
    assert os.path.samefile(KEYS_MD, os.path.join(ROOT, "docs", "KEYS.md"))
    with open(KEYS_MD, encoding="utf-8") as f:
        text = f.read()
    assert text == generated(), f"docs/KEYS.md is stale (a key, default, docstring or preset changed): run {REGENERATE}"
    for key, *_ in iter_keys():
        assert f"| `{key}` |" in text


def test_keys_md_is_linked_from_readme_and_contributing():
    for doc in ("README.md", "CONTRIBUTING.md"):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            assert "docs/KEYS.md" in f.read(), doc
