"""What Hydra knows about this command that the actions need: a sweep or a single run, the sweep launcher's
job arrays, the command line's overrides."""

from __future__ import annotations

from typing import List

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf


def is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def launcher_submits_arrays() -> bool:
    """Whether the sweep's launcher submits its batch's Slurm points itself, as job arrays (meshrun's,
    hydra_plugins/meshrun_sweep: hydra.launcher.slurm_arrays); other launchers leave each point to submit."""
    return is_multirun() and bool(OmegaConf.select(HydraConfig.get(), "launcher.slurm_arrays", default=False))


def task_overrides() -> List[str]:
    """The command line's overrides of this run (a sweep point: its own)."""
    return list(HydraConfig.get().overrides.task)


def point_dir() -> str:
    """A sweep point's own directory under the sweep directory."""
    return HydraConfig.get().runtime.output_dir
