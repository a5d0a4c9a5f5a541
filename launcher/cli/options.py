"""The command line's own options: the groups that only the launcher's actions read (prepare, keys, status, runs,
logs, cancel). AppConfig, the ranks' Config (training/contract/config.py) plus these, is the schema Hydra composes
(launcher/cli/schema.py) and the fast path builds (launcher/cli/fast.py); config.json, what every rank reads, holds
Config's part only (training/contract/config.py config_to_dict)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from launcher.data.prepare.config import PrepareConfig
from training.contract import config as contract
from training.contract.config import Choice, Config, build


class StatusFormat(Choice):
    json = "json"
    table = "table"


OPTION_GROUPS = ("prepare", "keys", "status", "runs", "logs", "cancel")
"""AppConfig's groups beyond Config's: chosen by each invocation, never saved in or resumed from a run."""


@dataclass
class KeysConfig:
    """What `meshrun action=keys` prints."""

    group: str = ""
    """Only this group's keys (model, parallel, cluster, train, data, run, or another section such as prepare);
    empty: every key."""


@dataclass
class StatusConfig:
    """What `meshrun action=status` prints."""

    format: StatusFormat = StatusFormat.json
    """json (one JSON object on stdout: the contract) | table (for people; a sweep as one table)."""


@dataclass
class RunsConfig:
    """What `meshrun action=runs` lists."""

    dir: str = "runs"
    """The folder whose run directories are listed (newest first): state, step/total, loss, job id, age; a
    directory with a plan and no launch is PLANNED."""


@dataclass
class LogsConfig:
    """What `meshrun action=logs` prints."""

    rank: int = 0
    """Whose log: the global rank (Slurm: the task of that rank in every job of the run)."""
    follow: bool = False
    """Keep printing what is appended (and the logs of later attempts) until the run has ended."""
    tail: int = 0
    """Only the last N lines of the rank's log (over every attempt, newest last), then follow if asked; 0: all."""


@dataclass
class CancelConfig:
    """How `meshrun action=cancel` stops a run."""

    timeout_s: float = 300.0
    """Wait this long for the ranks to save and stop after the stop signal; then the job is killed (scancel /
    SIGKILL: the last complete checkpoint is kept, the steps after it are lost)."""


@dataclass
class AppConfig(Config):
    """The whole command line: the job (Config) and the options of the action that reads them."""

    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    """action=prepare: inputs, output and tokenizer of the dataset to write."""
    keys: KeysConfig = field(default_factory=KeysConfig)
    """action=keys: which keys to print."""
    status: StatusConfig = field(default_factory=StatusConfig)
    """action=status: output format."""
    runs: RunsConfig = field(default_factory=RunsConfig)
    """action=runs: which folder's runs to list."""
    logs: LogsConfig = field(default_factory=LogsConfig)
    """action=logs: which rank's log, and whether to follow it."""
    cancel: CancelConfig = field(default_factory=CancelConfig)
    """action=cancel (and a local run's interrupt): how long the ranks get to save before they are killed."""


CHOICE_FIELDS: dict[str, type[Choice]] = {**contract.CHOICE_FIELDS, "status.format": StatusFormat}
"""Every choice field of the command line, by its key: the contract's and the options'."""

SCHEMA_MODULES = ("training.contract.config", "launcher.cli.options", "launcher.data.prepare.config")
"""The modules whose attribute docstrings document the keys (`meshrun action=keys`, docs/KEYS.md)."""


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a choice field, as strings."""
    return tuple(m.value for m in CHOICE_FIELDS[key])


def app_config_from_dict(data: dict[str, Any]) -> AppConfig:
    """An AppConfig from plain dicts (a composition without Hydra: launcher/cli/fast.py)."""
    return build(AppConfig, data)


def with_options(cfg: Config, options: AppConfig) -> AppConfig:
    """cfg (a run's saved config under this command line: launcher/manage/resume.py) with this invocation's
    options, which a run never keeps."""
    if isinstance(cfg, AppConfig):
        return cfg
    job = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    return AppConfig(**job, **{name: getattr(options, name) for name in OPTION_GROUPS})
