"""The Slurm jobs the running test submitted: noted from the launcher's "submitted Slurm job ID" lines, cancelled
by tests/conftest.py when that test fails (tests/helpers/slurm.py's meshrun notes them) (its own jobs only: the dev cluster is shared with other runs)."""

from __future__ import annotations

import re
import subprocess

submitted: list[str] = []
"""Job ids (an array's base id stands for all its tasks) noted since the current test began."""


def note(stdout: str) -> None:
    for job in re.findall(r"submitted Slurm job (\d+)", stdout or ""):
        if job not in submitted:
            submitted.append(job)


def cancel(jobs) -> None:
    jobs = [str(j) for j in jobs]
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=60)
