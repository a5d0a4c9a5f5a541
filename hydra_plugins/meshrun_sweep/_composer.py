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

The sweep's own (master) config is the composition of the same group choices when no group is swept:
Hydra composed it from the command line's overrides minus the swept ones, i.e. the groups every point
has plus value overrides that each point applies again anyway. It is then the base of those points, and
a sweep over values alone composes nothing more (~80 ms, the cost of one composition). That holds only
when applying its value overrides a second time changes nothing: plain key=value ones (a second
+key=value or ~key would fail), and no group left unchosen (a multirun composition skips a missing
group's ??? where a point's composition fails).
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Sequence

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
        self._bases: dict[tuple[str, ...], bytes | DictConfig] = {}
        self._parsed: dict[str, Override] = {}
        # Override line -> whether it sets a value (not a group): asking the config repository whether a
        # group exists walks its config sources every time, for every override of every point.
        self._is_value: dict[str, bool] = {}
        # Points built ahead by the sweeper's validation, handed to the launcher once.
        self._ready: dict[tuple[str, ...], DictConfig] = {}
        self.compositions = 0
        # A hydra.searchpath changes which groups exist; only ConfigLoaderImpl exposes its repository.
        # In either case every point is composed the standard way.
        self.enabled = isinstance(config_loader, ConfigLoaderImpl) and not OmegaConf.select(
            master_config, "hydra.searchpath"
        )
        self._master_groups = self._groups_of_master() if self.enabled else None

    def _groups_of_master(self) -> tuple[str, ...] | None:
        """The group overrides of the master config, as the basic sweeper writes them into every point's
        overrides (key=value), when the master config may serve as those points' base; else None."""
        lines = OmegaConf.to_container(self.master.hydra.overrides.task)
        assert isinstance(lines, list)
        fixed = [o for o in self._parse([str(line) for line in lines]) if not o.is_sweep_override()]
        values = [o for o in fixed if self._is_value_override(o)]
        if any(o.is_add() or o.is_delete() or o.is_force_add() for o in values):
            return None
        choices = OmegaConf.to_container(self.master.hydra.runtime.choices)
        assert isinstance(choices, dict)
        if any(choice == "???" for choice in choices.values()):
            return None
        return tuple(
            f"{o.get_key_element()}={o.get_value_element_as_str()}" for o in fixed if not self._is_value_override(o)
        )

    def _is_value_override(self, o: Override) -> bool:
        """Hydra's own rule (defaults_list.Overrides): a dict value or a key that is no config group."""
        known = self._is_value.get(o.input_line)
        if known is None:
            if o.is_hydra_override() or o.is_sweep_override() or o.package is not None:
                known = False
            elif isinstance(o.value(), dict):
                known = True
            else:
                known = not self.loader.repository.group_exists(o.key_or_group)  # type: ignore[attr-defined]
            self._is_value[o.input_line] = known
        return known

    def build(self, overrides: Sequence[str]) -> DictConfig:
        """The point's full config (hydra node included), as load_sweep_config would return it."""
        if not self.enabled:
            self.compositions += 1
            return self.loader.load_sweep_config(self.master, list(overrides))
        parsed = self._parse(overrides)
        groups = tuple(o.input_line for o in parsed if not self._is_value_override(o))
        values = [o for o in parsed if self._is_value_override(o)]
        cfg = self._with_values(self._base(groups), values)
        # The bookkeeping compose does for every override, not just the group ones.
        app = [o for o in parsed if not o.is_hydra_override()]
        dirname = cfg.hydra.job.config.override_dirname
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.overrides.task = [o.input_line for o in app]
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=app, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys
            )
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)
        return cfg

    def _base(self, groups: tuple[str, ...]) -> bytes | DictConfig:
        """The group set's composition, kept to copy from."""
        base = self._bases.get(groups)
        if base is None and groups == self._master_groups:
            base = self._bases[groups] = _dumps(self.master)
        elif base is None:
            base = self._bases[groups] = _dumps(self.loader.load_sweep_config(self.master, list(groups)))
            self.compositions += 1
        return base

    @staticmethod
    def _with_values(base: bytes | DictConfig, values: list[Override]) -> DictConfig:
        cfg = _copy(base)
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # load_configuration wraps these the same way
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
        return cfg

    def _parse(self, overrides: Sequence[str]) -> list[Override]:
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
        cfg: DictConfig | None = self._ready.pop(tuple(overrides), None)
        return cfg if cfg is not None else self.build(overrides)


def _dumps(cfg: DictConfig) -> bytes | DictConfig:
    """The composition as bytes to copy from; a value that cannot be pickled (none comes from YAML or the
    dataclass schema, but a plugin's resolver could add one) keeps the config itself, copied with deepcopy."""
    try:
        return pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any pickling failure means: copy it the slow way
        return cfg


def _copy(base: bytes | DictConfig) -> DictConfig:
    return pickle.loads(base) if isinstance(base, bytes) else copy.deepcopy(base)
