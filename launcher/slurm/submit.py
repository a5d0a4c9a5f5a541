"""Submit a meshrun run to Slurm through submitit: one job per run, returns at once.

submit() checks the controller and the partition before anything is written to Slurm, resolves
cluster.cpus_per_task=0 from the partition's nodes, builds the job spec once, submits the job
(launcher/slurm/sbatch.py describes it), records `submitted` in events.jsonl and prints the job id
and run dir, and returns: with wait=true the caller follows the run (launcher/manage/follow.py);
dry_run=true prints the sbatch script and the srun line and submits nothing.

In a sweep run by meshrun's Hydra launcher (hydra_plugins/meshrun_sweep), submit(queue=True) only
checks and queues each point; when the launcher's batch ends, it passes the queued run directories to
`submit_arrays`, which submits them as job arrays, one per group of points whose jobs differ only in
their run directory (same nodes, time, environment, ...), or with dry_run=true prints the batch script
of each array instead. Each array task is then a job of its own for status, requeue and events
("<array>_<task>", submitit's naming); a resubmission after a failure is a plain job.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from launcher.records.point import update_point
from launcher.slurm import in_job
from launcher.slurm.rank_task import RankTask
from launcher.slurm.sbatch import (
    SlurmConfigError,
    SlurmJobSpec,
    array_dry_run_text,
    array_group_key,
    array_job_spec,
    dry_run_text,
    job_spec,
    with_cpus_per_task,
)
from launcher.slurm.snapshot import code_dir, take_snapshot
from training.contract.config import Config, load_config
from training.contract.exit_codes import EXIT_INVALID, EXIT_SLURM
from training.contract.rundir.config_files import write_config
from training.contract.rundir.events import append_event
from training.contract.rundir.lock import RunLocked, acquire, held
from training.contract.rundir.paths import RunPaths
from training.contract.rundir.resume_request import write_request
from training.contract.slurm_env import SlurmUnavailable, slurm_command


def check_controller() -> None:
    res = slurm_command(["scontrol", "ping"])
    if res.returncode != 0 or "UP" not in res.stdout:
        msg = (res.stdout + res.stderr).strip().splitlines()
        raise SlurmUnavailable(
            "the Slurm controller does not answer (`scontrol ping`: "
            f"{msg[-1] if msg else 'no output'}); start it (dev: "
            "`bash slurm/dev-cluster.sh up`) or check SLURM_CONF"
        )


def partition_node_cpus(partition: str) -> dict[str, int]:
    """Node name -> CPUs of every node of a partition; {} when the partition does not exist."""
    res = slurm_command(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %c"])
    if res.returncode != 0:
        return {}
    out: dict[str, int] = {}
    for line in res.stdout.splitlines():
        name, _, cpus = line.strip().partition(" ")
        if name:
            out[name] = int(cpus) if cpus.strip().isdigit() else 0
    return out


def partition_nodes(partition: str) -> list[str]:
    """Node names of a partition; [] when the partition does not exist."""
    return sorted(partition_node_cpus(partition))


def check_partition(cfg: Config) -> dict[str, int]:
    """The partition's nodes the job may use (node -> CPUs); SlurmConfigError when it has too few."""
    nodes = partition_node_cpus(cfg.cluster.partition)
    if not nodes:
        known = slurm_command(["sinfo", "-h", "-o", "%R"]).stdout.split()
        raise SlurmConfigError(
            f"cluster.partition={cfg.cluster.partition!r} does not exist on this cluster; "
            f"known partitions: {', '.join(sorted(set(known))) or 'none'}"
        )
    excluded = set(cfg.cluster.exclude.split(",")) - {""}
    usable = {n: cpus for n, cpus in sorted(nodes.items()) if n not in excluded}
    if len(usable) < cfg.cluster.nodes:
        raise SlurmConfigError(
            f"cluster.nodes={cfg.cluster.nodes} but partition {cfg.cluster.partition!r} has "
            f"{len(usable)} usable node(s) ({', '.join(usable)}): lower cluster.nodes"
        )
    wanted = in_job.allocation_nodes(cfg.cluster)
    if len(usable) < wanted:
        raise SlurmConfigError(
            f"cluster.nodes={cfg.cluster.nodes} + cluster.spare_nodes={cfg.cluster.spare_nodes} "
            f"but partition {cfg.cluster.partition!r} has {len(usable)} usable node(s) "
            f"({', '.join(usable)}): lower cluster.spare_nodes to "
            f"{len(usable) - cfg.cluster.nodes}"
        )
    return usable


def resolve_for_slurm(cfg: Config) -> Config:
    """Check the controller and the partition (a dry run asks Slurm only when it must: to resolve
    cluster.cpus_per_task=0); returns cfg with cpus_per_task resolved from the partition's smallest usable node."""
    if cfg.dry_run and cfg.cluster.cpus_per_task > 0:
        return cfg
    try:
        check_controller()
        nodes = check_partition(cfg)
    except SlurmUnavailable as exc:
        if not cfg.dry_run:
            raise
        raise SlurmUnavailable(
            f"{exc}. A dry run without Slurm: set cluster.cpus_per_task (0 reads the node's CPUs from the partition)"
        ) from None
    return with_cpus_per_task(cfg, min((c for c in nodes.values() if c > 0), default=0))


SBATCH_TIMEOUT_S = 60
"""How long sbatch may take before the submission counts as refused (a hung controller must not hang meshrun)."""


def _with_sbatch_timeout() -> None:
    """submitit (1.5) runs sbatch without a timeout, and builds a plain SlurmExecutor for job arrays: the
    submission command is therefore set on that class, as `timeout` around sbatch (coreutils)."""
    from submitit.slurm.slurm import SlurmExecutor

    def command(self, submission_file_path) -> list[str]:
        return ["timeout", "--kill-after=5", str(SBATCH_TIMEOUT_S), "sbatch", str(submission_file_path)]

    SlurmExecutor._make_submission_command = command


def _submit_spec(spec: SlurmJobSpec, run_dirs: list[str]) -> list[str]:
    """One sbatch for spec: a plain job for one run dir, a job array for several; the job ids."""
    import submitit

    _with_sbatch_timeout()
    os.makedirs(spec.folder, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=spec.folder, python=spec.python)
    executor.update_parameters(**spec.parameters)
    try:
        with executor.batch() if len(run_dirs) > 1 else contextlib.nullcontext():
            jobs = [executor.submit(RankTask(run_dir)) for run_dir in run_dirs]
    except Exception as exc:  # submitit wraps sbatch's complaint (exit 124: `timeout` stopped it)
        text = str(exc).strip()
        cause = getattr(exc, "__cause__", None)
        if getattr(cause, "returncode", None) in (124, 137):
            text = f"sbatch did not answer within {SBATCH_TIMEOUT_S} s (is the controller overloaded?) {text}"
        raise SlurmUnavailable(f"sbatch refused the job: {text}") from None
    return [str(job.job_id) for job in jobs]


def submit_job(cfg: Config, run_dir: str, exclude: str = "") -> str:
    """Submit one job for run_dir through submitit (a resubmission: cfg from the run's config.json, its
    cpus_per_task already resolved); returns the job id."""
    return _submit_spec(job_spec(cfg, run_dir, exclude), [run_dir])[0]


def _record_submission(
    cfg: Config, run_dir: str, job_id: str, log_dir: str, code: dict[str, Any] | None = None
) -> None:
    excluded = [n for n in cfg.cluster.exclude.split(",") if n]
    snap = {k: code[k] for k in ("path", "commit", "dirty") if code and k in code}
    append_event(
        run_dir,
        "submitted",
        job_id=job_id,
        attempt=0,
        excluded_nodes=excluded,
        partition=cfg.cluster.partition,
        nodes=cfg.cluster.nodes,
        ranks_per_node=cfg.cluster.gpus_per_node,
        log_dir=log_dir,
        **{f"code_{k}" if k != "path" else "code": v for k, v in snap.items()},
    )
    lock = held(run_dir)
    if lock is not None:
        lock.hand_to_job(job_id)  # from now on the job holds the run directory (training/contract/rundir/lock.py)
    print(f"submitted Slurm job {job_id}; run dir {run_dir}")
    print(f"  follow: meshrun action=status run.dir={run_dir}")


def submit_arrays(run_dirs: Sequence[str], folder: str) -> dict[str, dict[str, Any]]:
    """Submit queued sweep points (each run dir holds its config.json) as one sbatch per group of
    identical jobs: a job array, or a plain job for a group of one; folder is submitit's folder for the
    arrays (the sweep directory's submitit/). Points with dry_run=true get their group's batch script
    printed instead. Returns run dir -> the fields its result gains (status and job_id, or the refusal)
    and records them in the point's point.json; wait=true is the caller's (launcher/manage/follow.py
    follow_points)."""
    groups: dict[tuple[bool, str], list[tuple[Config, str]]] = {}
    for run_dir in run_dirs:
        cfg = load_config(RunPaths(run_dir).config)
        groups.setdefault((cfg.dry_run, array_group_key(cfg)), []).append((cfg, run_dir))
    updates: dict[str, dict[str, Any]] = {}
    for (dry, _), group in groups.items():
        if not dry:
            group = _lock_points(group, updates)
            if not group:
                continue
        cfg, dirs = group[0][0], [run_dir for _, run_dir in group]
        code_root = code_dir(dirs[0] if len(group) == 1 else folder)
        spec = (
            job_spec(cfg, dirs[0], code_root=code_root)
            if len(group) == 1
            else array_job_spec(cfg, dirs, folder, code_root=code_root)
        )
        if dry:
            print(dry_run_text(cfg, spec, dirs[0]) if len(group) == 1 else array_dry_run_text(spec, dirs), flush=True)
            updates.update({run_dir: {"status": "dry_run"} for run_dir in dirs})
            continue
        code = take_snapshot(dirs[0] if len(group) == 1 else folder)
        if len(group) > 1:
            print(f"submitting {len(group)} sweep points as one Slurm job array", flush=True)
        try:
            job_ids = _submit_spec(spec, dirs)
        except SlurmUnavailable as exc:
            print(f"error: {exc}\nnothing was submitted for {', '.join(dirs)}.", file=sys.stderr)
            updates.update({run_dir: {"status": "invalid", "errors": [f"error: {exc}"]} for run_dir in dirs})
            for run_dir in dirs:
                _release(run_dir)
            continue
        for (point_cfg, run_dir), job_id in zip(group, job_ids):
            _record_submission(point_cfg, run_dir, job_id, spec.folder, code)
            updates[run_dir] = {"status": "submitted", "job_id": job_id}
    for run_dir, fields in updates.items():
        update_point(run_dir, **fields)
    return updates


def _lock_points(group: list[tuple[Config, str]], updates: dict[str, dict[str, Any]]) -> list[tuple[Config, str]]:
    """The queued points whose run directory this process could lock; the others become invalid."""
    from launcher.slurm.queries import job_alive

    out = []
    for cfg, run_dir in group:
        if held(run_dir) is None:
            try:
                acquire(run_dir, what="meshrun sweep submission", job_alive=job_alive)
            except RunLocked as exc:
                print(f"error: {exc}", file=sys.stderr)
                updates[run_dir] = {"status": "invalid", "errors": [f"error: {exc}"]}
                continue
        out.append((cfg, run_dir))
    return out


def _release(run_dir: str) -> None:
    lock = held(run_dir)
    if lock is not None:
        lock.release()


def submit(
    cfg: Config, run_dir: str, plan_result: dict[str, Any], multirun: bool = False, queue: bool = False
) -> dict[str, Any]:
    """The app's Slurm launcher (action=train, cluster.kind=slurm). queue=True (a sweep point of
    meshrun's launcher): check, then return status "queued"; the launcher submits the batch's queued
    points with submit_arrays (a dry run too: it prints the arrays' scripts)."""
    try:
        cfg = resolve_for_slurm(cfg)
        spec = job_spec(cfg, run_dir, code_root=code_dir(run_dir))  # the one spec of this submission
        if cfg.dry_run and not queue:
            print(dry_run_text(cfg, spec, run_dir))
            return {**plan_result, "status": "dry_run", "run_dir": run_dir}
    except SlurmConfigError as exc:
        return _refuse(str(exc), multirun, EXIT_INVALID)
    except SlurmUnavailable as exc:
        return _refuse(str(exc), multirun, EXIT_SLURM)
    write_config(cfg, run_dir)  # with cpus_per_task resolved: resubmissions and arrays ask the same
    write_request(run_dir, cfg.train.resume)  # an explicit train.resume is this launch's first attempt's only
    if queue:  # submitted (or printed) with the batch's other points by submit_arrays
        return {**plan_result, "status": "queued", "run_dir": run_dir}
    code = take_snapshot(run_dir)
    try:
        job_id = _submit_spec(spec, [run_dir])[0]
    except SlurmUnavailable as exc:
        return _refuse(str(exc), multirun, EXIT_SLURM)
    _record_submission(cfg, run_dir, job_id, spec.folder, code)
    return {**plan_result, "status": "submitted", "job_id": job_id, "run_dir": run_dir}


def _refuse(message: str, multirun: bool, code: int) -> dict[str, Any]:
    print(f"error: {message}\nnothing was submitted.", file=sys.stderr)
    if multirun:
        return {"status": "invalid", "errors": [f"error: {message}"]}
    raise SystemExit(code)
