"""The `meshrun` Hydra app: compose the config, then dispatch on `action`."""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from launcher.schema import register
from training.config import Config
from training.exit_codes import EXIT_INVALID

register()

# Set once the task function runs: Hydra exits 1 on a composition error (typo, wrong type,
# unknown preset) before that, and the CLI turns such exits into the contract's exit code 2.
_task_started = False


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_dir(cfg: Config) -> str:
    """run.dir, or in a multirun sweep the point's own directory under the sweep directory."""
    return HydraConfig.get().runtime.output_dir if _is_multirun() else cfg.run.dir


# An absolute path: run as `python -m launcher` or the console script, Hydra would otherwise look for
# a Python package named `conf`.
_CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(version_base=None, config_path=_CONF_DIR, config_name="config")
def hydra_main(dcfg: DictConfig):
    global _task_started
    _task_started = True
    cfg: Config = OmegaConf.to_object(dcfg)
    run_dir = os.path.abspath(_run_dir(cfg))
    cfg.run.dir = run_dir
    if cfg.action == "status":
        from launcher.status import print_status

        return print_status(run_dir)
    if cfg.action == "preflight":
        from launcher.preflight import run_preflight

        return run_preflight(cfg, run_dir)
    if cfg.action not in ("plan", "train"):
        print(f"error: unknown action={cfg.action!r}; use train, plan, status or preflight", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)

    from launcher.planning import plan_or_reject

    result = plan_or_reject(cfg, run_dir, multirun=_is_multirun())
    if result.get("status") != "ok" or cfg.action == "plan":
        return result
    if cfg.cluster.kind == "slurm":
        from launcher.slurm.submit import submit

        return submit(cfg, run_dir, result, multirun=_is_multirun())
    from launcher.local import launch_local

    return launch_local(cfg, run_dir, result)


def cli() -> None:
    """Console entry point: Hydra's composition errors exit with 2 like every other invalid input."""
    try:
        hydra_main()
    except SystemExit as exc:
        if exc.code == 1 and not _task_started:
            # Hydra's own hint ("use +key=value to append") is wrong for typed configs: keys are fixed.
            print("meshrun: invalid configuration; nothing was launched. Check the key's spelling and type "
                  "(every key is documented in training/config.py; `meshrun --cfg job` prints the composed "
                  "config) and that presets exist under conf/<group>/. Only dict fields such as "
                  "cluster.env take new keys, with a leading '+'.", file=sys.stderr)
            raise SystemExit(EXIT_INVALID) from None
        raise
