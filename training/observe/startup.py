"""Where a rank's start-up time goes: wall-clock marks from process start to the first step.

A resumed attempt is only as fast as its slowest phase, and the phases belong to different programs
(Slurm, srun, the task wrapper, Python's imports, the rendezvous, the preflight, the checkpoint load), so
the engine records one timeline per attempt: rank 0 writes it as the `startup` event after its first step
(docs/USER_CONTRACTS.md), and bench/bench_slurm.py lines it up with the job's own events.

Marks are absolute times (time.time(), seconds since the epoch) so that they can be compared with the
events other processes write; `task_start` comes from the Slurm task wrapper (MESHRUN_TASK_START, set by
launcher/slurm/rank_task.py) and `process_start` from the kernel's record of this process.
"""

from __future__ import annotations

import os
import resource
import time

from training.contract.rundir.events import append_event
from training.observe.observer import StepObserver, StepRecord

TASK_START_ENV = "MESHRUN_TASK_START"
"""The Slurm task wrapper's own process start time, handed to the engine it starts."""

_MARKS: dict[str, float] = {}


def process_start_time(pid: str = "self") -> float | None:
    """When the process was created (epoch seconds), from /proc: before the interpreter loaded anything,
    which a timestamp taken in Python cannot see. None where /proc has no such record."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Field 22 (starttime, in clock ticks after boot); the command name (field 2) may hold spaces.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Measured back from now: /proc/stat's boot time is whole seconds, /proc/uptime has hundredths.
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark(name: str) -> None:
    """Record that phase `name` ended now (the first mark of a name wins: a phase ends once)."""
    _MARKS.setdefault(name, time.time())


def cpu_seconds() -> float:
    """CPU time (user + system) this process has used so far: start-up on a machine whose cores the ranks
    share is bounded by the ranks' summed CPU time, whatever the order of phases."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 3)


def timeline() -> dict[str, float]:
    """Every mark so far, with the process's start (and the task wrapper's, under Slurm), in time order."""
    marks: dict[str, float] = {}
    task = os.environ.get(TASK_START_ENV)
    if task:
        try:
            marks["task_start"] = float(task)
        except ValueError:
            pass
    start = process_start_time()
    if start is not None:
        marks["process_start"] = start
    marks.update(_MARKS)
    return {k: round(v, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}


class StartupEvent(StepObserver):
    """The loop's observer (observe/observer.py) that ends the timeline: after this attempt's first step, rank 0
    marks `first_step` and writes the timeline as the `startup` event."""

    def __init__(self, run_dir: str, is_logger: bool):
        self.run_dir, self.is_logger = run_dir, is_logger

    def after_step(self, step: int, record: StepRecord) -> None:
        if record.first and self.is_logger:
            mark("first_step")
            append_event(self.run_dir, "startup", step=step, marks=timeline(), cpu_s=cpu_seconds())
