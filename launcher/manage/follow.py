"""Following a submitted Slurm run with wait=true, until it has ended for good.

One run (`meshrun cluster=<slurm preset> wait=true`, launcher/cli/app.py): rank 0's output is streamed from
every job of the run (requeues and resubmissions included) and the final status is returned; Ctrl-C stops
following only (the job is Slurm's and keeps running). A sweep's points submitted as job arrays
(hydra_plugins/meshrun_sweep): every point with wait=true is waited for, and its final status goes into its
point.json (launcher/records/point.py) and the sweep's summary.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Any, NoReturn

from launcher.manage import status
from launcher.records.point import update_point
from launcher.records.readers import job_log
from launcher.slurm.queries import FINAL_STATES
from training.contract.config import load_config
from training.contract.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED
from training.contract.rundir.paths import RunPaths


def follow_run(result: dict[str, Any]) -> dict[str, Any]:
    """wait=true after submit() (launcher/slurm/submit.py): result with the run's `final` status; exit EXIT_FAILED
    when the run did not complete."""
    result["final"] = follow_or_detach(result["run_dir"], result["job_id"])
    if result["final"]["state"] != "COMPLETED":
        raise SystemExit(EXIT_FAILED)
    return result


def follow_points(updates: dict[str, dict[str, Any]], folder: str) -> None:
    """wait=true for a sweep's points after submit_arrays (updates: its answer, run dir -> fields; folder: the
    arrays' submitit folder in the sweep directory): until every submitted point whose config asks to wait has
    ended; each one's final status goes into its fields and its point.json."""
    waiting = [
        run_dir
        for run_dir, fields in updates.items()
        if fields.get("status") == "submitted" and load_config(RunPaths(run_dir).config).wait
    ]
    if not waiting:
        return
    try:
        finals = wait_all(waiting)
    except KeyboardInterrupt:
        stop_following(f"the sweep's {len(waiting)} job(s) keep running", os.path.dirname(os.path.normpath(folder)))
    for run_dir, final in finals.items():
        updates[run_dir]["final"] = final
        update_point(run_dir, final=final)


def follow_or_detach(run_dir: str, job_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    """follow(run_dir) until the run ends, or until Ctrl-C: then stop_following (the job keeps running)."""
    try:
        return follow(run_dir, poll_s=poll_s)
    except KeyboardInterrupt:
        stop_following(f"job {job_id} keeps running", run_dir)


def stop_following(what: str, run_dir: str) -> NoReturn:
    """Ctrl-C while wait=true follows: one line (the job is Slurm's and keeps running; how to follow it again
    and how to cancel it), then exit 130 (training/contract/exit_codes.py) instead of a traceback."""
    where = shlex.quote(run_dir)
    print(
        f"\nmeshrun: stopped following; {what}. follow: meshrun action=logs run.dir={where} logs.follow=true; "
        f"cancel: meshrun action=cancel run.dir={where}",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(EXIT_INTERRUPTED)


def _settled(run_dir: str, now: dict[str, Any], poll_s: float) -> dict[str, Any] | None:
    """The final status when the run has ended for good, else None. A FAILED job may still be followed
    by a resubmission its epilogue is writing: a final state counts only when a second look agrees."""
    if now["state"] not in FINAL_STATES:
        return None
    time.sleep(poll_s)
    again = status.run_status(run_dir)
    return again if again["job_id"] == now["job_id"] and again["state"] in FINAL_STATES else None


def wait_all(run_dirs: list[str], poll_s: float = 2.0) -> dict[str, dict[str, Any]]:
    """A sweep with wait=true: until every run has ended (requeues and resubmissions included); prints
    each run's end as it comes and returns run dir -> final status."""
    print(f"waiting for {len(run_dirs)} sweep point(s) to end (wait=true)", flush=True)
    finals: dict[str, dict[str, Any]] = {}
    while len(finals) < len(run_dirs):
        for run_dir in run_dirs:
            if run_dir in finals:
                continue
            final = _settled(run_dir, status.run_status(run_dir), poll_s=0.5)
            if final is not None:
                finals[run_dir] = final
                print(
                    f"  {final['state']}: job {final['job_id']}, last step {final['last_step']}, {run_dir}", flush=True
                )
        if len(finals) < len(run_dirs):
            time.sleep(poll_s)
    return finals


def follow(run_dir: str, poll_s: float = 1.0, timeout_s: float | None = None) -> dict[str, Any]:
    """Stream rank 0's output (<log dir>/<job>_0_log.out of every job of the run) until the run
    is COMPLETED or FAILED/CANCELLED without a follow-up job; returns the final status."""
    offsets: dict[str, int] = {}
    start = time.time()
    while True:
        now = status.run_status(run_dir)
        job = now.get("job_id")
        if job:
            path = job_log(run_dir, job)
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
        final = _settled(run_dir, now, poll_s)
        if final is not None:
            return final
        if timeout_s is not None and time.time() - start > timeout_s:
            return now
        time.sleep(poll_s)
