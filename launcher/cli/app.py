"""The `meshrun` Hydra app: compose the config, then run the action (the table: launcher/cli/actions.py)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from launcher.cli.actions import BY_NAME, ActionSpec
from launcher.cli.options import AppConfig, with_options
from launcher.cli.schema import register
from training.contract.config import Config
from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID

register()

# Set once the task function runs: Hydra exits 1 on a composition error (typo, wrong type,
# unknown preset) before that, and the CLI turns such exits into the contract's exit code 2.
_task_started = False


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _launcher_submits_arrays() -> bool:
    """Whether the sweep's launcher submits its batch's Slurm points itself, as job arrays (meshrun's,
    hydra_plugins/meshrun_sweep: hydra.launcher.slurm_arrays); other launchers leave each point to submit."""
    return _is_multirun() and bool(OmegaConf.select(HydraConfig.get(), "launcher.slurm_arrays", default=False))


def _run_dir(cfg: Config) -> str:
    """run.dir, or in a multirun sweep the point's own directory under the sweep directory."""
    return HydraConfig.get().runtime.output_dir if _is_multirun() else cfg.run.dir


# Through the installed package, not a path next to the source: a wheel has no conf/ beside launcher/
# (pyproject.toml installs conf/ as the package meshrun_conf).
_CONF_DIR = "pkg://meshrun_conf"


@hydra.main(version_base=None, config_path=_CONF_DIR, config_name="config")
def hydra_main(dcfg: DictConfig):
    global _task_started
    _task_started = True
    from launcher.cli.unknown_keys import message, unknown_keys

    unknown = unknown_keys(dcfg)
    if unknown:  # `+group.key=v` adds a key the dataclasses would drop silently (launcher/cli/unknown_keys.py)
        print(f"meshrun: invalid configuration; nothing was launched. {message(unknown)}.", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    cfg: AppConfig = OmegaConf.to_object(dcfg)
    return run_action(cfg)


def run_action(cfg: AppConfig):
    """The action's config resolved in the table's fixed order (launcher/cli/actions.py), then its function."""
    spec = BY_NAME[str(cfg.action)]
    if spec.config == "composed":
        return _function(spec)(cfg, None)
    run_dir = os.path.abspath(_run_dir(cfg))
    if not _is_multirun():
        from launcher.manage.latest import resolve_latest  # run.dir=runs/latest: the run the link names

        run_dir = resolve_latest(run_dir)
        if plan_only(cfg) and not _run_dir_given():
            run_dir = plans_dir(run_dir)
    lock = None
    if spec.locks:
        # One owner per run directory, checked before anything is read or written there (launcher/launch/claim.py).
        from launcher.launch.claim import claim_run_dir

        lock, refusal = claim_run_dir(run_dir, multirun=_is_multirun())
        if refusal is not None:
            return refusal
    try:
        if spec.config == "launch":
            cfg = _launch_config(cfg, run_dir)
        cfg.run.dir = run_dir
        return _function(spec)(cfg, run_dir)
    finally:
        if lock is not None:
            lock.release()  # a no-op once a Slurm job holds it


PLANS_FOLDER = ".plans"
"""Where a plan-only command without run.dir writes (runs/.plans/<timestamp>): not a run, so `action=runs` does not
list it and runs/ holds launched runs only."""


def plan_only(cfg: Config) -> bool:
    """Whether the command launches nothing: action=plan, recommend, preflight, or a dry run."""
    return str(cfg.action) in ("plan", "recommend", "preflight") or (str(cfg.action) == "train" and bool(cfg.dry_run))


def _run_dir_given() -> bool:
    """Whether the command line names run.dir (else it is the timestamped default)."""
    return any(o.split("=", 1)[0].lstrip("+~") == "run.dir" for o in HydraConfig.get().overrides.task)


def plans_dir(default_run_dir: str) -> str:
    """runs/<timestamp> -> runs/.plans/<timestamp>: a plan-only command's files, apart from the runs."""
    return os.path.join(os.path.dirname(default_run_dir), PLANS_FOLDER, os.path.basename(default_run_dir))


def _function(spec: ActionSpec) -> Callable[[Config, str | None], Any]:
    return getattr(importlib.import_module(spec.module), spec.function)


def _launch_config(cfg: AppConfig, run_dir: str) -> AppConfig:
    """A launch's config: an existing run's saved config under the new command line, the indexed datasets'
    paths and vocabulary, then train.init_from's model (config.json's model wins over the data's vocabulary)."""
    if not _is_multirun():
        from launcher.manage.resume import resume_config

        # The saved run is a Config (config.json keeps no command-line option): this invocation's options return.
        cfg = with_options(resume_config(run_dir, cfg, HydraConfig.get().overrides.task), cfg)
    if cfg.data.kind == "indexed":
        from launcher.data.datasets import resolve_indexed

        resolve_indexed(cfg, HydraConfig.get().overrides.task)
    if cfg.train.init_from:
        from launcher.hf.init_from import apply_init_from

        cfg = with_options(apply_init_from(cfg, HydraConfig.get().overrides.task, run_dir), cfg)
    return cfg


def start(cfg: Config, run_dir: str):
    """action=train and action=plan: validate and plan (the gate every launch passes), then launch through the
    cluster kind's backend (launcher/launch/backend.py); action=plan stops after the plan. The config arrives
    resolved (launcher/cli/actions.py: launch)."""
    if cfg.action == "train" and cfg.train.wandb:
        from training.observe.wandb_sink import wandb_problem  # no torch: importlib only

        if wandb_problem():
            print(f"error: {wandb_problem()}; nothing was launched.", file=sys.stderr)
            raise SystemExit(EXIT_INVALID)
    from launcher.launch.gate import plan_or_reject

    auto = None
    if cfg.parallel.auto:  # parallel=auto: the recommender fills what the command line left open
        from launcher.recommend.auto import announce, choose

        choice = choose(cfg, HydraConfig.get().overrides.task, multirun=_is_multirun())
        if choice is not None and choice.chosen is None:  # a sweep point at which nothing fits
            message = f"parallel=auto: no layout fits ({choice.searched} searched)"
            print(f"[no_fit] model={cfg.model.name}: {message}", file=sys.stderr)
            return {"status": "no_fit", "errors": [f"error: parallel: {message}"], "warnings": [], "issues": []}
        if choice is not None:
            cfg = choice.cfg
            cfg.run.dir = run_dir
            if not _is_multirun():
                announce(choice)
            auto = choice.to_json()
    from launcher.recommend.auto import name_the_nodes

    result = plan_or_reject(cfg, run_dir, multirun=_is_multirun(), auto=auto, no_fit_advice=name_the_nodes)
    if result.get("status") == "ok" and not _is_multirun() and cfg.action == "train" and not cfg.dry_run:
        from launcher.manage.latest import point_latest

        # runs/latest names the newest run (launcher/manage/latest.py); a plan or a dry run is not one.
        point_latest(run_dir)
    if result.get("status") != "ok" or cfg.action == "plan":
        return result
    from launcher.launch.backend import backend_for

    backend = backend_for(cfg.cluster.kind)
    result = backend.submit(cfg, run_dir, result, multirun=_is_multirun(), queue=_launcher_submits_arrays())
    if cfg.wait and not _is_multirun() and result.get("status") == "submitted":
        from launcher.manage.follow import follow_run

        follow_run(result)  # until the run ends: its final status, or EXIT_FAILED
    return result


def _presets(group: str) -> list[str]:
    """The presets of a config group, as Hydra sees them (the installed conf tree)."""
    loader = GlobalHydra.instance().config_loader()
    return sorted(loader.get_group_options(group))


from launcher.cli.early import _reject_control_characters, _version  # noqa: E402 (no Hydra there)


def cli() -> None:
    """Console entry point: Hydra's composition errors exit with 2 like every other invalid input."""
    from launcher.cli.secret_args import hide_secret_args

    if sys.argv[1:] == ["--version"]:  # meshrun's, not Hydra's (Hydra's --version names Hydra)
        print(f"meshrun {_version()}")
        raise SystemExit(0)
    _reject_control_characters(sys.argv[1:])
    from launcher.cli.precheck import problem

    found = problem(sys.argv[1:])  # meshrun's diagnosis first and alone (launcher/cli/precheck.py)
    if found:
        print(f"meshrun: invalid configuration; nothing was launched. {found}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    # Before Hydra copies the overrides into its logs and files (launcher/cli/secret_args.py).
    sys.argv[1:] = hide_secret_args(sys.argv[1:])
    try:
        hydra_main()
    except SystemExit as exc:
        if exc.code == EXIT_FAILED and not _task_started:
            # Hydra's own hint ("use +key=value to append") is wrong for typed configs: keys are fixed.
            print(
                "meshrun: invalid configuration; nothing was launched. Check the key's spelling and type "
                "(`meshrun action=keys` lists every key with its type and documentation; `meshrun --cfg job` prints "
                "the composed config) and that presets exist under conf/<group>/. Only dict fields such as "
                "cluster.env take new keys, with a leading '+'.",
                file=sys.stderr,
            )
            from launcher.cli.unknown_keys import argv_keys, message, quoting_hint

            hint = quoting_hint(sys.argv[1:])
            if hint:
                print(f"meshrun: {hint}", file=sys.stderr)

            unknown = argv_keys(sys.argv[1:])
            if unknown:
                print(f"meshrun: {message(unknown)}.", file=sys.stderr)
            raise SystemExit(EXIT_INVALID) from None
        raise
