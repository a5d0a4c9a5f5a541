"""Submit a meshrun run to Slurm through submitit: one job per run, returns at once.

submit() checks the controller and the partition before anything is written to Slurm, submits
the job (launcher/slurm/sbatch.py describes it), records `submitted` in events.jsonl and prints the job id
and run dir. wait=true follows the job (and its requeues/resubmissions) and streams rank 0's
output (in a sweep: waits until every point has ended and adds the final states to the summary);
dry_run=true prints the sbatch script and the srun line and submits nothing.

In a sweep run by meshrun's Hydra launcher (hydra_plugins/meshrun_sweep), submit() only checks and
queues each point; when the launcher's batch ends, `array_batch` submits the queued points as job
arrays, one per group of points whose jobs differ only in their run directory (same nodes, time,
environment, ...). Each array task is then a job of its own for status, requeue and events
("<array>_<task>", submitit's naming); a resubmission after a failure is a plain job.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from launcher.slurm.sbatch import SlurmConfigError, SlurmJobSpec, array_group_key, array_job_spec, dry_run_text, job_spec
from launcher.slurm.rank_task import RankTask
from launcher.rundir import write_config
from training.config import Config
from training.events import append_event
from training.exit_codes import EXIT_INVALID, EXIT_SLURM


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


def _submit_spec(spec: SlurmJobSpec, run_dirs: List[str]) -> List[str]:
    """One sbatch for spec: a plain job for one run dir, a job array for several; the job ids."""
    import submitit

    os.makedirs(spec.folder, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=spec.folder, python=spec.python)
    executor.update_parameters(**spec.parameters)
    try:
        with executor.batch() if len(run_dirs) > 1 else contextlib.nullcontext():
            jobs = [executor.submit(RankTask(run_dir)) for run_dir in run_dirs]
    except Exception as exc:  # submitit wraps sbatch's complaint
        raise SlurmUnavailable(f"sbatch refused the job: {str(exc).strip()}") from None
    return [str(job.job_id) for job in jobs]


def submit_job(cfg: Config, run_dir: str, exclude: str = "") -> str:
    """Submit one job for run_dir through submitit; returns the job id."""
    return _submit_spec(job_spec(cfg, run_dir, exclude), [run_dir])[0]


def _record_submission(cfg: Config, run_dir: str, job_id: str, log_dir: str) -> None:
    excluded = [n for n in cfg.cluster.exclude.split(",") if n]
    append_event(run_dir, "submitted", job_id=job_id, attempt=0, excluded_nodes=excluded,
                 partition=cfg.cluster.partition, nodes=cfg.cluster.nodes, ranks_per_node=cfg.cluster.gpus_per_node,
                 log_dir=log_dir)
    print(f"submitted Slurm job {job_id}; run dir {run_dir}")
    print(f"  follow: meshrun action=status run.dir={run_dir}")


class ArrayBatch:
    """Sweep points checked and queued by submit(), submitted together by submit_all()."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        """submitit's folder for the arrays (the sweep directory's submitit/)."""
        self.points: List[Tuple[Config, str, Dict[str, Any]]] = []

    def add(self, cfg: Config, run_dir: str, result: Dict[str, Any]) -> None:
        self.points.append((cfg, run_dir, result))

    def submit_all(self) -> None:
        """One sbatch per group of identical jobs; each point's result dict (the sweep summary holds the
        same objects) gets its job id, or the refusal when sbatch refuses its group. With wait=true, waits
        until every submitted point has ended and adds its final status."""
        groups: Dict[str, List[Tuple[Config, str, Dict[str, Any]]]] = {}
        points, self.points = self.points, []
        for point in points:
            groups.setdefault(array_group_key(point[0]), []).append(point)
        for group in groups.values():
            cfg, run_dirs = group[0][0], [run_dir for _, run_dir, _ in group]
            if len(group) == 1:
                spec = job_spec(cfg, run_dirs[0])
            else:
                spec = array_job_spec(cfg, run_dirs, self.folder)
                print(f"submitting {len(group)} sweep points as one Slurm job array", flush=True)
            try:
                job_ids = _submit_spec(spec, run_dirs)
            except SlurmUnavailable as exc:
                print(f"error: {exc}\nnothing was submitted for {', '.join(run_dirs)}.", file=sys.stderr)
                for _, _, result in group:
                    result.update(status="invalid", errors=[f"error: {exc}"])
                continue
            for (point_cfg, run_dir, result), job_id in zip(group, job_ids):
                _record_submission(point_cfg, run_dir, job_id, spec.folder)
                result.update(status="submitted", job_id=job_id)
        waiting = {point[1]: point[2] for point in points if point[0].wait and point[2]["status"] == "submitted"}
        if waiting:
            for run_dir, final in wait_all(list(waiting)).items():
                waiting[run_dir]["final"] = final


_array_batch: Optional[ArrayBatch] = None


@contextlib.contextmanager
def array_batch(folder: str) -> Iterator[ArrayBatch]:
    """While open, submit() queues sweep points instead of submitting them; on a normal exit they are
    submitted as job arrays. An exception submits nothing (no half-submitted sweep)."""
    global _array_batch
    batch = _array_batch = ArrayBatch(folder)
    try:
        yield batch
    finally:
        _array_batch = None
    batch.submit_all()


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
    if multirun and _array_batch is not None:
        result = {**plan_result, "status": "queued", "run_dir": run_dir}
        _array_batch.add(cfg, run_dir, result)  # submitted with the sweep's other points
        return result
    try:
        job_id = submit_job(cfg, run_dir)
    except SlurmUnavailable as exc:
        return _refuse(str(exc), multirun, EXIT_SLURM)
    _record_submission(cfg, run_dir, job_id, job_spec(cfg, run_dir).folder)
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


def _settled(run_dir: str, status: Dict[str, Any], poll_s: float) -> Optional[Dict[str, Any]]:
    """The final status when the run has ended for good, else None. A FAILED job may still be followed
    by a resubmission its epilogue is writing: a final state counts only when a second look agrees."""
    from launcher.status import FINAL_STATES, run_status

    if status["state"] not in FINAL_STATES:
        return None
    time.sleep(poll_s)
    again = run_status(run_dir)
    return again if again["job_id"] == status["job_id"] and again["state"] in FINAL_STATES else None


def wait_all(run_dirs: List[str], poll_s: float = 2.0) -> Dict[str, Dict[str, Any]]:
    """A sweep with wait=true: until every run has ended (requeues and resubmissions included); prints
    each run's end as it comes and returns run dir -> final status."""
    from launcher.status import run_status

    print(f"waiting for {len(run_dirs)} sweep point(s) to end (wait=true)", flush=True)
    finals: Dict[str, Dict[str, Any]] = {}
    while len(finals) < len(run_dirs):
        for run_dir in run_dirs:
            if run_dir in finals:
                continue
            final = _settled(run_dir, run_status(run_dir), poll_s=0.5)
            if final is not None:
                finals[run_dir] = final
                print(f"  {final['state']}: job {final['job_id']}, last step {final['last_step']}, {run_dir}",
                      flush=True)
        if len(finals) < len(run_dirs):
            time.sleep(poll_s)
    return finals


def follow(run_dir: str, poll_s: float = 1.0, timeout_s: Optional[float] = None) -> Dict[str, Any]:
    """Stream rank 0's output (<log dir>/<job>_0_log.out of every job of the run) until the run
    is COMPLETED or FAILED/CANCELLED without a follow-up job; returns the final status."""
    from launcher.status import job_log_dir, run_status

    offsets: Dict[str, int] = {}
    start = time.time()
    while True:
        status = run_status(run_dir)
        job = status.get("job_id")
        if job:
            path = os.path.join(job_log_dir(run_dir, job), f"{job}_0_log.out")
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
        final = _settled(run_dir, status, poll_s)
        if final is not None:
            return final
        if timeout_s is not None and time.time() - start > timeout_s:
            return status
        time.sleep(poll_s)
