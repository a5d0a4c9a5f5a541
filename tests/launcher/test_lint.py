"""Static checks of the whole tree: no undefined names (a typo in a rarely taken branch, such as an
error path, would otherwise only show when it runs), no unused imports or variables."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT



def test_pyflakes_finds_nothing():
    res = subprocess.run([sys.executable, "-m", "pyflakes", "launcher", "training", "hydra_plugins", "bench", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named pyflakes" not in res.stderr, "pip install -e '.[test]' installs pyflakes"
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr
