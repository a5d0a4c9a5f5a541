"""action=train and action=plan: validate and plan (the gate every launch passes), then launch here or submit to
Slurm; action=plan stops after the plan. The config arrives resolved (training/contract/actions.py: launch)."""

from __future__ import annotations

import sys

from launcher.cli.context import is_multirun, launcher_submits_arrays
from training.contract.config import Config
from training.contract.exit_codes import EXIT_INVALID


def start(cfg: Config, run_dir: str):
    if cfg.action == "train" and cfg.train.wandb:
        from training.observe.wandb_sink import wandb_problem  # no torch: importlib only

        if wandb_problem():
            print(f"error: {wandb_problem()}; nothing was launched.", file=sys.stderr)
            raise SystemExit(EXIT_INVALID)
    from launcher.planning.gate import plan_or_reject

    result = plan_or_reject(cfg, run_dir, multirun=is_multirun())
    if result.get("status") == "ok" and not is_multirun():
        from launcher.manage.latest import point_latest

        point_latest(run_dir)  # runs/latest names the newest run (launcher/manage/latest.py)
    if result.get("status") != "ok" or cfg.action == "plan":
        return result
    if cfg.cluster.kind == "slurm":
        from launcher.slurm.submit import submit

        return submit(cfg, run_dir, result, multirun=is_multirun(), queue=launcher_submits_arrays())
    from launcher.launch.local import launch_local

    return launch_local(cfg, run_dir)
