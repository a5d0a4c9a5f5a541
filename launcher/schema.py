"""Registers the typed config dataclasses with Hydra's ConfigStore (so typos and wrong types fail)."""

from hydra.core.config_store import ConfigStore

from training.config import Config


def register() -> None:
    ConfigStore.instance().store(name="meshrun_schema", node=Config)
