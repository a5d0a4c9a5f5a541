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
