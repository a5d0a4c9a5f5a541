"""A sweep point's config, composed once per distinct set of config-group choices.

Hydra's BasicSweeper/BasicLauncher compose every point from the YAML files (~150 ms each, twice per
point). A point's config is the composition of its group choices (model=..., parallel=...) with its
plain value overrides (parallel.tp=4) applied on top, in struct mode: exactly the order Hydra itself
uses (config_loader_impl: defaults list first, then config overrides). So the group composition is
cached and each point costs a copy plus OmegaConf updates; typos and wrong types still fail.

The copy is a pickle round trip of the cached composition (bytes kept once per group set): OmegaConf
containers pickle with their flags, types and parents (submitit and joblib launchers ship configs that
way), and unpickling costs ~2 ms where copy.deepcopy of the same config costs ~9 ms. Parsed overrides
are kept per override string: a sweep's points share most of their overrides, and the grammar's parse
is ~1 ms each.
"""

from __future__ import annotations

import copy
import pickle
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

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
        self._bases: Dict[Tuple[str, ...], Tuple[Union[bytes, DictConfig], Union[bytes, DictConfig]]] = {}
        self._parsed: Dict[str, Override] = {}
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
        parsed = self._parse(overrides)
        groups = tuple(o.input_line for o in parsed if not self._is_value_override(o))
        values = [o for o in parsed if self._is_value_override(o)]
        cfg = self._with_values(self._base(groups)[0], values)
        # The bookkeeping compose does for every override, not just the group ones.
        app = [o for o in parsed if not o.is_hydra_override()]
        dirname = cfg.hydra.job.config.override_dirname
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.overrides.task = [o.input_line for o in app]
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=app, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys)
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)
        return cfg

    def _base(self, groups: Tuple[str, ...]) -> Tuple[Union[bytes, DictConfig], Union[bytes, DictConfig]]:
        """The group set's composition, and the same without its hydra node (what the task gets)."""
        bases = self._bases.get(groups)
        if bases is None:
            full = self.loader.load_sweep_config(self.master, list(groups))
            task = copy.deepcopy(full)
            with read_write(task), open_dict(task):
                del task["hydra"]
            bases = self._bases[groups] = (_dumps(full), _dumps(task))
            self.compositions += 1
        return bases

    @staticmethod
    def _with_values(base: Union[bytes, DictConfig], values: List[Override]) -> DictConfig:
        cfg = _copy(base)
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # load_configuration wraps these the same way
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
        return cfg

    def task_config(self, overrides: Sequence[str]) -> Optional[DictConfig]:
        """What run_job hands the task: the point's config without its hydra node (None: not cached here).

        The group set's composition without hydra, with the point's value overrides applied: value
        overrides never touch hydra (hydra.* overrides are part of the group set), so this equals
        run_job's deepcopy of the full config with hydra deleted, at half the copying."""
        if not self.enabled:
            return None
        parsed = self._parse(overrides)
        groups = tuple(o.input_line for o in parsed if not self._is_value_override(o))
        cfg = self._with_values(self._base(groups)[1], [o for o in parsed if self._is_value_override(o)])
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)
        return cfg

    def _parse(self, overrides: Sequence[str]) -> List[Override]:
        """The parsed overrides, each parsed once per sweep (Override objects are not modified by their users)."""
        todo = [line for line in overrides if line not in self._parsed]
        if todo:
            self._parsed.update(zip(todo, self.parser.parse_overrides(todo)))
        return [self._parsed[line] for line in overrides]

    def prepare(self, overrides: Sequence[str], keep: bool) -> None:
        """Build (so composition errors surface before any job runs); keep it for take() if asked."""
        cfg = self.build(overrides)
        if keep:
            self._ready[tuple(overrides)] = cfg

    def take(self, overrides: Sequence[str]) -> DictConfig:
        """The prepared config of this point, or a freshly built one."""
        cfg: Optional[DictConfig] = self._ready.pop(tuple(overrides), None)
        return cfg if cfg is not None else self.build(overrides)


def _dumps(cfg: DictConfig) -> Union[bytes, DictConfig]:
    """The composition as bytes to copy from; a value that cannot be pickled (none comes from YAML or the
    dataclass schema, but a plugin's resolver could add one) keeps the config itself, copied with deepcopy."""
    try:
        return pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any pickling failure means: copy it the slow way
        return cfg


def _copy(base: Union[bytes, DictConfig]) -> DictConfig:
    return pickle.loads(base) if isinstance(base, bytes) else copy.deepcopy(base)
