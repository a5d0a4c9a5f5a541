"""meshrun's sweeper and launcher plugins (one module: Hydra's plugin scanner executes every public
module under hydra_plugins, and the sweeper must see the very MeshrunLauncher class it instantiated).

MeshrunSweeper: BasicSweeper's cartesian product. BasicSweeper composes every point once to validate
the batch, then the launcher composes it again (~150 ms each). Here validation builds each point from
the cached group composition (_composer.py), still before any job runs, so a typo in a swept key fails
the whole sweep as before, and hands the built configs to MeshrunLauncher. Any other launcher (e.g. a
submitit one) gets the job overrides and composes as usual.

MeshrunLauncher: BasicLauncher's local, sequential jobs. With slurm_arrays (the default) a Slurm
point only checks and queues itself (the app reads hydra.launcher.slurm_arrays), and the launcher
passes the batch's queued run directories to launcher/slurm/submit.py's submit_arrays, which submits
them as job arrays (or prints their scripts under dry_run=true), then waits for the points with wait=true
(launcher/manage/follow.py follow_points). Every point still runs through
Hydra's run_job contract (_run_job.py: the same steps without its redundant config copies): HydraConfig
(runtime.output_dir, job.num), the per-point output directory, callbacks (on_job_end writes the point's
record for launcher/sweep/summary.py's summary) and the job's return value are as with the basic launcher.
One per-point cost is dropped for action=plan points: the job logging setup (a file handler per point writing an empty <point>/<job>.log); plan points only print.
While a sweep runs, the garbage collector runs less often (_fewer_collections).
"""

import contextlib
import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.meshrun_sweep._composer import CachedComposer
from hydra_plugins.meshrun_sweep._run_job import run_point_job

log = logging.getLogger(__name__)


@dataclass
class MeshrunLauncherConf:
    """hydra/launcher=meshrun."""

    _target_: str = "hydra_plugins.meshrun_sweep.meshrun_sweep.MeshrunLauncher"
    slurm_arrays: bool = True
    """Submit a batch's Slurm points together, as job arrays, after the batch; false: one job per point."""


ConfigStore.instance().store(group="hydra/launcher", name="meshrun", node=MeshrunLauncherConf, provider="meshrun")


def _needs_job_logging(cfg: DictConfig) -> bool:
    """Plan points only print; every other action (train submits, local runs) gets Hydra's job logging."""
    return OmegaConf.select(cfg, "action", default=None) != "plan"


class MeshrunLauncher(Launcher):
    def __init__(self, slurm_arrays: bool = True) -> None:
        super().__init__()
        # The points read it from their config too (hydra.launcher.slurm_arrays): false, none queues.
        self.slurm_arrays = slurm_arrays
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None
        # Set by MeshrunSweeper to share its cache and its prepared points; else made on first launch.
        self.composer: CachedComposer | None = None

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
        runs = self._run_points(job_overrides, initial_job_idx)
        # Slurm points only checked and queued themselves (submit(queue=True)): submit them together now.
        # A point that exits (SystemExit, which run_job does not catch) ends the sweep before this line.
        queued = [
            ret.return_value
            for ret in runs
            if ret.status == JobStatus.COMPLETED
            and isinstance(ret.return_value, dict)
            and ret.return_value.get("status") == "queued"
        ]
        if queued and self.slurm_arrays:
            from launcher.manage.follow import follow_points
            from launcher.slurm.submit import submit_arrays

            folder = str(Path(str(self.config.hydra.sweep.dir)).absolute() / "submitit")
            updates = submit_arrays([point["run_dir"] for point in queued], folder)
            follow_points(updates, folder)  # the points with wait=true: until each has ended
            for point in queued:
                point.update(updates[point["run_dir"]])
        return runs

    def _run_points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        assert self.composer is not None
        runs: list[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.composer.take(overrides)
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            job_logging = _needs_job_logging(sweep_config)
            ret = run_point_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=sweep_config,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
                configure_logging=job_logging,
                owned=True,
            )
            runs.append(ret)
            if job_logging:
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


@dataclass
class MeshrunSweeperConf:
    """hydra/sweeper=meshrun: the same options as hydra/sweeper=basic."""

    _target_: str = "hydra_plugins.meshrun_sweep.meshrun_sweep.MeshrunSweeper"
    # Points per launcher batch; None runs the whole sweep as one batch.
    max_batch_size: int | None = None
    # Extra sweep overrides, key -> "v1,v2", as for the basic sweeper.
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="meshrun", node=MeshrunSweeperConf, provider="meshrun")


@contextlib.contextmanager
def _fewer_collections(gen0: int = 20_000):
    """Collect garbage less often while the sweep builds and runs its points.

    Every point creates tens of thousands of OmegaConf nodes (its config, overrides, the typed copy), so
    with Python's default threshold (a young collection every 700 new objects) a 64-point plan sweep spent
    ~10 % of its time in the collector, mostly re-scanning objects that live until the end anyway (Hydra's
    state, imported modules, the cached compositions). Those are frozen out of the collector's view, and
    a young collection runs every `gen0` new objects instead: the points' cyclic garbage (nodes point
    to their parents) is still collected, in fewer passes; memory stays bounded by the threshold."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(gen0, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


class MeshrunSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        with _fewer_collections():
            return super().sweep(arguments)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.composer = CachedComposer(hydra_context.config_loader, config)
        if isinstance(self.launcher, MeshrunLauncher):
            self.launcher.composer = self.composer

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        keep = isinstance(self.launcher, MeshrunLauncher)
        for overrides in batch:
            self.composer.prepare(overrides, keep=keep)
