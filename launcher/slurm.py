"""Submit a meshrun run to Slurm through submitit: one job per run, returns at once.

submit() checks the controller and the partition before anything is written to Slurm, submits
the job (launcher/sbatch.py describes it), records `submitted` in events.jsonl and prints the job id
and run dir. wait=true follows the job (and its requeues/resubmissions) and streams rank 0's
output; dry_run=true prints the sbatch script and the srun line and submits nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from launcher.sbatch import SlurmConfigError, dry_run_text, job_spec
from launcher.slurm_rank import RankTask
from launcher.rundir import write_config
from training.config import Config
from training.events import append_event

EXIT_INVALID = 2
EXIT_SLURM = 3
"""Exit code of `meshrun` when Slurm itself refuses (no controller, sbatch error)."""


class SlurmUnavailable(RuntimeError):
    """The controller does not answer or refuses the job."""


def _run(cmd: List[str], timeout: float = 20.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmUnavailable(f"`{cmd[0]}` not found: this machine has no Slurm client "
                               "(install slurm-client, or use cluster=local)") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"`{' '.join(cmd)}` did not answer in {timeout:.0f} s: "
                               "is the Slurm controller reachable?") from None


def check_controller() -> None:
    res = _run(["scontrol", "ping"])
    if res.returncode != 0 or "UP" not in res.stdout:
        msg = (res.stdout + res.stderr).strip().splitlines()
        raise SlurmUnavailable("the Slurm controller does not answer (`scontrol ping`: "
                               f"{msg[-1] if msg else 'no output'}); start it (dev: "
                               "`bash slurm/dev-cluster.sh up`) or check SLURM_CONF")


def partition_nodes(partition: str) -> List[str]:
    """Node names of a partition; [] when the partition does not exist."""
    res = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"])
    return sorted(set(res.stdout.split())) if res.returncode == 0 else []


def check_partition(cfg: Config) -> List[str]:
    nodes = partition_nodes(cfg.cluster.partition)
    if not nodes:
        known = _run(["sinfo", "-h", "-o", "%R"]).stdout.split()
        raise SlurmConfigError(f"cluster.partition={cfg.cluster.partition!r} does not exist on this cluster; "
                               f"known partitions: {', '.join(sorted(set(known))) or 'none'}")
    usable = [n for n in nodes if n not in set(cfg.cluster.exclude.split(",")) - {""}]
    if len(usable) < cfg.cluster.nodes:
        raise SlurmConfigError(f"cluster.nodes={cfg.cluster.nodes} but partition {cfg.cluster.partition!r} has "
                               f"{len(usable)} usable node(s) ({', '.join(usable)}): lower cluster.nodes")
    return nodes


def submit_job(cfg: Config, run_dir: str, exclude: str = "") -> str:
    """Submit one job for run_dir through submitit; returns the job id."""
    import submitit

    spec = job_spec(cfg, run_dir, exclude)
    os.makedirs(spec.folder, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=spec.folder, python=spec.python)
    executor.update_parameters(**spec.parameters)
    try:
        job = executor.submit(RankTask(run_dir))
    except Exception as exc:  # submitit wraps sbatch's complaint
        raise SlurmUnavailable(f"sbatch refused the job: {str(exc).strip()}") from None
    return str(job.job_id)


def submit(cfg: Config, run_dir: str, plan_result: Dict[str, Any], multirun: bool = False) -> Dict[str, Any]:
    """The app's Slurm launcher (action=train, cluster.kind=slurm)."""
    try:
        if cfg.dry_run:
            print(dry_run_text(cfg, run_dir))
            return {**plan_result, "status": "dry_run", "run_dir": run_dir}
        job_spec(cfg, run_dir)  # every config problem before touching Slurm
        check_controller()
        check_partition(cfg)
    except SlurmConfigError as exc:
        return _refuse(str(exc), multirun, EXIT_INVALID)
    except SlurmUnavailable as exc:
        return _refuse(str(exc), multirun, EXIT_SLURM)
    write_config(cfg, run_dir)
    try:
        job_id = submit_job(cfg, run_dir)
    except SlurmUnavailable as exc:
        return _refuse(str(exc), multirun, EXIT_SLURM)
    excluded = [n for n in cfg.cluster.exclude.split(",") if n]
    append_event(run_dir, "submitted", job_id=job_id, attempt=0, excluded_nodes=excluded,
                 partition=cfg.cluster.partition, nodes=cfg.cluster.nodes, ranks_per_node=cfg.cluster.gpus_per_node)
    print(f"submitted Slurm job {job_id}; run dir {run_dir}")
    print(f"  follow: meshrun action=status run.dir={run_dir}")
    result = {**plan_result, "status": "submitted", "job_id": job_id, "run_dir": run_dir}
    if cfg.wait and not multirun:
        result["final"] = follow(run_dir)
        if result["final"]["state"] != "COMPLETED":
            raise SystemExit(1)
    return result


def _refuse(message: str, multirun: bool, code: int) -> Dict[str, Any]:
    print(f"error: {message}\nnothing was submitted.", file=sys.stderr)
    if multirun:
        return {"status": "invalid", "errors": [f"error: {message}"]}
    raise SystemExit(code)


def follow(run_dir: str, poll_s: float = 1.0, timeout_s: Optional[float] = None) -> Dict[str, Any]:
    """Stream rank 0's output (run_dir/submitit/<job>_0_log.out of every job of the run) until the run
    is COMPLETED or FAILED/CANCELLED without a follow-up job; returns the final status."""
    from launcher.status import FINAL_STATES, run_status

    offsets: Dict[str, int] = {}
    start = time.time()
    while True:
        status = run_status(run_dir)
        job = status.get("job_id")
        if job:
            path = os.path.join(run_dir, "submitit", f"{job}_0_log.out")
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    chunk = f.read()
                    offsets[path] = f.tell()
                if chunk:
                    sys.stdout.write(chunk.decode("utf-8", "replace"))
                    sys.stdout.flush()
            except OSError:
                pass
        if status["state"] in FINAL_STATES:
            # A FAILED job may still be followed by a resubmission the epilogue is writing: look again.
            time.sleep(poll_s)
            again = run_status(run_dir)
            if again["job_id"] == job and again["state"] in FINAL_STATES:
                return again
        if timeout_s is not None and time.time() - start > timeout_s:
            return status
        time.sleep(poll_s)
