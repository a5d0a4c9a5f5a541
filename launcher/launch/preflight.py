"""The preflight ranks run alone, locally (run_local) or as a Slurm job (submit_slurm); action=preflight's entry,
launcher/launch/preflight_action.py, asks the cluster kind's backend, which calls one of them.

No torch here: the ranks are `python -m training.preflight RUN_DIR` subprocesses (local) or the
same command as a Slurm job (`submit_slurm`, a submitit job of `PreflightTask`s, no requeue). The verdict
is read back from run_dir/preflight.json; a bad node makes this exit with EXIT_NODE_BAD, nothing bad
with EXIT_OK (training/contract/exit_codes.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from launcher.launch.local import LOOPBACK, free_port
from launcher.ranks.processes import POLL_S, engine_env, rank_process_env, stop_processes, threads_per_rank
from training.contract.config import Config, load_config
from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_NODE_BAD, EXIT_OK, EXIT_SLURM
from training.contract.rundir.paths import RunPaths
from training.contract.slurm_env import SlurmUnavailable, dist_env, torch_env_from_slurm

PREFLIGHT_MODULE = "training.preflight"


def preflight_argv(run_dir: str) -> list[str]:
    """The per-rank command (the same locally and under srun; ranks derive RANK & co. from SLURM_*)."""
    return [sys.executable, "-m", PREFLIGHT_MODULE, run_dir]


def _local_env(rank: int, world: int, per_node: int, port: int, threads: int, cfg: Config) -> dict[str, str]:
    env = rank_process_env(dist_env(rank, world, rank % per_node, per_node, LOOPBACK, port), engine_env(cfg), threads)
    if cfg.cluster.nodes > 1:
        # Several simulated nodes on this machine: give each its own name so per-node checks,
        # verdicts and ib_sysfs_root_by_node work as on a real cluster.
        env["MESHRUN_NODE"] = f"{socket.gethostname().split('.')[0]}-{rank // per_node}"
    return env


def run_local(cfg: Config, run_dir: str, timeout_s: float = 0.0) -> int:
    """Spawn nodes x gpus_per_node preflight ranks here; return the exit status of the job."""
    per_node, world = cfg.cluster.gpus_per_node, cfg.cluster.nodes * cfg.cluster.gpus_per_node
    port = cfg.cluster.master_port or free_port()
    threads = threads_per_rank(world)  # every simulated node shares this machine's cores
    paths = RunPaths(run_dir)
    os.makedirs(paths.logs, exist_ok=True)
    timeout_s = timeout_s or 2 * cfg.cluster.preflight.timeout_s + 60
    procs, logs = [], []
    try:
        for r in range(world):
            # Rank 0 prints the table to this terminal; the others only log.
            log = open(paths.preflight_log(r), "wb")
            logs.append(log)
            env = _local_env(r, world, per_node, port, threads, cfg)
            procs.append(subprocess.Popen(preflight_argv(run_dir), env=env, stdout=None if r == 0 else log, stderr=log))
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, EXIT_OK, EXIT_NODE_BAD) for c in codes):
                break  # a rank crashed: its peers would wait for it until the collective timeout
            time.sleep(POLL_S)
        stop_processes(procs)
        codes = [p.returncode for p in procs]
    finally:
        for log in logs:
            log.close()
    if any(c == EXIT_NODE_BAD for c in codes):
        return EXIT_NODE_BAD
    crashed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if crashed:
        r, c = crashed[0]
        print(f"meshrun: preflight rank {r} exited with {c}; see {paths.preflight_log(r)}", file=sys.stderr)
        return c if c > 0 else EXIT_FAILED
    return EXIT_OK


@dataclass
class PreflightTask:
    """The submitit callable of a preflight-only Slurm job: one task = one preflight rank."""

    run_dir: str
    """The run directory holding config.json."""

    def __call__(self) -> int:
        cfg = load_config(RunPaths(self.run_dir).config)
        env = rank_process_env(torch_env_from_slurm(os.environ), engine_env(cfg))
        # The status is returned, not raised: a bad node (4) must not make srun kill the healthy
        # ranks before they have reported; the verdict is in preflight.json.
        return subprocess.call(preflight_argv(self.run_dir), env=env)


def submit_slurm(cfg: Config, run_dir: str) -> dict[str, Any]:
    """Run the preflight alone as a Slurm job over cluster.nodes x gpus_per_node tasks; wait for it."""
    import submitit

    from launcher.slurm.sbatch import SlurmConfigError, preflight_job_spec
    from launcher.slurm.submit import resolve_for_slurm

    try:
        spec = preflight_job_spec(resolve_for_slurm(cfg), run_dir)
        ex = submitit.SlurmExecutor(folder=spec.folder, python=spec.python)
        ex.update_parameters(**spec.parameters)
        try:
            job = ex.submit(PreflightTask(run_dir))
        except Exception as exc:  # submitit wraps sbatch's complaint
            raise SlurmUnavailable(f"sbatch refused the preflight job: {str(exc).strip()}") from None
    except (SlurmConfigError, SlurmUnavailable) as exc:
        print(f"error: {exc}\nnothing was submitted.", file=sys.stderr)
        raise SystemExit(EXIT_INVALID if isinstance(exc, SlurmConfigError) else EXIT_SLURM) from None
    print(f"submitted preflight job {job.job_id}; waiting", file=sys.stderr)
    codes = job.results()
    return {
        "job_id": str(job.job_id),
        "codes": codes,
        "exit_code": EXIT_NODE_BAD if EXIT_NODE_BAD in codes else max(codes),
    }
