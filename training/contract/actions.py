"""The actions of `meshrun action=NAME`: one table, read by the launcher's dispatch (launcher/cli/app.py) and by
the config's `action` choices (training/contract/config.py). Pure data: module and function are names, imported
by the launcher only when the action runs (ranks never import launcher/).

Adding an action is one entry here and one module with `def NAME(cfg, run_dir)`: the function receives the config
resolved as `config` says and the run directory (None for `composed`), and returns the action's result.

Resolution, in this fixed order (launcher/cli/app.py: run_action):
  1. `composed`: the composed config as it is, no run directory (keys, prepare). Otherwise:
  2. the run directory: run.dir made absolute (a sweep point: its own directory), runs/latest followed;
  3. the run lock, when `locks`: one owner per run directory before anything there is read or written;
  4. `launch` only: the saved config of an existing run under the new command line (resume), the indexed
     datasets' paths and vocabulary, then train.init_from's model config;
  5. run.dir set to the resolved directory, then the action's function runs."""

from __future__ import annotations

from dataclasses import dataclass

CONFIG_KINDS = ("composed", "run_dir", "launch")


@dataclass(frozen=True)
class ActionSpec:
    name: str
    """What the user types: action=NAME."""
    module: str
    """The launcher module that runs it (imported when the action runs)."""
    function: str
    """Its function: function(cfg, run_dir) -> result."""
    locks: bool
    """Whether it takes the run directory's lock before it reads or writes there."""
    config: str
    """How its config is resolved: composed | run_dir | launch (CONFIG_KINDS; the order above)."""


ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("train", "launcher.cli.app", "start", locks=True, config="launch"),
    ActionSpec("plan", "launcher.cli.app", "start", locks=True, config="launch"),
    ActionSpec("status", "launcher.manage.status", "status_action", locks=False, config="run_dir"),
    ActionSpec("preflight", "launcher.launch.preflight", "run_preflight", locks=False, config="run_dir"),
    ActionSpec("rehearse", "launcher.launch.rehearse", "run_rehearse", locks=True, config="launch"),
    ActionSpec("keys", "launcher.cli.keys", "keys_action", locks=False, config="composed"),
    ActionSpec("prepare", "launcher.data.prepare", "run_prepare", locks=False, config="composed"),
    ActionSpec("export", "launcher.hf.export", "run_export", locks=False, config="run_dir"),
    ActionSpec("generate", "launcher.hf.generate", "run_generate", locks=False, config="run_dir"),
    ActionSpec("logs", "launcher.manage.logs", "run_logs", locks=False, config="run_dir"),
    ActionSpec("cancel", "launcher.manage.cancel", "run_cancel", locks=False, config="run_dir"),
    ActionSpec("report", "launcher.manage.report", "report_action", locks=False, config="run_dir"),
    ActionSpec("recommend", "launcher.planning.calibrate", "run_recommend", locks=False, config="run_dir"),
    ActionSpec("runs", "launcher.manage.runs", "runs_action", locks=False, config="composed"),
)

BY_NAME: dict[str, ActionSpec] = {a.name: a for a in ACTIONS}
NAMES = " ".join(a.name for a in ACTIONS)
