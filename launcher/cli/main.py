"""The `meshrun` console entry point: `--version`, meshrun's own diagnosis of the command line, and the read-only
commands (launcher/cli/fast.py) before Hydra is imported; everything else through Hydra (launcher/cli/app.py)."""

from __future__ import annotations

import sys

from training.contract.exit_codes import EXIT_INVALID


def main() -> None:
    from launcher.cli.early import _reject_control_characters, _version

    argv = sys.argv[1:]
    if argv == ["--version"]:  # meshrun's, not Hydra's (Hydra's --version names Hydra)
        print(f"meshrun {_version()}")
        raise SystemExit(0)
    _reject_control_characters(argv)
    from launcher.cli.precheck import problem

    found = problem(argv)  # meshrun's diagnosis first and alone (launcher/cli/precheck.py)
    if found:
        print(f"meshrun: invalid configuration; nothing was launched. {found}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    from launcher.cli.fast import fast_path

    if fast_path(argv):  # False: the command takes Hydra's path
        return
    from launcher.cli.app import cli

    cli()
