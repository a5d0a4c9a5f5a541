"""Registers the typed config dataclasses (launcher/cli/options.py AppConfig) with Hydra's ConfigStore (so typos and wrong types fail), the
`meshrun_unique` resolver that makes the default run and sweep directories unique, and `meshrun_actions`, the
action table's lines of conf/config.yaml's --help text (launcher/cli/actions.py)."""

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from launcher.cli.actions import help_lines
from launcher.cli.early import unique_suffix  # noqa: E402 (Hydra-free: launcher/cli/fast.py uses it too)
from launcher.cli.options import AppConfig


def register() -> None:
    # The command line composes AppConfig: the ranks' Config and the options only the launcher reads.
    ConfigStore.instance().store(name="meshrun_schema", node=AppConfig)
    OmegaConf.register_new_resolver("meshrun_unique", unique_suffix, replace=True)
    OmegaConf.register_new_resolver("meshrun_actions", help_lines, replace=True)
