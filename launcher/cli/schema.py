"""Registers the typed config dataclasses with Hydra's ConfigStore (so typos and wrong types fail), and the
`meshrun_unique` resolver that makes the default run and sweep directories unique."""

import datetime
import os

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from training.contract.config import Config

_UNIQUE = []


def unique_suffix() -> str:
    """Microseconds and pid of this invocation, the same for every use within it: two launches in the same
    second get two run directories (conf/config.yaml: run.dir, hydra.sweep.dir). The run lock
    (training/contract/rundir/lock.py) still refuses the rare collision that remains."""
    if not _UNIQUE:
        _UNIQUE.append(f"{datetime.datetime.now().microsecond:06d}-{os.getpid()}")
    return _UNIQUE[0]


def register() -> None:
    ConfigStore.instance().store(name="meshrun_schema", node=Config)
    OmegaConf.register_new_resolver("meshrun_unique", unique_suffix, replace=True)
