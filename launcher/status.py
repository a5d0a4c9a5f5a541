"""`meshrun action=status run.dir=D`: one JSON object on stdout (state, job_id, attempt, last_step,
excluded_nodes), from events.jsonl, metrics.jsonl, checkpoints/latest and squeue/sacct. D may also be
a sweep directory (it holds sweep.json): then the object lists every point's status and counts the states.

Also the small readers the Slurm driver shares (last step, the job chain in events.jsonl)."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from typing import Any, Dict, List, Optional

from training.events import EVENTS_FILE, read_events
from training.exit_codes import EXIT_INVALID
from training.slurm_env import SlurmUnavailable, slurm_command

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def last_metrics_step(run_dir: str) -> Optional[int]:
    """Step of the last complete line of metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def last_checkpoint_step(run_dir: str) -> Optional[int]:
    """Step named by checkpoints/latest ("step_<N>")."""
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            m = re.search(r"(\d+)", f.read())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def last_step(run_dir: str) -> Optional[int]:
    steps = [s for s in (last_metrics_step(run_dir), last_checkpoint_step(run_dir)) if s is not None]
    return max(steps) if steps else None


def current_job_id(events: List[Dict[str, Any]]) -> Optional[str]:
    """The newest Slurm job of the run: the last submitted or resubmitted one."""
    job = None
    for ev in events:
        if ev.get("event") == "submitted" and ev.get("job_id") not in (None, "local"):
            job = str(ev["job_id"])
        if ev.get("event") == "requeued" and ev.get("new_job_id"):
            job = str(ev["new_job_id"])
    return job


def job_log_dir(run_dir: str, job: str) -> str:
    """Where submitit keeps a job's logs: recorded at submission (a sweep's job array shares the sweep's
    folder); a resubmitted job's are in run_dir/submitit."""
    for ev in read_events(run_dir):
        if ev.get("event") == "submitted" and str(ev.get("job_id")) == job and ev.get("log_dir"):
            return str(ev["log_dir"])
    return os.path.join(run_dir, "submitit")


def excluded_nodes(events: List[Dict[str, Any]]) -> List[str]:
    out: List[str] = []
    for ev in events:
        if ev.get("event") in ("submitted", "requeued") and "excluded_nodes" in ev:
            out = list(ev["excluded_nodes"])
    return out


def retries_used(events: List[Dict[str, Any]]) -> int:
    """Resubmissions after failures so far (preemption requeues do not count)."""
    return sum(1 for ev in events if ev.get("event") == "requeued" and ev.get("cause") == "failure")


def _run(cmd: List[str]) -> str:
    """A Slurm query's output; "" when Slurm cannot answer (the run's state then comes from its events)."""
    try:
        return slurm_command(cmd).stdout
    except SlurmUnavailable:
        return ""


def slurm_state(job_id: str) -> Optional[str]:
    """PENDING, RUNNING, ... from squeue, or from sacct once the job has left the queue."""
    out = _run(["squeue", "-h", "-r", "-j", job_id, "-o", "%T"]).split()  # -r: one line per array task
    if out:
        return out[0]
    for line in _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State"]).splitlines():
        jid, _, state = line.partition("|")
        if jid.strip() == job_id and state:
            return state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return None


def _local_launcher_alive(started: Dict[str, Any]) -> bool:
    """False only when the started event names a launcher on this host that no longer runs (killed -9,
    machine rebooted): then nothing will ever write the run's end. Unknown cases count as alive."""
    pid = started.get("launcher_pid")
    if pid is None or socket.gethostname() not in started.get("nodes", []):
        return True
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"launcher" in cmdline or b"meshrun" in cmdline  # the pid may have been reused by another program


def run_status(run_dir: str) -> Dict[str, Any]:
    events = read_events(run_dir)
    job = current_job_id(events)
    attempt = max((int(ev.get("attempt", 0)) for ev in events if ev.get("event") == "started"), default=None)
    state = None
    reason = None
    last = events[-1] if events else {}
    if last.get("event") == "completed":
        state = "COMPLETED"
    elif last.get("event") == "stopped":
        state, reason = "FAILED", last.get("reason")
    elif job is not None:
        state = slurm_state(job)
        if state is None:
            state = "PENDING"  # accepted by sbatch but not yet visible (sacct lags)
        elif state == "PENDING" and last.get("event") == "requeued":
            state = "REQUEUED"
    else:
        # A local run: the launcher's own events decide; the ranks' (checkpoint, signal, ...) come between.
        life = [ev for ev in events if ev.get("event") in ("started", "completed", "failed", "stopped")]
        state = {"started": "RUNNING", "failed": "FAILED"}.get(life[-1]["event"]) if life else None
        if state == "RUNNING" and not _local_launcher_alive(life[-1]):
            state = "FAILED"
            reason = (f"the local launcher (pid {life[-1]['launcher_pid']}) ended without recording how; "
                      "run again with the same run.dir to resume from the last checkpoint")
    out = {
        "state": state or "UNKNOWN",
        "job_id": job if job is not None else (last.get("job_id") if last else None),
        "attempt": attempt,
        "last_step": last_step(run_dir),
        "excluded_nodes": excluded_nodes(events),
    }
    if reason:
        out["reason"] = reason
    return out


SWEEP_FILE = "sweep.json"


def sweep_status(sweep_dir: str) -> Dict[str, Any]:
    """Every point of a sweep: the run's status for launched points, SKIPPED with the reason for the
    points the sweep left out (invalid, did not fit, refused), and how many points are in each state."""
    with open(os.path.join(sweep_dir, SWEEP_FILE)) as f:
        sweep = json.load(f)
    points = []
    for skipped, rows in ((False, sweep.get("feasible", [])), (True, sweep.get("infeasible", []))):
        for row in rows:
            point = {"num": row.get("num"), "overrides": row.get("overrides", [])}
            run_dir = row.get("run_dir")
            if skipped:
                point.update(state="SKIPPED", reason=row.get("reason", row.get("status", "")))
            elif run_dir and os.path.exists(os.path.join(run_dir, EVENTS_FILE)):
                point.update(run_dir=run_dir, **run_status(run_dir))
            else:  # an action=plan sweep: nothing was launched
                point.update(state="PLANNED" if row.get("status") == "ok" else "UNKNOWN", run_dir=run_dir)
            points.append(point)
    points.sort(key=lambda pt: (pt["num"] is None, pt["num"]))
    states: Dict[str, int] = {}
    for point in points:
        states[point["state"]] = states.get(point["state"], 0) + 1
    return {"sweep_dir": sweep_dir, "points": points, "states": states}


def print_status(run_dir: str) -> Dict[str, Any]:
    """Print exactly one JSON object on stdout; an unknown run dir is an error on stderr (EXIT_INVALID)."""
    if os.path.exists(os.path.join(run_dir, SWEEP_FILE)):
        out = sweep_status(run_dir)
        print(json.dumps(out, sort_keys=True))
        return out
    # Hydra has created run_dir (with its app.log) before this runs: a run is known by what meshrun wrote.
    if not any(os.path.exists(os.path.join(run_dir, name)) for name in (EVENTS_FILE, "config.json")):
        print(f"error: run.dir={run_dir} is not a meshrun run directory (no {EVENTS_FILE} or config.json): "
              "give the run directory printed at launch or submission, or a sweep directory (it holds "
              f"{SWEEP_FILE})", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    status = run_status(run_dir)
    print(json.dumps(status, sort_keys=True))
    return status
