"""The test tree's own rules (tests/conftest.py, tests/helpers/__init__.py): no test module imports another test
module (shared code lives in tests/helpers/), and two test files never share a base name (pytest imports them by
base name: a second one would shadow the first, and a spawned rank would import the wrong one)."""

from __future__ import annotations

import ast
import glob
import os

from helpers import ROOT


def _test_files():
    return sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True))


def test_no_test_module_imports_another():
    found = []
    for path in _test_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if any(part.startswith("test_") or part in ("tests", "conftest") for part in name.split(".")):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: import {name}")
    assert not found, "move what they share into tests/helpers/:\n" + "\n".join(found)


def test_test_file_base_names_are_unique():
    seen = {}
    for path in _test_files():
        seen.setdefault(os.path.basename(path), []).append(os.path.relpath(path, ROOT))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_longest_first_order_names_existing_files_and_comes_first(request):
    """tests/conftest.py's LONGEST_FIRST: every file it names exists (a renamed file would silently fall back to
    xdist's order), and a collection puts their tests before every other file's, in that order."""
    with open(os.path.join(ROOT, "tests", "conftest.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (names,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LONGEST_FIRST" for t in node.targets)
    ]
    assert names and all(os.path.isfile(os.path.join(ROOT, n)) for n in names), names
    collected = []
    for item in request.session.items:
        rel = os.path.relpath(str(item.path), ROOT)
        if not collected or collected[-1] != rel:
            collected.append(rel)
    listed = [n for n in names if n in collected]  # a selection (-k, one file) may leave some out
    assert collected[: len(listed)] == listed, collected[:20]
