"""`meshrun action=preflight`: write config.json, run the preflight ranks through the cluster kind's backend
(launcher/launch/backend.py: launcher/launch/preflight.py's local processes or Slurm job), print the verdict from
run_dir/preflight.json; a bad node makes it exit with EXIT_NODE_BAD, nothing bad with EXIT_OK."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from launcher.launch.backend import backend_for
from training.contract.config import Config
from training.contract.rundir.config_files import write_config
from training.contract.rundir.paths import RunPaths


def run_preflight(cfg: Config, run_dir: str) -> dict[str, Any]:
    """meshrun action=preflight: write config.json, run the ranks, print the verdict; exits EXIT_NODE_BAD
    on a bad node."""
    write_config(cfg, run_dir)
    t = time.time()
    backend = backend_for(cfg.cluster.kind)
    code, result = backend.preflight(cfg, run_dir)
    path = RunPaths(run_dir).preflight
    result.update(exit_code=code, elapsed_s=round(time.time() - t, 2))
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        result.update(status=data["status"], bad_nodes=data["bad_nodes"])
        if not backend.facts.ranks_here:  # rank 0 printed it into the job's log; show it here too
            from training.preflight.report import format_table

            print(format_table(data))
        print(f"meshrun: preflight {data['status']} in {result['elapsed_s']} s; report: {path}", file=sys.stderr)
    if code:
        raise SystemExit(code)
    return result
