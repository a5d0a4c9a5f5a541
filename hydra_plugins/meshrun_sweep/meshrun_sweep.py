"""meshrun's sweeper and launcher plugins (one module: Hydra's plugin scanner executes every public
module under hydra_plugins, and the sweeper must see the very MeshrunLauncher class it instantiated).

MeshrunSweeper: BasicSweeper's cartesian product. BasicSweeper composes every point once to validate
the batch, then the launcher composes it again (~150 ms each). Here validation builds each point from
the cached group composition (_composer.py), still before any job runs, so a typo in a swept key fails
the whole sweep as before, and hands the built configs to MeshrunLauncher. Any other launcher (e.g. a
submitit one) gets the job overrides and composes as usual.

MeshrunLauncher: BasicLauncher's local, sequential jobs (Slurm points are queued and submitted at
the end of the batch as job arrays: launcher/slurm/submit.py's array_batch). Every point still runs through Hydra's
run_job: HydraConfig (runtime.output_dir, job.num), the per-point output directory, callbacks
(on_job_end feeds launcher/sweep.py's summary) and the job's return value are as with the basic
launcher. One per-point cost is dropped for action=plan points: the job logging setup (a file handler
per point writing an empty <point>/<job>.log); plan points only print.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.meshrun_sweep._composer import CachedComposer

log = logging.getLogger(__name__)


@dataclass
class MeshrunLauncherConf:
    """hydra/launcher=meshrun (no options)."""

    _target_: str = "hydra_plugins.meshrun_sweep.meshrun_sweep.MeshrunLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="meshrun", node=MeshrunLauncherConf, provider="meshrun")


def _needs_job_logging(cfg: DictConfig) -> bool:
    """Plan points only print; every other action (train submits, local runs) gets Hydra's job logging."""
    return OmegaConf.select(cfg, "action", default=None) != "plan"


class MeshrunLauncher(Launcher):
    def __init__(self) -> None:
        super().__init__()
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        # Set by MeshrunSweeper to share its cache and its prepared points; else made on first launch.
        self.composer: Optional[CachedComposer] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        if self.composer is None:
            self.composer = CachedComposer(self.hydra_context.config_loader, self.config)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally")
        # Slurm points are only checked and queued while the batch is open, then submitted as job arrays.
        from launcher.slurm.submit import array_batch

        with array_batch(folder=str(Path(str(self.config.hydra.sweep.dir)).absolute() / "submitit")):
            return self._run_points(job_overrides, initial_job_idx)

    def _run_points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        assert self.composer is not None
        runs: List[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.composer.take(overrides)
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            job_logging = _needs_job_logging(sweep_config)
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir",
                          configure_logging=job_logging)
            runs.append(ret)
            if job_logging:
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


@dataclass
class MeshrunSweeperConf:
    """hydra/sweeper=meshrun: the same options as hydra/sweeper=basic."""

    _target_: str = "hydra_plugins.meshrun_sweep.meshrun_sweep.MeshrunSweeper"
    # Points per launcher batch; None runs the whole sweep as one batch.
    max_batch_size: Optional[int] = None
    # Extra sweep overrides, key -> "v1,v2", as for the basic sweeper.
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="meshrun", node=MeshrunSweeperConf, provider="meshrun")


class MeshrunSweeper(BasicSweeper):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.composer = CachedComposer(hydra_context.config_loader, config)
        if isinstance(self.launcher, MeshrunLauncher):
            self.launcher.composer = self.composer

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        keep = isinstance(self.launcher, MeshrunLauncher)
        for overrides in batch:
            self.composer.prepare(overrides, keep=keep)
