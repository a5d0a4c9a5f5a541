"""`meshrun ARGS` inside the test process: the console entry point (launcher/cli/app.py's cli) with sys.argv set,
stdout and stderr captured, the exit code taken from its SystemExit (0 when it returns).

A subprocess costs ~2 s of Python start-up and imports on two shared cores; this costs the command alone.
It runs exactly what the console script runs (the same cli(), Hydra's own argument parsing and logging);
what it cannot show (the installed script, a fresh interpreter) is the subprocess smoke tests' part
(tests/launcher/cli/test_cli.py: test_plan_writes_plan_json, tests/repo/test_packaging.py). Commands that start ranks or
submit jobs belong in a subprocess, not here.

    res = run_cli("action=plan", f"run.dir={d}", cwd=tmp_path)
    assert res.returncode == 2 and "fix" in res.stderr
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from dataclasses import dataclass

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import ROOT
from launcher.cli.schema import register
from training.contract.config import Config

register()


@dataclass
class CliResult:
    """What subprocess.run(..., capture_output=True, text=True) gives, for the same assertions."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, cwd: str | None = None) -> CliResult:
    from hydra.core.global_hydra import GlobalHydra

    import launcher.cli.app as app

    out, err = io.StringIO(), io.StringIO()
    argv, here, environ = sys.argv, os.getcwd(), dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    code = 0
    try:
        if cwd is not None:
            os.chdir(str(cwd))
        sys.argv = ["meshrun", *[str(a) for a in args]]
        app._task_started = False  # per command, as in a fresh process
        GlobalHydra.instance().clear()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                app.cli()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
    finally:
        sys.argv = argv
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        GlobalHydra.instance().clear()
        # Hydra's logging config adds handlers bound to the captured streams: put the test's back.
        root.handlers[:] = handlers
        root.setLevel(level)
    return CliResult(code, out.getvalue(), err.getvalue())


def meshrun(*args: str, cwd: str) -> CliResult:
    """run_cli with the working directory named (the CLI tests' spelling)."""
    return run_cli(*args, cwd=cwd)


def compose_cfg(*overrides: str) -> Config:
    """A Config built from the conf/ groups exactly as the CLI builds it."""
    with initialize_config_dir(version_base=None, config_dir=os.path.join(ROOT, "conf")):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))
