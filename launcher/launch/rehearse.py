"""`meshrun action=rehearse`: the configured layout's every rank (or, beyond 256 ranks, representatives) run by
the engine's own code on the meta device under torch's fake process group, here, with no GPU and nothing
launched; its collectives checked for matching, deadlock under NCCL's rules and device, its memory against the
plan (docs/REHEARSAL.md).

No torch here: the plan is made as for `train` (the same gate, plan.json and config.json written), then
`python -m training.rehearse RUN_DIR` runs the ranks and writes RUN_DIR/rehearsal.json; its exit code is this
action's (training/contract/exit_codes.py: 0 all checks hold, EXIT_REHEARSAL_DEFECT a defect, EXIT_FAILED a rank
the engine could not run)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from launcher.ranks.processes import rank_process_env
from training.contract.config import Config

REHEARSE_MODULE = "training.rehearse"


def rehearse_argv(run_dir: str) -> list:
    """The command that rehearses a run directory (its config.json and plan.json)."""
    return [sys.executable, "-m", REHEARSE_MODULE, run_dir]


def run_rehearse(cfg: Config, run_dir: str) -> dict[str, Any]:
    """Plan (the gate every launch passes; writes plan.json and config.json), then rehearse; exits with the
    rehearsal's code when it is not 0."""
    from launcher.launch.gate import plan_or_reject

    result = plan_or_reject(cfg, run_dir)
    if result.get("status") != "ok":
        return result
    # One thread per worker process: the rehearsal runs as many workers as there are cores.
    env = rank_process_env({}, {}, threads=1)
    code = subprocess.run(rehearse_argv(run_dir), env=env).returncode
    out: dict[str, Any] = {
        "status": "ok" if code == 0 else "defect",
        "exit_code": code,
        "rehearsal": os.path.join(run_dir, "rehearsal.json"),
    }
    if code:
        raise SystemExit(code)
    return out
