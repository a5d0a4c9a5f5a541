"""Secret values on the command line (+cluster.env.HF_TOKEN=...) are taken out before Hydra sees them.

Hydra copies every override into what it prints and writes: a sweep's point lines ("#0 : ..."),
multirun.yaml, each point's overrides (point.json, sweep.json, the summary table) and the pickles that
joblib and submitit hand to their workers. So the CLI replaces each secret value (a cluster.env key that
matches cluster.secret_keys, training/contract/rundir/secret_env.py) with the placeholder, quoted for Hydra's grammar,
and hands the value on in the environment (training/contract/rundir/secret_env.py: ARGS_ENV), which every process that
runs a point inherits; write_config stores it in the run directory's secrets.json (0600), where the ranks
read it, also on a relaunch that gives no value. Pure Python plus Hydra's override parser; no torch.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.secret_env import ARGS_ENV, DEFAULT_PATTERNS, PLACEHOLDER, is_secret

ENV_PREFIX = "cluster.env."


def _split(arg: str) -> tuple[str, str, str]:
    """(prefix + ~ as typed, key, value text) of key=value; ("", "", "") for anything else."""
    head, sep, value = arg.partition("=")
    key = head.lstrip("+~")
    return (head[: len(head) - len(key)], key, value) if sep else ("", "", "")


def _patterns(argv: Sequence[str]) -> list[str]:
    """The default secret patterns plus those of a cluster.secret_keys=[...] override (more hidden, never less:
    a value hidden needlessly still reaches the ranks through secrets.json)."""
    patterns = list(DEFAULT_PATTERNS)
    for arg in argv:
        _, key, value = _split(arg)
        if key == "cluster.secret_keys":
            patterns += [p.strip().strip("'\"") for p in value.strip("[]").split(",") if p.strip()]
    return patterns


def _refuse(message: str) -> None:
    print(f"meshrun: {message}; nothing was launched.", file=sys.stderr)
    raise SystemExit(EXIT_INVALID)


def hide_secret_args(argv: Sequence[str]) -> list[str]:
    """argv with each secret cluster.env value replaced by the placeholder; the values go to this process's
    environment (ARGS_ENV), which is cleared when argv has none (a value from an earlier command line in the
    same process must not count). A swept secret or one that does not parse exits 2 without echoing it."""
    patterns = _patterns(argv)
    out: list[str] = []
    given: dict[str, str] = {}
    parser = None
    for arg in argv:
        prefix, key, text = _split(arg)
        name = key[len(ENV_PREFIX) :] if key.startswith(ENV_PREFIX) else ""
        if not name or "~" in prefix or not is_secret(name, patterns) or "${" in text:
            out.append(arg)  # not a secret value (an interpolation names where the value is, not the value)
            continue
        if parser is None:
            from hydra.core.override_parser.overrides_parser import OverridesParser

            parser = OverridesParser.create()
        try:
            override = parser.parse_overrides([f"{prefix}{key}={text}"])[0]
        except Exception:  # noqa: BLE001 - Hydra's message would quote the value
            _refuse(
                f"the value of {key} does not parse as one Hydra value: quote it, "
                f"e.g. {prefix}{key}='...' (the value is not shown: {name} is a secret)"
            )
        if override.is_sweep_override():
            _refuse(
                f"{key} is a secret and cannot be swept (each point would name its value in its overrides "
                f"and directory): run one sweep per value"
            )
        value = override.value()
        given[name] = str(value)
        out.append(f"{prefix}{key}='{PLACEHOLDER}'")
    if given:
        os.environ[ARGS_ENV] = json.dumps(given, sort_keys=True)
    else:
        os.environ.pop(ARGS_ENV, None)
    return out
