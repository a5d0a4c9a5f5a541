"""Static checks of the whole tree with ruff's lint (settings: pyproject.toml [tool.ruff]): no undefined names (a
typo in a rarely taken branch, such as an error path, would otherwise only show when it runs), no unused imports or
variables, no statements run together. `make lint` also runs mypy; `make test` and `make check` run `make lint`."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

TREE = ("launcher", "training", "hydra_plugins", "bench", "tests")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_lint_finds_nothing():
    res = _ruff("check", "--no-cache", *TREE)
    assert "No module named ruff" not in res.stderr, "pip install -e '.[test]' installs ruff"
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_lint_catches_an_undefined_name(tmp_path):
    # The settings in force do catch what the test is for (a typo in a branch that rarely runs).
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    if x:\n        return undefined_name\n    return x\n")
    res = _ruff("check", "--no-cache", "--config", os.path.join(ROOT, "pyproject.toml"), str(bad))
    assert res.returncode == 1 and "F821" in res.stdout, res.stdout + res.stderr


def test_ruff_format_leaves_the_tree_as_it_is():
    # The tree is kept in ruff's format (pyproject.toml [tool.ruff.format]); `ruff format` fixes a failure here.
    res = _ruff("format", "--check", "--no-cache", *TREE)
    assert res.returncode == 0, res.stdout + res.stderr
