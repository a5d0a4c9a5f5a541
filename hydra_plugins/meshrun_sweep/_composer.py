"""A sweep point's config, composed once per distinct set of config-group choices.

Hydra's BasicSweeper/BasicLauncher compose every point from the YAML files (~150 ms each, twice per
point). A point's config is the composition of its group choices (model=..., parallel=...) with its
plain value overrides (parallel.tp=4) applied on top, in struct mode: exactly the order Hydra itself
uses (config_loader_impl: defaults list first, then config overrides). So the group composition is
cached and each point costs a copy plus OmegaConf updates; typos and wrong types still fail.
"""

from __future__ import annotations

import copy
import sys
from typing import Dict, Optional, Sequence, Tuple

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.config_loader import ConfigLoader
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException


class CachedComposer:
    """Builds per-point configs like ConfigLoader.load_sweep_config, composing each group set once."""

    def __init__(self, config_loader: ConfigLoader, master_config: DictConfig) -> None:
        self.loader = config_loader
        self.master = master_config
        self.parser = OverridesParser.create(config_loader=config_loader)
        # Group-choice overrides (as typed) -> the composed config without the point's value overrides.
        self._bases: Dict[Tuple[str, ...], DictConfig] = {}
        # Points built ahead by the sweeper's validation, handed to the launcher once.
        self._ready: Dict[Tuple[str, ...], DictConfig] = {}
        self.compositions = 0
        # A hydra.searchpath changes which groups exist; only ConfigLoaderImpl exposes its repository.
        # In either case every point is composed the standard way.
        self.enabled = isinstance(config_loader, ConfigLoaderImpl) and not OmegaConf.select(
            master_config, "hydra.searchpath")

    def _is_value_override(self, o: Override) -> bool:
        """Hydra's own rule (defaults_list.Overrides): a dict value or a key that is no config group."""
        if o.is_hydra_override() or o.is_sweep_override() or o.package is not None:
            return False
        if isinstance(o.value(), dict):
            return True
        return not self.loader.repository.group_exists(o.key_or_group)  # type: ignore[attr-defined]

    def build(self, overrides: Sequence[str]) -> DictConfig:
        """The point's full config (hydra node included), as load_sweep_config would return it."""
        if not self.enabled:
            self.compositions += 1
            return self.loader.load_sweep_config(self.master, list(overrides))
        parsed = self.parser.parse_overrides(list(overrides))
        groups = tuple(o.input_line for o in parsed if not self._is_value_override(o))
        values = [o for o in parsed if self._is_value_override(o)]
        base = self._bases.get(groups)
        if base is None:
            base = self.loader.load_sweep_config(self.master, list(groups))
            self._bases[groups] = base
            self.compositions += 1
        cfg = copy.deepcopy(base)
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # load_configuration wraps these the same way
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
        # The bookkeeping compose does for every override, not just the group ones.
        app = [o for o in parsed if not o.is_hydra_override()]
        dirname = cfg.hydra.job.config.override_dirname
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.overrides.task = [o.input_line for o in app]
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=app, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys)
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)
        return cfg

    def prepare(self, overrides: Sequence[str], keep: bool) -> None:
        """Build (so composition errors surface before any job runs); keep it for take() if asked."""
        cfg = self.build(overrides)
        if keep:
            self._ready[tuple(overrides)] = cfg

    def take(self, overrides: Sequence[str]) -> DictConfig:
        """The prepared config of this point, or a freshly built one."""
        cfg: Optional[DictConfig] = self._ready.pop(tuple(overrides), None)
        return cfg if cfg is not None else self.build(overrides)
