"""Claiming a run directory before a launch reads or writes it: its lock taken (one owner per run.dir), or the
reason it cannot be (a control character in the path, a directory meshrun did not create, another live run)."""

from __future__ import annotations

import sys

from launcher.slurm.queries import job_alive
from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.config_files import foreign_problem, path_problem
from training.contract.rundir.lock import RunLocked, acquire


def claim_run_dir(run_dir: str, multirun: bool = False):
    """Before a launch reads or writes run_dir: (the lock now held, None), or for a sweep point that cannot
    have it (None, the point's "invalid" result); a single run exits 2 with the reason (a control character
    in the path, or another live run holding the directory, named)."""
    problem = path_problem(run_dir) or foreign_problem(run_dir)
    if not problem:
        try:
            return acquire(run_dir, what="meshrun launcher", job_alive=job_alive), None
        except RunLocked as exc:
            problem = str(exc)
        except OSError as exc:  # a read-only or foreign file system, a link planted since the check above
            problem = (
                f"run.dir={run_dir} cannot be written ({exc.strerror or exc}): make it writable or choose "
                f"another run.dir; nothing was written"
            )
    if multirun:
        print(f"[invalid] {problem}", file=sys.stderr)
        return None, {"status": "invalid", "errors": [f"error: {problem}"], "warnings": []}
    print(f"meshrun: {problem}", file=sys.stderr)
    raise SystemExit(EXIT_INVALID)
