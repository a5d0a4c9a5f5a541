"""Secret environment values (cluster.env keys that look like secrets) never land in a file anyone else reads.

config.json and config.yaml (and the config inside every checkpoint, which is config.json's) carry a
placeholder instead of the value; the value goes to run_dir/secrets.json, created readable by its owner only
(0600, whatever the umask). Ranks get it from that file, or from the job's own environment when the file
lacks it (Slurm passes the submitter's environment to the job). The sbatch script and the dry run never
contain it. A value given on the command line (+cluster.env.HF_TOKEN=...) never reaches Hydra either: the CLI
puts the placeholder in its place and hands the value on in this process's environment, under ARGS_ENV
(launcher/cli/secret_args.py), to wherever the point or run writes its run directory (a sweep's points may run
in joblib workers or submitit jobs, which inherit the environment). Pure Python: launcher and ranks import it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

from training.contract.rundir.paths import RunPaths

PLACEHOLDER = "<secret: kept in run.dir/secrets.json (mode 0600), not in this file>"
DEFAULT_PATTERNS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
ARGS_ENV = "MESHRUN_SECRET_ARGS"
"""Environment variable: JSON {name: value} of the secret cluster.env values given on this command line."""


def is_secret(name: str, patterns: Iterable[str] = DEFAULT_PATTERNS) -> bool:
    """A name containing any pattern, case-insensitive (HF_TOKEN, WANDB_API_KEY, DB_PASSWORD). Substrings on
    purpose: naming a harmless variable secret only costs a file read, missing a secret leaks it."""
    upper = str(name).upper()
    return any(p and str(p).upper() in upper for p in patterns)


def split_env(env: Mapping[str, str], patterns: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(env with every secret value replaced by PLACEHOLDER, the secret values that are not placeholders)."""
    patterns = list(patterns)
    public, secret = {}, {}
    for name, value in env.items():
        if is_secret(name, patterns):
            public[name] = PLACEHOLDER
            if str(value) != PLACEHOLDER:
                secret[name] = str(value)
        else:
            public[name] = value
    return public, secret


def given_secrets(job_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secret values the command line gave (ARGS_ENV of job_env, default this process's environment)."""
    text = (os.environ if job_env is None else job_env).get(ARGS_ENV, "")
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def split_given(env: Mapping[str, str], patterns: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """split_env, plus the command line's values (given_secrets) of the names env holds as a placeholder."""
    public, secret = split_env(env, patterns)
    given = given_secrets()
    secret.update(
        {
            name: given[name]
            for name, value in public.items()
            if str(value) == PLACEHOLDER and name in given and name not in secret
        }
    )
    return public, secret


def read_secrets(run_dir: str) -> dict[str, str]:
    try:
        with open(RunPaths(run_dir).secrets) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def write_secrets(run_dir: str, values: Mapping[str, str]) -> None:
    """Merge values into run_dir/secrets.json, created 0600 (temp file + rename; never world-readable)."""
    if not values:
        return
    merged = {**read_secrets(run_dir), **{str(k): str(v) for k, v in values.items()}}
    path = RunPaths(run_dir).secrets
    from training.contract.rundir.files import write_atomic  # never through a link

    write_atomic(path, json.dumps(merged, sort_keys=True), mode=0o600)


def resolve(env: Mapping[str, str], run_dir: str | None, job_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """env with each PLACEHOLDER replaced by the value from run_dir/secrets.json, else the command line's
    (given_secrets), else job_env's (default: this process's environment); a placeholder with none of them is
    dropped (never passed on as a value)."""
    job_env = os.environ if job_env is None else job_env
    stored = {**given_secrets(job_env), **(read_secrets(run_dir) if run_dir else {})}
    out = {}
    for name, value in env.items():
        if str(value) != PLACEHOLDER:
            out[name] = value
        elif name in stored:
            out[name] = stored[name]
        elif name in job_env:
            out[name] = job_env[name]
    return out
