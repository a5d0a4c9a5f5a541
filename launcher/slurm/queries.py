"""Slurm's answers about jobs: whether one is still queued, the states of many at once (squeue, then sacct for
those that left the queue). Pure Python; the commands run through training/contract/slurm_env.py's one runner."""

from __future__ import annotations

from training.contract.slurm_env import SlurmUnavailable, slurm_command

FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def job_alive(job_id: str) -> bool | None:
    """Whether Slurm still holds the job (pending, running, requeued, completing): True/False, or None
    when Slurm cannot answer (the run lock then counts the job as alive, training/contract/rundir/lock.py)."""
    try:
        res = slurm_command(["squeue", "-h", "-r", "-j", job_id, "-o", "%T"])
    except SlurmUnavailable:
        return None
    if res.returncode != 0:
        return False if "Invalid job id" in res.stderr else None
    states = res.stdout.split()
    return any(s not in FINAL_STATES for s in states)


def _run(cmd: list[str]) -> str:
    """A Slurm query's output; "" when Slurm cannot answer (the run's state then comes from its events)."""
    try:
        return slurm_command(cmd).stdout
    except SlurmUnavailable:
        return ""


SLURM_QUERIES = [0]
"""squeue/sacct calls made by slurm_states so far (a sweep's status makes at most two, whatever its size)."""


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """Job id -> PENDING, RUNNING, ... for many jobs at once: one squeue call for all of them, then one sacct
    call for those that have left the queue. Jobs Slurm does not know (yet) are left out."""
    jobs = sorted(set(job_ids))
    out: dict[str, str] = {}
    if not jobs:
        return out
    SLURM_QUERIES[0] += 1
    # -r: one line per array task ("<array>_<task>", the ids meshrun records); unknown ids are ignored.
    for line in _run(["squeue", "-h", "-r", "-j", ",".join(jobs), "-o", "%i %T"]).splitlines():
        jid, _, state = line.strip().partition(" ")
        if jid in jobs and state and jid not in out:
            out[jid] = state.strip()
    missing = [j for j in jobs if j not in out]
    if missing:
        SLURM_QUERIES[0] += 1
        for line in _run(["sacct", "-n", "-X", "-P", "-j", ",".join(missing), "-o", "JobID,State"]).splitlines():
            jid, _, state = line.partition("|")
            if jid.strip() in missing and state:
                out[jid.strip()] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return out


def slurm_state(job_id: str) -> str | None:
    """PENDING, RUNNING, ... from squeue, or from sacct once the job has left the queue."""
    return slurm_states([job_id]).get(job_id)


def slurm_end_reason(job_id: str) -> str | None:
    """How Slurm's accounting says a job ended, in words, for a run whose job ended without meshrun recording an
    end (no `completed`, `stopped` or `cancelled`: the whole job cancelled with scancel, its batch script killed,
    its node failed, its time limit reached): the job's state (with who cancelled it), exit code and reason, and
    the batch step's when it differs ("... batch script: FAILED, signal 9"). None when sacct knows nothing."""
    rows = {}
    for line in _run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode,Reason"]).splitlines():
        parts = line.split("|")
        if len(parts) >= 4:
            rows[parts[0].strip()] = [p.strip() for p in parts[1:4]]
    job = rows.get(job_id)
    if job is None:
        return None

    def told(state: str, code: str) -> str:
        rc, _, sig = code.partition(":")
        how = f"signal {sig}" if sig not in ("", "0") else f"exit code {rc}"
        return f"{state}, {how}"

    text = f"Slurm ended job {job_id} as {told(job[0], job[1])}"
    if job[2] and job[2] != "None":
        text += f" (reason: {job[2]})"
    batch = rows.get(f"{job_id}.batch")
    if batch is not None and (batch[0].split()[0], batch[1]) != (job[0].split()[0], job[1]):
        text += f"; its batch script: {told(batch[0], batch[1])}"
    return text + "; meshrun recorded no end of the run"
