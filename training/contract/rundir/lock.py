"""One owner per run directory: the lock file run_dir/.meshrun.lock (pure Python; launcher and ranks).

Two launches on one run.dir would interleave metrics, truncate each other's logs and delete each other's
saves, so a run holds this lock for its whole life:

- locally, the launcher takes an exclusive `flock` on the file and its ranks inherit the open file
  (pass_fds), so the kernel keeps the lock while any of them lives and drops it when the last one dies;
- on Slurm, the file names the job ("holder": {"kind": "slurm", "job_id": ...}); the job holds the run for
  as long as squeue knows it (pending, running, requeued); a resubmission hands the lock to the new job.

A second launch exits 2 naming the holder. A lock whose holder is gone (no process holds the flock and the
named job, if any, has left the queue) is taken over and the takeover recorded (`lock_taken_over` in
events.jsonl). The file is never deleted while it may be shared (deleting it would let a third process lock
a new file while a second still holds the old one); only a run directory that holds nothing but the lock
(a launch rejected before it wrote anything) is removed again.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.contract.rundir.events import append_event
from training.contract.rundir.files import open_regular, open_rw
from training.contract.rundir.paths import LOCK_FILE, RunPaths

TOKEN_ENV = "MESHRUN_LOCK_TOKEN"
"""Set in every rank a local launcher starts: the token of the lock its launcher holds."""

# The launcher passes launcher/slurm/queries.py's job_alive: job id -> whether Slurm still knows the job
# (True/False), or None when Slurm cannot say. Ranks and unit tests without Slurm leave it unset.
JobAlive = Callable[[str], bool | None]


class RunLocked(RuntimeError):
    """The run directory belongs to another live run; the message names it and the fix."""


def lock_path(run_dir: str) -> str:
    return RunPaths(run_dir).lock


def describe(holder: dict[str, Any]) -> str:
    if holder.get("kind") == "slurm":
        return f"Slurm job {holder.get('job_id')}"
    return f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('what', 'meshrun')})"


def read_holder(run_dir: str) -> dict[str, Any]:
    """The lock file's record ({} when absent, empty or torn)."""
    try:
        with open_regular(lock_path(run_dir)) as f:  # a FIFO planted as the lock must not block plan or status
            data = json.loads(f.read(1 << 20) or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _open_private(run_dir: str) -> int:
    """The lock file opened read-write (created when absent), readable by its owner only: anyone who can open it
    can flock it, and a shared flock taken by another user on a read-only descriptor would block every launch.
    A lock file of an older meshrun (0644 under umask 022) is made private the first time it is opened."""
    fd = open_rw(lock_path(run_dir))  # never through a link: a linked lock file's target would be truncated
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
    except OSError:
        pass  # another user's file, or a file system without modes: the flock below still decides
    return fd


def flock_holders(path: str) -> dict[int, int | None]:
    """The processes that hold a flock on `path` (pid -> their uid, None when unreadable), from /proc/locks."""
    try:
        st = os.stat(path, follow_symlinks=False)
        with open("/proc/locks") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return {}
    holders: dict[int, int | None] = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[4] == "->":
            continue
        try:
            pid, inode = int(parts[4]), int(parts[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if inode == st.st_ino:
            try:
                holders[pid] = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                holders[pid] = None
    return holders


def _foreign_holder_note(run_dir: str) -> str:
    """For a flock held by a process of another user (who could open the file): that, not a dead launcher."""
    for pid, uid in flock_holders(lock_path(run_dir)).items():
        if uid is not None and uid != os.geteuid():
            return (
                f" (the lock is held by pid {pid} of another user, uid {uid}, not by a meshrun run of yours: "
                f"ask them to stop it, or make the run directory private: chmod 700 {run_dir})"
            )
    return ""


def _write(fd: int, holder: dict[str, Any]) -> None:
    data = (json.dumps(holder, sort_keys=True) + "\n").encode()
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, data)
    # A local holder's record needs no fsync: the flock is the lock, and a record lost or torn by a crash
    # reads as free or as a holder whose process is gone (_stale_reason), as it would after the crash
    # anyway. A Slurm holder's record is the lock itself between attempts, so it goes to disk (an fsync
    # costs up to tens of ms on a busy disk; a 64-point plan sweep took two per point).
    if holder.get("kind") == "slurm":
        os.fsync(fd)


def _message(run_dir: str, holder: dict[str, Any], extra: str = "") -> str:
    fix = (
        f"wait for it to end or cancel it (scancel {holder.get('job_id')})"
        if holder.get("kind") == "slurm"
        else "wait for it to end or stop it"
    )
    return (
        f"run.dir={run_dir} is in use by {describe(holder)}{extra}: two runs on one directory would mix their "
        f"metrics and checkpoints. {fix}, or choose another run.dir. Nothing was written. (The lock is "
        f"{lock_path(run_dir)}; remove it only when you are sure that run has ended.)"
    )


@dataclass
class RunLock:
    """A lock this process holds (its flock) on one run directory."""

    run_dir: str
    fd: int
    token: str
    created_dir: bool
    holder: dict[str, Any]

    def hand_to_job(self, job_id: str) -> None:
        """After sbatch: the Slurm job holds the run from now on (this process lets go of the flock)."""
        self.holder = {
            "kind": "slurm",
            "job_id": str(job_id),
            "token": self.token,
            "since": time.time(),
            "host": socket.gethostname(),
            "submitted_by_pid": os.getpid(),
        }
        _write(self.fd, self.holder)
        self._close()

    def release(self) -> None:
        """The run has ended (or never started): mark the lock free; a directory that holds only the lock
        (created by this launch, rejected before it wrote anything) is removed again."""
        if self.fd < 0:
            return
        if self.created_dir and set(os.listdir(self.run_dir)) <= {LOCK_FILE}:
            os.unlink(lock_path(self.run_dir))
            self._close()
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass
            return
        _write(self.fd, {**self.holder, "released": time.time()})
        self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops this process's share of the flock
            self.fd = -1
        _HELD.pop(os.path.abspath(self.run_dir), None)


_HELD: dict[str, RunLock] = {}


def held(run_dir: str) -> RunLock | None:
    """The lock this process holds on run_dir, if any (the launch code hands it on or releases it)."""
    return _HELD.get(os.path.abspath(run_dir))


def _job_alive(holder: dict[str, Any], job_alive: JobAlive | None) -> bool | None:
    """Slurm's answer for a job holder: True/False, or None when there is no job or Slurm cannot say."""
    if holder.get("kind") != "slurm" or job_alive is None:
        return None
    return job_alive(str(holder.get("job_id")))


def _stale_reason(holder: dict[str, Any], alive: bool | None) -> str | None:
    """Why a holder no longer holds the run (None: it still does, or cannot be known not to); alive is
    _job_alive's answer for it."""
    if not holder or holder.get("released"):
        return None if holder else "empty"
    if holder.get("kind") != "slurm":
        return "its process is gone"  # nobody holds the flock (checked before this is asked)
    if alive is False:
        return "the job has left Slurm's queue"
    return None


def _dead_launcher_note(holder: dict[str, Any]) -> str:
    """For a local holder on this host whose launcher process is gone while its ranks still hold the flock."""
    pid = holder.get("pid")
    if holder.get("kind") != "local" or holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return ""
    try:
        os.kill(pid, 0)
        return ""
    except ProcessLookupError:
        return (
            " (that launcher has died; its ranks still hold the run while they save a checkpoint and stop "
            "on their own: run again in a moment)"
        )
    except OSError:
        return ""


def acquire(
    run_dir: str,
    what: str = "meshrun",
    job_alive: JobAlive | None = None,
    event_fields: dict[str, Any] | None = None,
) -> RunLock:
    """Take the run directory for this process (creating it); RunLocked naming the holder when it is taken.

    job_alive answers for a Slurm holder; without it (or when Slurm cannot answer) a lock that names a job
    is treated as held: a cautious operator would rather be told than have two jobs share a directory."""
    run_dir = os.path.abspath(run_dir)
    created = not os.path.isdir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    fd = _open_private(run_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = read_holder(run_dir)
        note = _foreign_holder_note(run_dir) or _dead_launcher_note(holder)
        raise RunLocked(_message(run_dir, holder, note)) from None
    previous = read_holder(run_dir)
    if previous and not previous.get("released"):
        alive = _job_alive(previous, job_alive)
        reason = _stale_reason(previous, alive)
        if reason is None:
            os.close(fd)
            # Slurm was not asked (no job_alive) or could not answer: say so, the job may well have ended.
            extra = " (Slurm could not be asked whether it still runs)" if alive is None else ""
            raise RunLocked(_message(run_dir, previous, extra))
        append_event(
            run_dir, "lock_taken_over", previous_holder=describe(previous), reason=reason, **(event_fields or {})
        )
    holder = {
        "kind": "local",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "what": what,
        "token": uuid.uuid4().hex,
        "since": time.time(),
    }
    _write(fd, holder)
    lock = RunLock(run_dir, fd, holder["token"], created, holder)
    _HELD[run_dir] = lock
    return lock


def check_rank(run_dir: str, job_id: str | None, env: dict[str, str] | None = None) -> str | None:
    """A rank's check before it touches run_dir: None when the run directory belongs to this rank's job
    (its launcher's token, or this Slurm job), else the message to exit 2 with. A rank started by hand
    (no token, no Slurm job) shares the flock with its peers so that a launcher cannot start beside it."""
    env = dict(os.environ if env is None else env)
    holder = read_holder(run_dir)
    token = env.get(TOKEN_ENV)
    if token:
        return None if holder.get("token") == token else _message(run_dir, holder, " (not this rank's launcher)")
    if job_id and holder.get("kind") == "slurm":
        return None if str(holder.get("job_id")) == str(job_id) else _message(run_dir, holder)
    if not os.path.exists(lock_path(run_dir)):
        return None
    fd = os.open(lock_path(run_dir), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return _message(run_dir, holder)
    _MANUAL_FDS.append(fd)  # kept open for the life of this rank
    if holder.get("kind") == "slurm" and not holder.get("released"):
        return _message(run_dir, holder, " (this rank is not part of that job)")
    return None


_MANUAL_FDS: list = []


# ---------------------------------------------------------------- Slurm: the job holds the run between attempts
def _locked_fd(run_dir: str, wait_s: float = 10.0) -> int | None:
    """The lock file, flocked for a short update (None when a local launcher holds it all along)."""
    fd = _open_private(run_dir)
    deadline = time.time() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.time() > deadline:
                os.close(fd)
                return None
            time.sleep(0.2)


def claim_for_job(run_dir: str, job_id: str, job_alive: JobAlive | None = None, wait_s: float = 60.0) -> str:
    """An attempt's prologue: "" when run_dir is this job's (taking over a lock whose holder is gone, with an
    event), else the message to stop the attempt with. A lock naming a job that still runs is waited on for
    wait_s: a failed attempt's epilogue names its resubmission only once sbatch has answered."""
    deadline = time.time() + wait_s
    while True:
        fd = _locked_fd(run_dir)
        if fd is None:
            return _message(run_dir, read_holder(run_dir), _foreign_holder_note(run_dir))
        try:
            holder = read_holder(run_dir)
            if holder.get("kind") == "slurm" and str(holder.get("job_id")) == str(job_id):
                return ""
            reason = (
                _stale_reason(holder, _job_alive(holder, job_alive)) if holder and not holder.get("released") else None
            )
            if not holder or holder.get("released") or reason is not None:
                if holder and reason is not None:
                    append_event(run_dir, "lock_taken_over", previous_holder=describe(holder), reason=reason)
                _write(
                    fd,
                    {
                        "kind": "slurm",
                        "job_id": str(job_id),
                        "since": time.time(),
                        "token": holder.get("token", uuid.uuid4().hex),
                    },
                )
                return ""
        finally:
            os.close(fd)
        if time.time() > deadline:
            return _message(run_dir, holder)
        time.sleep(1.0)


def set_job_holder(run_dir: str, job_id: str, **fields: Any) -> None:
    """Hand the run to another job (a resubmission), or mark the holding job's state (fields)."""
    fd = _locked_fd(run_dir)
    if fd is None:
        return
    try:
        holder = read_holder(run_dir)
        _write(
            fd,
            {
                "kind": "slurm",
                "job_id": str(job_id),
                "since": time.time(),
                "token": holder.get("token", uuid.uuid4().hex),
                **fields,
            },
        )
    finally:
        os.close(fd)


def release_job(run_dir: str, job_id: str) -> None:
    """The run has ended in this job (completed, stopped): the directory is free for the next launch."""
    fd = _locked_fd(run_dir)
    if fd is None:
        return
    try:
        holder = read_holder(run_dir)
        if holder.get("kind") == "slurm" and str(holder.get("job_id")) == str(job_id):
            _write(fd, {**holder, "released": time.time()})
    finally:
        os.close(fd)
