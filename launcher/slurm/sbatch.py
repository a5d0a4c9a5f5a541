"""What a Slurm job of meshrun looks like: submitit parameters, the batch script's setup/teardown
lines, the per-rank environment, and the checks that keep shell metacharacters out (pure Python).

The job (one per attempt):
    #SBATCH --nodes=N --ntasks-per-node=G --cpus-per-task=C --requeue --signal=USR2@delay [--exclusive --mem]
    setup:    exports (NCCL_*, ...), then `launcher.slurm.driver prologue` (attempt, MASTER_ADDR/PORT)
    command:  srun --kill-on-bad-exit=1 [--container-image --container-mounts] ... python -m submitit.core._submit
              (one RankTask per rank)
    teardown: `launcher.slurm.driver epilogue`: completed / requeue self / resubmit excluding a node / stop
The preflight-only job (`preflight_job_spec`) has the same resources and environment without the
requeue machinery.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from launcher.ranks import warm
from launcher.ranks.processes import PROJECT_ROOT, engine_env
from launcher.ranks.warm import slurm as warm_slurm
from launcher.slurm import in_job
from training.contract.config import ClusterConfig, Config
from training.contract.exit_codes import EXIT_FAILED
from training.contract.rundir.paths import RunPaths

JOB_NAME = "meshrun"

# Values that reach an #SBATCH line or a hostlist: letters, digits and the few punctuation marks
# Slurm names and hostlists use. Anything else (spaces, quotes, ;, $, `, newlines) is rejected. Every
# pattern is applied with fullmatch: `$` in re.match also matches before a trailing newline, which would
# let "debug\n<command>" through and turn the rest of an #SBATCH line into a shell command.
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.:,@%/=+\-\[\]]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# sbatch --mem: a number with an optional unit (Slurm's default unit is megabytes); 0 asks for all of it.
_SLURM_SIZE = re.compile(r"^[0-9]+[KMGTkmgt]?$")
# pyxis image references: [USER@][REGISTRY#]IMAGE[:TAG|@DIGEST], docker:// forms, or a squashfs path.
# `#` separates the registry (nvcr.io#nvidia/pytorch:24.05-py3) and is legal; the value is quoted anyway.
_CONTAINER_IMAGE = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_.:/#@+\-]*$")
# enroot mounts SRC:DST[:FLAGS], joined by commas in one srun option: no commas, colons or spaces inside.
_CONTAINER_MOUNT = re.compile(r"^/[^\s,:]*:/[^\s,:]*(:[A-Za-z0-9_=+.\-]+)?$")
# sbatch options meshrun sets itself: overriding them through sbatch_extra would break the job.
_RESERVED = {
    "nodes",
    "ntasks-per-node",
    "signal",
    "requeue",
    "no-requeue",
    "output",
    "error",
    "open-mode",
    "job-name",
    "comment",
    "partition",
    "account",
    "qos",
    "time",
    "exclude",
    "array",
    "cpus-per-task",
    "exclusive",
    "mem",
    "container-image",
    "container-mounts",
    "no-kill",
    # Options that change the job's environment or user (the hostile audit's Q4): --export=NONE drops the
    # environment the ranks read their secrets and run directory from; --wrap replaces meshrun's batch script.
    "export",
    "export-file",
    "get-user-env",
    "wrap",
    "uid",
    "gid",
}


# The cluster.* key that sets each reserved option a user may want to change (the others are meshrun's alone).
_RESERVED_KEY = {
    "job-name": "cluster.job_name",
    "comment": "cluster.comment",
    "nodes": "cluster.nodes",
    "ntasks-per-node": "cluster.gpus_per_node",
    "signal": "cluster.signal_delay_s",
    "partition": "cluster.partition",
    "account": "cluster.account",
    "qos": "cluster.qos",
    "time": "cluster.time_min",
    "exclude": "cluster.exclude",
    "cpus-per-task": "cluster.cpus_per_task",
    "exclusive": "cluster.exclusive",
    "mem": "cluster.mem",
    "container-image": "cluster.container.image",
    "container-mounts": "cluster.container.mounts",
}
_JOB_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+\-]")


SLURM_SIGNAL_CHECK_S = 30
"""How often slurmctld checks time limits (and sends --signal's warning): the signal arrives between
signal_delay_s and signal_delay_s - 30 s before the limit."""


def default_job_name(run_dir: str) -> str:
    """meshrun-<the run directory's name>, in the characters a Slurm job name keeps plainly."""
    name = os.path.basename(os.path.normpath(run_dir)) if run_dir else ""
    return f"{JOB_NAME}-{_JOB_NAME_UNSAFE.sub('-', name)}" if name else JOB_NAME


def job_name(cfg: Config, run_dir: str) -> str:
    """cluster.job_name, or the default from the run directory."""
    return cfg.cluster.job_name or default_job_name(run_dir)


# Reserved options whose sbatch value is not the cluster key's (a time, a signal spec, a flag): the key alone.
_OTHER_UNITS = {"time": "minutes", "signal": "seconds before the time limit", "exclusive": "true or false"}


def _reserved_fix(option: str, value: str) -> str:
    """What to type instead of cluster.sbatch_extra.<option>."""
    key = _RESERVED_KEY.get(option)
    if key is None:
        return f"remove it (meshrun's job needs its own --{option})"
    if option in _OTHER_UNITS:
        return f"use {key} instead ({_OTHER_UNITS[option]})"
    return f"use {key}={value} instead"


def reserved_option(key: str) -> str:
    """The reserved option `key` names, or "": sbatch takes any unique prefix of a long option (--arr is
    --array, --err is --error), and an ambiguous one is refused by sbatch anyway, so a key that begins a
    reserved option's name is refused as that option."""
    if key in _RESERVED:
        return key
    hits = sorted(name for name in _RESERVED if name.startswith(key))
    return hits[0] if hits else ""


class SlurmConfigError(ValueError):
    """A cluster setting that cannot be turned into a safe sbatch script."""


def validate_for_slurm(cfg: Config) -> list[str]:
    """Every problem at once, each with its fix; empty when the job can be written safely."""
    c = cfg.cluster
    errors = []
    for name in ("partition", "account", "qos", "exclude"):
        value = getattr(c, name)
        if not _SBATCH_VALUE.fullmatch(value):
            errors.append(
                f"cluster.{name}={value!r} contains characters Slurm names never have "
                f"(spaces, quotes, ;, $, `, newlines): use the plain name"
            )
    if not c.partition:
        errors.append("cluster.partition is empty: set the Slurm partition (sinfo lists them)")
    for key, value in c.sbatch_extra.items():
        if not _SBATCH_KEY.fullmatch(str(key)):
            errors.append(
                f"cluster.sbatch_extra key {key!r}: use the long sbatch option without dashes (e.g. constraint, mem)"
            )
        elif str(key) in _RESERVED:
            errors.append(f"cluster.sbatch_extra.{key} is set by meshrun itself: {_reserved_fix(str(key), value)}")
        elif reserved_option(str(key)):
            option = reserved_option(str(key))
            errors.append(
                f"cluster.sbatch_extra.{key} abbreviates --{option} (sbatch takes any unique prefix of an "
                f"option), which is set by meshrun itself: {_reserved_fix(option, value)}"
            )
        if not _SBATCH_VALUE.fullmatch(str(value)):
            errors.append(
                f"cluster.sbatch_extra.{key}={value!r} contains shell or space characters: "
                f"sbatch option values must be plain words"
            )
    for name in ("job_name", "comment"):
        text = getattr(c, name)
        if not _SBATCH_VALUE.fullmatch(text) or "%" in text:
            errors.append(
                f"cluster.{name}={text!r} contains characters a Slurm {name.replace('_', ' ')} cannot carry "
                f"plainly (spaces, quotes, %, ;, $, `, newlines): use letters, digits and - _ . instead"
            )
    for name in c.env:
        if not _ENV_NAME.fullmatch(str(name)):
            errors.append(f"cluster.env key {name!r} is not an environment variable name")
    for name, value in c.env.items():
        if "\n" in str(value) or "\0" in str(value):
            errors.append(f"cluster.env.{name} contains a newline or NUL byte: remove it")
    if c.time_min <= 0:
        errors.append(f"cluster.time_min={c.time_min}: give the time limit of one attempt in minutes (> 0)")
    if c.signal_delay_s < 0 or c.signal_delay_s >= c.time_min * 60:
        errors.append(
            f"cluster.signal_delay_s={c.signal_delay_s} must be >= 0 and below the time limit ({c.time_min * 60} s)"
        )
    elif c.signal_delay_s <= SLURM_SIGNAL_CHECK_S:
        errors.append(
            f"cluster.signal_delay_s={c.signal_delay_s} leaves no time to save: Slurm looks at time limits every "
            f"{SLURM_SIGNAL_CHECK_S} s, so the signal may come as late as signal_delay_s - {SLURM_SIGNAL_CHECK_S} s "
            f"before the limit; give more than {SLURM_SIGNAL_CHECK_S} s plus one checkpoint save "
            f"(cluster.signal_delay_s={SLURM_SIGNAL_CHECK_S + 60} or more)"
        )
    if c.nodes < 1 or c.gpus_per_node < 1:
        errors.append("cluster.nodes and cluster.gpus_per_node must be >= 1")
    if c.max_retries < 0:
        errors.append("cluster.max_retries must be >= 0")
    if c.preflight.requeue_reuse_min < 0:
        errors.append(
            f"cluster.preflight.requeue_reuse_min={c.preflight.requeue_reuse_min}: give minutes >= 0 "
            "(0 checks every node on every attempt)"
        )
    errors += run_dir_errors(cfg.run.dir)
    errors += in_job.config_errors(c)
    return errors + _resource_errors(c)


# sbatch reads #SBATCH --output=<run dir>/... up to the first blank (a space makes it refuse the script) and
# expands %j, %t, ... in it; a control character would end the line. The script quotes the path everywhere else.
_SLURM_PATH_BAD = re.compile(r"[\s%]")


def run_dir_errors(run_dir: str) -> list[str]:
    """A run (or sweep point) directory that cannot be written into an sbatch script safely."""
    from training.contract.rundir.config_files import path_problem

    problem = path_problem(run_dir)
    if problem:
        return [problem]
    if _SLURM_PATH_BAD.search(run_dir):
        return [
            f"run.dir={run_dir!r} contains a space or '%': Slurm's #SBATCH --output takes the path up to the "
            f"first blank and expands %-patterns in it; choose a directory without them"
        ]
    return []


def _resource_errors(c: ClusterConfig) -> list[str]:
    """cpus_per_task, mem and the container: what a real cluster's job asks for beyond nodes and time."""
    errors = []
    if c.cpus_per_task < 0:
        errors.append(
            f"cluster.cpus_per_task={c.cpus_per_task}: give the CPUs of one rank, or 0 for the node's "
            f"CPUs divided by its ranks"
        )
    if c.mem and not _SLURM_SIZE.fullmatch(c.mem):
        errors.append(
            f"cluster.mem={c.mem!r} is not a Slurm size: use a number with an optional unit K, M, G "
            f"or T (64G, 512000M; 0 = all of the node's memory), or leave it empty"
        )
    image, mounts = c.container.image, list(c.container.mounts)
    if image and not _CONTAINER_IMAGE.fullmatch(image):
        errors.append(
            f"cluster.container.image={image!r} is not an image reference: use REGISTRY#IMAGE:TAG "
            f"(e.g. nvcr.io#nvidia/pytorch:24.05-py3) or a .sqsh path, without spaces, quotes or "
            f"shell characters"
        )
    if mounts and not image:
        errors.append(
            "cluster.container.mounts is set but cluster.container.image is empty: set the image, or drop the mounts"
        )
    for mount in mounts:
        if not _CONTAINER_MOUNT.fullmatch(str(mount)):
            errors.append(
                f"cluster.container.mounts entry {mount!r}: use SRC:DST[:FLAGS] with absolute paths "
                f"and no commas, colons or spaces inside them (e.g. /data:/data:ro)"
            )
    return errors


def cpus_per_task(c: ClusterConfig, node_cpus: int = 0) -> int:
    """CPUs of one rank: cluster.cpus_per_task, or with 0 the node's CPUs (node_cpus, the partition's
    smallest node) shared by its ranks. Never Slurm's silent default of 1: unknown is an error."""
    if c.cpus_per_task > 0:
        return c.cpus_per_task
    if node_cpus > 0:
        return max(1, node_cpus // max(c.gpus_per_node, 1))
    raise SlurmConfigError(
        "cluster.cpus_per_task=0 takes the node's CPUs from the partition (sinfo), which "
        "were not read: set cluster.cpus_per_task to the CPUs of one rank"
    )


def container_args(c: ClusterConfig) -> list[str]:
    """pyxis's srun options (submitit quotes every srun argument); none without an image."""
    if not c.container.image:
        return []
    args = [f"--container-image={c.container.image}"]
    if c.container.mounts:
        args.append("--container-mounts=" + ",".join(c.container.mounts))
    return args


def python_cmd() -> str:
    return shlex.quote(sys.executable)


def run_dir_lines(run_dirs: Sequence[str]) -> list[str]:
    """Set MESHRUN_RUN_DIR: the run's directory, or in a job array (a sweep) the one of this array task."""
    if len(run_dirs) == 1:
        return [f"export MESHRUN_RUN_DIR={shlex.quote(run_dirs[0])}"]
    return [
        f"MESHRUN_RUN_DIRS=({' '.join(shlex.quote(d) for d in run_dirs)})",
        'export MESHRUN_RUN_DIR="${MESHRUN_RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"',
    ]


def setup_lines(cfg: Config, run_dirs: Sequence[str], code_root: str = "") -> list[str]:
    """Batch-script lines before srun: exports (quoted), then the prologue that sets attempt and rendezvous.
    code_root (default: the code this process runs) goes first on PYTHONPATH: the submission's snapshot
    (launcher/slurm/snapshot.py), so every attempt runs the code as it was at submission. Secret env values
    are not in the script: each rank reads them (training/contract/rundir/secret_env.py)."""
    lines = run_dir_lines(run_dirs) + [
        f"export PYTHONPATH={shlex.quote(code_root or PROJECT_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}",
        # `python -m` would otherwise put the working directory (often the checkout) ahead of PYTHONPATH.
        "export PYTHONSAFEPATH=1",
        # numpy's OpenBLAS starts a thread per core as soon as numpy is imported (every task's submitit wrapper
        # imports it, and torch does): the job's math runs in torch's threads, so one, as in the warm agents and
        # the ranks they fork (training/run/warm_agent.py), unless the user set a count.
        'export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"',
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in engine_env(cfg, secrets=False).items()]
    lines += warm_slurm.batch_lines(cfg, python_cmd())  # the warm agents, one per node, for every step
    if in_job.enabled(cfg.cluster):
        lines += in_job.batch_watch_lines(python_cmd())
        lines += in_job.batch_loop_head()  # prologue, srun, epilogue repeat inside this allocation
        lines.append(in_job.loop_prologue_line(prologue_line()))
    else:
        lines.append(prologue_line())
        lines += early_epilogue_lines()
    return lines


def early_epilogue_lines() -> list[str]:
    """The epilogue started before srun, as a coprocess that waits for srun's exit status on its standard
    input (teardown_lines hands it over): its Python start and imports are then not on the way from a
    preemption signal to the requeue (docs/PERFORMANCE.md, *Preemption path*). Started after the
    prologue's exports, which it reads (MESHRUN_ATTEMPT). Its pid and its two pipes are kept in variables and
    descriptors of the batch script's own: bash unsets a coprocess's and closes its pipes once it has ended,
    which may be before the hand-over is complete. After the hand-over the epilogue writes to MESHRUN_LOG_FD,
    the job's log."""
    return [
        "exec {MESHRUN_LOG_FD}>&1",
        f"coproc MESHRUN_EPILOGUE {{ exec {python_cmd()} -m launcher.slurm.driver epilogue "
        '"$MESHRUN_RUN_DIR" --srun-rc-on-stdin --log-fd "$MESHRUN_LOG_FD"; }',
        'MESHRUN_EPILOGUE_JOB="$MESHRUN_EPILOGUE_PID"; '
        'exec {MESHRUN_EPILOGUE_IN}>&"${MESHRUN_EPILOGUE[1]}" {MESHRUN_EPILOGUE_OUT}<&"${MESHRUN_EPILOGUE[0]}"',
    ]


def prologue_line() -> str:
    """The prologue prints exports for eval; when it fails the attempt ends before srun, saying so. The
    assignment's status is the prologue's (`eval "$(...)" || exit` would see eval's, 0 even when it failed)."""
    return (
        f'MESHRUN_PROLOGUE="$({python_cmd()} -m launcher.slurm.driver prologue "$MESHRUN_RUN_DIR")" || '
        f'{{ echo "meshrun: the prologue failed (exit $?); the attempt stops before srun: see the lines above" '
        f'>&2; exit {EXIT_FAILED}; }}; eval "$MESHRUN_PROLOGUE"'
    )


def teardown_lines(cfg: Config | None = None) -> list[str]:
    """After srun: the epilogue decides between completed, requeue, resubmit and stop (and, with in-job
    restarts, a new step in this allocation: launcher/slurm/in_job.py)."""
    if cfg is not None and in_job.enabled(cfg.cluster):
        return in_job.batch_loop_tail(
            f'{python_cmd()} -m launcher.slurm.driver epilogue "$MESHRUN_RUN_DIR" "$MESHRUN_SRUN_RC"'
        )
    # srun's status to the early epilogue (early_epilogue_lines), which answers "ok" before it does anything
    # else. Without that answer (it never started, died, or did not answer within 60 s: it is killed first)
    # the epilogue runs here as before, so that no attempt ends undecided and none is decided twice. SIGPIPE is
    # ignored: writing to a coprocess that has just died must fail, not end the batch script.
    return [
        "MESHRUN_SRUN_RC=$?",
        "trap '' PIPE",
        'if [ -n "${MESHRUN_EPILOGUE_IN:-}" ] && [ -n "${MESHRUN_EPILOGUE_OUT:-}" ] '
        '&& printf \'%s\\n\' "$MESHRUN_SRUN_RC" 2>/dev/null >&"$MESHRUN_EPILOGUE_IN" '
        '&& read -r -t 60 MESHRUN_ACK <&"$MESHRUN_EPILOGUE_OUT" && [ "$MESHRUN_ACK" = ok ]; '
        'then wait "$MESHRUN_EPILOGUE_JOB"; '
        'else { kill -KILL "$MESHRUN_EPILOGUE_JOB"; wait "$MESHRUN_EPILOGUE_JOB"; } 2>/dev/null; '
        f'{python_cmd()} -m launcher.slurm.driver epilogue "$MESHRUN_RUN_DIR" "$MESHRUN_SRUN_RC"; fi',
        "exit $?",
    ]


def srun_args(cfg: Config, kill_on_bad_exit: bool = True) -> list[str]:
    # One dead rank ends the step at once instead of leaving the others hanging in a collective.
    return (["--kill-on-bad-exit=1"] if kill_on_bad_exit else []) + container_args(cfg.cluster)


@dataclass
class SlurmJobSpec:
    """The submitit parameters of one attempt."""

    folder: str
    """submitit's folder (pickles, per-task logs): run_dir/submitit, or the sweep's for a job array."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of SlurmExecutor.update_parameters."""
    python: str = ""
    """How srun starts each task's Python (SlurmExecutor's `python`): USR2/TERM ignored until the
    rank wrapper installs its handlers, so a stop signal during start-up never kills a task."""


def task_python() -> str:
    # `trap ''` sets SIG_IGN, which survives exec; "$0" is the interpreter, "$@" submitit's arguments.
    return "bash -c " + shlex.quote('trap \'\' USR2 TERM; exec "$0" "$@"') + " " + python_cmd()


def with_cpus_per_task(cfg: Config, node_cpus: int) -> Config:
    """A copy of cfg whose cluster.cpus_per_task is the number the job asks for (its 0 resolved with
    node_cpus): config.json then records it, and every later job of the run (resubmissions) asks the same."""
    out = copy.deepcopy(cfg)
    out.cluster.cpus_per_task = cpus_per_task(cfg.cluster, node_cpus)
    return out


def _resources(cfg: Config, exclude: str) -> dict[str, Any]:
    """The submitit parameters of the allocation itself, shared by the training and the preflight job."""
    errors = validate_for_slurm(cfg)
    if errors:
        raise SlurmConfigError("\n".join(errors))
    c = cfg.cluster
    exclude = exclude if exclude else c.exclude
    if exclude and not _SBATCH_VALUE.fullmatch(exclude):
        raise SlurmConfigError(f"exclude list {exclude!r} is not a plain hostlist")
    params: dict[str, Any] = {
        "nodes": in_job.allocation_nodes(c),  # cluster.spare_nodes wait idle beside the training nodes
        "ntasks_per_node": c.gpus_per_node,
        "cpus_per_task": cpus_per_task(c),
        "time": c.time_min,
        "partition": c.partition,
        "signal_delay_s": c.signal_delay_s,
        "stderr_to_stdout": True,
    }
    if c.device == "cuda":
        params["gpus_per_node"] = c.gpus_per_node
    for name in ("account", "qos", "mem", "comment"):
        if getattr(c, name):
            params[name] = getattr(c, name)
    if c.exclusive:
        params["exclusive"] = True  # submitit writes True as the bare flag `#SBATCH --exclusive`
    if exclude:
        params["exclude"] = exclude
    return params


def job_spec(cfg: Config, run_dir: str, exclude: str = "", code_root: str = "") -> SlurmJobSpec:
    """submitit parameters of the training job; exclude overrides cluster.exclude (resubmissions); code_root:
    see setup_lines. cluster.cpus_per_task must be resolved (with_cpus_per_task) when it is 0."""
    params = _resources(cfg, exclude)
    params.update(
        {
            "job_name": job_name(cfg, run_dir),
            "srun_args": srun_args(cfg),
            "setup": setup_lines(cfg, [run_dir], code_root),
            "teardown": teardown_lines(cfg),
            # --requeue: the epilogue's `scontrol requeue` is refused without it.
            "additional_parameters": {
                "requeue": True,
                **_no_kill(cfg),
                **{str(k): str(v) for k, v in sorted(cfg.cluster.sbatch_extra.items())},
            },
        }
    )
    return SlurmJobSpec(folder=RunPaths(run_dir).submitit, parameters=params, python=task_python())


def _no_kill(cfg: Config) -> dict[str, Any]:
    """--no-kill with in-job restarts: a failing node does not end the allocation, whose other nodes then run
    the next step (launcher/slurm/in_job.py)."""
    return {"no-kill": True} if in_job.enabled(cfg.cluster) else {}


def preflight_job_spec(cfg: Config, run_dir: str) -> SlurmJobSpec:
    """The preflight-only job (action=preflight): the training job's resources, environment and container,
    without prologue, epilogue, --requeue and --kill-on-bad-exit (a bad node's rank must not make srun kill
    the healthy ranks before they have reported)."""
    params = _resources(cfg, "")
    params.update(
        {
            "job_name": f"{job_name(cfg, run_dir)}-preflight" if cfg.cluster.job_name else f"{JOB_NAME}-preflight",
            "srun_args": srun_args(cfg, kill_on_bad_exit=False),
            "setup": [
                line
                for line in setup_lines(cfg, [run_dir])
                if line != prologue_line()
                and line != in_job.loop_prologue_line(prologue_line())
                and line not in in_job.batch_loop_head()
                and line not in warm_slurm.batch_lines(cfg, python_cmd())
                and line not in early_epilogue_lines()
            ],
            "additional_parameters": {str(k): str(v) for k, v in sorted(cfg.cluster.sbatch_extra.items())},
        }
    )
    return SlurmJobSpec(folder=RunPaths(run_dir).submitit_preflight, parameters=params, python=python_cmd())


def array_group_key(cfg: Config) -> str:
    """Sweep points whose jobs differ only in their run directory share this key: they can be one job
    array (Slurm gives every task of an array the same resources and batch script)."""
    return json.dumps(job_spec(cfg, "<run dir>").parameters, sort_keys=True, default=str)


def array_job_spec(cfg: Config, run_dirs: Sequence[str], folder: str, code_root: str = "") -> SlurmJobSpec:
    """One job array for run_dirs (all with cfg's array_group_key): task i runs run_dirs[i]; submitit
    keeps the array's pickles and logs (<array>_<task>_<rank>_log.out) in folder."""
    spec = job_spec(cfg, run_dirs[0], code_root=code_root)
    spec.parameters["setup"] = setup_lines(cfg, run_dirs, code_root)
    if not cfg.cluster.job_name:  # the sweep's name, not its first point's (folder: <sweep dir>/submitit)
        spec.parameters["job_name"] = default_job_name(os.path.dirname(os.path.normpath(folder)))
    spec.folder = folder
    return spec


def sbatch_text(spec: SlurmJobSpec, array_size: int = 0) -> str:
    """The batch script submitit would submit for this spec (for the dry run); array_size > 1: as the
    job array of that many tasks submitit makes of a batch (its map_count adds --array, %A_%a logs)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([spec.python, "-u -m submitit.core._submit", shlex.quote(spec.folder)])
    array = {"map_count": array_size} if array_size > 1 else {}
    return _make_sbatch_string(command=command, folder=spec.folder, **spec.parameters, **array)


def srun_line(sbatch: str) -> str:
    return next(line for line in sbatch.splitlines() if line.startswith("srun "))


def dry_run_text(cfg: Config, spec: SlurmJobSpec, run_dir: str) -> str:
    """What `dry_run=true` prints: the batch script of spec, its srun line, and each rank's command."""
    script = sbatch_text(spec)
    return "\n".join(
        [
            "# sbatch script (submitted by submitit; nothing was submitted: dry_run=true)",
            script.rstrip("\n"),
            "",
            "# srun line",
            srun_line(script),
            "",
            "# each task (launcher/slurm/rank_task.py) then runs its rank as",
            rank_command_text(cfg, run_dir),
        ]
        + (
            [
                "# forked by its node's warm agent when it answers (cluster.warm_start: the same module, environment",
                "# and binding, torch already imported); started as above when it does not",
            ]
            if warm.enabled(cfg)
            else []
        )
        + [""]
    )


def array_dry_run_text(spec: SlurmJobSpec, run_dirs: Sequence[str]) -> str:
    """A sweep's job array under dry_run=true: which task runs which point, and the batch script."""
    return "\n".join(
        [
            f"# job array of {len(run_dirs)} sweep points (submitted by submitit; nothing was submitted: dry_run=true)",
            "# task -> run dir:",
        ]
        + [f"#   {task}: {run_dir}" for task, run_dir in enumerate(run_dirs)]
        + [sbatch_text(spec, array_size=len(run_dirs)).rstrip("\n"), ""]
    )


def rank_command_text(cfg: Config, run_dir: str) -> str:
    """The per-rank command with its NUMA binding, as a description (N is decided on the node)."""
    c = cfg.cluster
    cmd = f"{python_cmd()} -m training.main {shlex.quote(run_dir)}"
    if c.numa == "off":
        return cmd + "    # cluster.numa=off: no binding"
    if c.numa == "explicit":
        return f"numactl --cpunodebind=N --membind=N {cmd}    # N = cluster.numa_map[local rank] = {list(c.numa_map)}"
    where = "its GPU's NUMA node (sysfs)" if c.device == "cuda" else "local ranks spread over the NUMA nodes"
    return f"numactl --cpunodebind=N --membind=N {cmd}    # N = {where}"
