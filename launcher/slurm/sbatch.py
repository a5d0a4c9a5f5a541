"""What a Slurm job of meshrun looks like: submitit parameters, the batch script's setup/teardown
lines, the per-rank environment, and the checks that keep shell metacharacters out (pure Python).

The job (one per attempt):
    #SBATCH --nodes=N --ntasks-per-node=G --requeue --signal=USR2@delay ...
    setup:    exports (NCCL_*, ...), then `launcher.slurm.driver prologue` (attempt, MASTER_ADDR/PORT)
    command:  srun --kill-on-bad-exit=1 ... python -m submitit.core._submit  (one RankTask per rank)
    teardown: `launcher.slurm.driver epilogue`: completed / requeue self / resubmit excluding a node / stop
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

from training.config import Config

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_NAME = "meshrun"

# Values that reach an #SBATCH line or a hostlist: letters, digits and the few punctuation marks
# Slurm names and hostlists use. Anything else (spaces, quotes, ;, $, `, newlines) is rejected.
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.:,@%/=+\-\[\]]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# sbatch options meshrun sets itself: overriding them through sbatch_extra would break the job.
_RESERVED = {"nodes", "ntasks-per-node", "signal", "requeue", "no-requeue", "output", "error", "open-mode",
             "job-name", "partition", "account", "qos", "time", "exclude", "array"}


class SlurmConfigError(ValueError):
    """A cluster setting that cannot be turned into a safe sbatch script."""


def validate_for_slurm(cfg: Config) -> List[str]:
    """Every problem at once, each with its fix; empty when the job can be written safely."""
    c = cfg.cluster
    errors = []
    for name in ("partition", "account", "qos", "exclude"):
        value = getattr(c, name)
        if not _SBATCH_VALUE.match(value):
            errors.append(f"cluster.{name}={value!r} contains characters Slurm names never have "
                          f"(spaces, quotes, ;, $, `, newlines): use the plain name")
    if not c.partition:
        errors.append("cluster.partition is empty: set the Slurm partition (sinfo lists them)")
    for key, value in c.sbatch_extra.items():
        if not _SBATCH_KEY.match(str(key)):
            errors.append(f"cluster.sbatch_extra key {key!r}: use the long sbatch option without dashes "
                          f"(e.g. constraint, mem)")
        elif str(key) in _RESERVED:
            errors.append(f"cluster.sbatch_extra.{key} is set by meshrun itself: use the cluster.* key instead")
        if not _SBATCH_VALUE.match(str(value)):
            errors.append(f"cluster.sbatch_extra.{key}={value!r} contains shell or space characters: "
                          f"sbatch option values must be plain words")
    for name in c.env:
        if not _ENV_NAME.match(str(name)):
            errors.append(f"cluster.env key {name!r} is not an environment variable name")
    for name, value in c.env.items():
        if "\n" in str(value) or "\0" in str(value):
            errors.append(f"cluster.env.{name} contains a newline or NUL byte: remove it")
    if c.time_min <= 0:
        errors.append(f"cluster.time_min={c.time_min}: give the time limit of one attempt in minutes (> 0)")
    if c.signal_delay_s < 0 or c.signal_delay_s >= c.time_min * 60:
        errors.append(f"cluster.signal_delay_s={c.signal_delay_s} must be >= 0 and below the time limit "
                      f"({c.time_min * 60} s)")
    if c.nodes < 1 or c.gpus_per_node < 1:
        errors.append("cluster.nodes and cluster.gpus_per_node must be >= 1")
    if c.max_retries < 0:
        errors.append("cluster.max_retries must be >= 0")
    return errors


def rank_env(cfg: Config) -> Dict[str, str]:
    """Environment of every rank: the cluster's variables plus what the engine needs on NCCL."""
    # A failed NCCL collective becomes an error (then exit, then requeue) instead of a hang.
    env: Dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if cfg.parallel.tp > 1:
        # One hardware queue keeps TP communication ordered ahead of compute (Megatron's requirement).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env.update({str(k): str(v) for k, v in sorted(cfg.cluster.env.items())})
    return env


def python_cmd() -> str:
    return shlex.quote(sys.executable)


def run_dir_lines(run_dirs: Sequence[str]) -> List[str]:
    """Set MESHRUN_RUN_DIR: the run's directory, or in a job array (a sweep) the one of this array task."""
    if len(run_dirs) == 1:
        return [f"export MESHRUN_RUN_DIR={shlex.quote(run_dirs[0])}"]
    return [f"MESHRUN_RUN_DIRS=({' '.join(shlex.quote(d) for d in run_dirs)})",
            'export MESHRUN_RUN_DIR="${MESHRUN_RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"']


def setup_lines(cfg: Config, run_dirs: Sequence[str]) -> List[str]:
    """Batch-script lines before srun: exports (quoted), then the prologue that sets attempt and rendezvous."""
    lines = run_dir_lines(run_dirs) + [
        f"export PYTHONPATH={shlex.quote(PROJECT_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}",
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in rank_env(cfg).items()]
    lines.append(f'eval "$({python_cmd()} -m launcher.slurm.driver prologue "$MESHRUN_RUN_DIR")" || exit 1')
    return lines


def teardown_lines() -> List[str]:
    """After srun: the epilogue decides between completed, requeue, resubmit and stop."""
    return [
        "MESHRUN_SRUN_RC=$?",
        f'{python_cmd()} -m launcher.slurm.driver epilogue "$MESHRUN_RUN_DIR" "$MESHRUN_SRUN_RC"',
        "exit $?",
    ]


def srun_args(cfg: Config) -> List[str]:
    # One dead rank ends the step at once instead of leaving the others hanging in a collective.
    return ["--kill-on-bad-exit=1"]


@dataclass
class SlurmJobSpec:
    """The submitit parameters of one attempt."""

    folder: str
    """submitit's folder (pickles, per-task logs): run_dir/submitit, or the sweep's for a job array."""
    parameters: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of SlurmExecutor.update_parameters."""
    python: str = ""
    """How srun starts each task's Python (SlurmExecutor's `python`): USR2/TERM ignored until the
    rank wrapper installs its handlers, so a stop signal during start-up never kills a task."""


def task_python() -> str:
    # `trap ''` sets SIG_IGN, which survives exec; "$0" is the interpreter, "$@" submitit's arguments.
    return "bash -c " + shlex.quote("trap '' USR2 TERM; exec \"$0\" \"$@\"") + " " + python_cmd()


def job_spec(cfg: Config, run_dir: str, exclude: str = "") -> SlurmJobSpec:
    """submitit parameters for this config; exclude overrides cluster.exclude (resubmissions)."""
    errors = validate_for_slurm(cfg)
    if errors:
        raise SlurmConfigError("\n".join(errors))
    c = cfg.cluster
    exclude = exclude if exclude else c.exclude
    if exclude and not _SBATCH_VALUE.match(exclude):
        raise SlurmConfigError(f"exclude list {exclude!r} is not a plain hostlist")
    params: Dict[str, Any] = {
        "job_name": JOB_NAME,
        "nodes": c.nodes,
        "ntasks_per_node": c.gpus_per_node,
        "cpus_per_task": 1,
        "time": c.time_min,
        "partition": c.partition,
        "signal_delay_s": c.signal_delay_s,
        "stderr_to_stdout": True,
        "srun_args": srun_args(cfg),
        "setup": setup_lines(cfg, [run_dir]),
        "teardown": teardown_lines(),
        # --requeue: the epilogue's `scontrol requeue` is refused without it.
        "additional_parameters": {"requeue": True, **{str(k): str(v) for k, v in sorted(c.sbatch_extra.items())}},
    }
    if c.device == "cuda":
        params["gpus_per_node"] = c.gpus_per_node
    for name in ("account", "qos"):
        if getattr(c, name):
            params[name] = getattr(c, name)
    if exclude:
        params["exclude"] = exclude
    return SlurmJobSpec(folder=os.path.join(run_dir, "submitit"), parameters=params, python=task_python())


def array_group_key(cfg: Config) -> str:
    """Sweep points whose jobs differ only in their run directory share this key: they can be one job
    array (Slurm gives every task of an array the same resources and batch script)."""
    return json.dumps(job_spec(cfg, "<run dir>").parameters, sort_keys=True, default=str)


def array_job_spec(cfg: Config, run_dirs: Sequence[str], folder: str) -> SlurmJobSpec:
    """One job array for run_dirs (all with cfg's array_group_key): task i runs run_dirs[i]; submitit
    keeps the array's pickles and logs (<array>_<task>_<rank>_log.out) in folder."""
    spec = job_spec(cfg, run_dirs[0])
    spec.parameters["setup"] = setup_lines(cfg, run_dirs)
    spec.folder = folder
    return spec


def sbatch_text(spec: SlurmJobSpec) -> str:
    """The batch script submitit would submit for this spec (for the dry run)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([spec.python, "-u -m submitit.core._submit", shlex.quote(spec.folder)])
    return _make_sbatch_string(command=command, folder=spec.folder, **spec.parameters)


def srun_line(sbatch: str) -> str:
    return next(line for line in sbatch.splitlines() if line.startswith("srun "))


def dry_run_text(cfg: Config, run_dir: str) -> str:
    spec = job_spec(cfg, run_dir)
    script = sbatch_text(spec)
    return "\n".join([
        "# sbatch script (submitted by submitit; nothing was submitted: dry_run=true)",
        script.rstrip("\n"),
        "",
        "# srun line",
        srun_line(script),
        "",
        "# each task (launcher/slurm/rank_task.py) then runs its rank as",
        rank_command_text(cfg, run_dir),
        "",
    ])


def rank_command_text(cfg: Config, run_dir: str) -> str:
    """The per-rank command with its NUMA binding, as a description (N is decided on the node)."""
    c = cfg.cluster
    cmd = f"{python_cmd()} -m training.main {shlex.quote(run_dir)}"
    if c.numa == "off":
        return cmd + "    # cluster.numa=off: no binding"
    if c.numa == "explicit":
        return (f"numactl --cpunodebind=N --membind=N {cmd}    # N = cluster.numa_map[local rank] = "
                f"{list(c.numa_map)}")
    where = "its GPU's NUMA node (sysfs)" if c.device == "cuda" else "local ranks spread over the NUMA nodes"
    return f"numactl --cpunodebind=N --membind=N {cmd}    # N = {where}"
