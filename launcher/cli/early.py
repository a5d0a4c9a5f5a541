"""What the command line is checked for before Hydra is imported (launcher/cli/main.py, launcher/cli/app.py)."""

from __future__ import annotations

import datetime
import os
import sys

from training.contract.exit_codes import EXIT_INVALID

_DIR_KEYS = ("run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.run.dir")


def _reject_control_characters(argv: list[str]) -> None:
    """A directory given with a control character (newline, tab, escape) exits 2 before Hydra creates it
    (a sweep directory is created before any point runs; training/contract/rundir/config_files.py says why they are refused)."""
    from training.contract.rundir.config_files import path_problem

    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key in _DIR_KEYS and path_problem(value, key):
            print(f"meshrun: {path_problem(value, key)}; nothing was launched.", file=sys.stderr)
            raise SystemExit(EXIT_INVALID)


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or "unknown" from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshrun")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


_UNIQUE = []


def unique_suffix() -> str:
    """Microseconds and pid of this invocation, the same for every use within it: two launches in the same
    second get two run directories (conf/config.yaml: run.dir, hydra.sweep.dir). The run lock
    (training/contract/rundir/lock.py) still refuses the rare collision that remains."""
    if not _UNIQUE:
        _UNIQUE.append(f"{datetime.datetime.now().microsecond:06d}-{os.getpid()}")
    return _UNIQUE[0]
