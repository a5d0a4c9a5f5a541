"""The actions of `meshrun action=NAME`: one table, read by the launcher's dispatch (launcher/cli/app.py), the fast
path (launcher/cli/fast.py), `meshrun --help` and `meshrun action=keys` (each action's summary). Module and function
are names, imported only when the action runs. The names alone are the config's `action` choices
(training/contract/actions.py ACTION_NAMES, in this table's order: tests/launcher/cli/test_action_table.py holds them
equal), so the ranks never see a launcher module path.

Adding an action is one entry here, its name in ACTION_NAMES, and one module with `def NAME(cfg, run_dir)`: the
function receives the config resolved as `config` says and the run directory (None for `composed`), and returns the
action's result.

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
    summary: str
    """One line for `meshrun --help` and the `action` key's documentation: the arguments it takes, what it does."""


ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec(
        "train",
        "launcher.cli.app",
        "start",
        locks=True,
        config="launch",
        summary="validate, plan, then launch on the selected cluster (the default; cluster=local runs here)",
    ),
    ActionSpec(
        "plan",
        "launcher.cli.app",
        "start",
        locks=True,
        config="launch",
        summary="validate and plan only: the plan table; run.dir=D keeps plan.json (else runs/.plans/), launches nothing",
    ),
    ActionSpec(
        "rehearse",
        "launcher.launch.rehearse",
        "run_rehearse",
        locks=True,
        config="launch",
        summary="the train configuration's ranks on meta tensors: collectives, deadlocks, memory (rehearsal.json)",
    ),
    ActionSpec(
        "recommend",
        "launcher.launch.calibrate",
        "run_recommend",
        locks=False,
        config="run_dir",
        summary="model=M cluster=C run.dir=D: rank every valid layout by predicted step time (recommend.json)",
    ),
    ActionSpec(
        "prepare",
        "launcher.data.prepare",
        "run_prepare",
        locks=False,
        config="composed",
        summary="prepare.inputs=[...] prepare.output=DIR/NAME: tokenize into a Megatron indexed dataset",
    ),
    ActionSpec(
        "status",
        "launcher.manage.status",
        "status_action",
        locks=False,
        config="run_dir",
        summary="one JSON object for run.dir=D (a run or a sweep directory); status.format=table for people",
    ),
    ActionSpec(
        "runs",
        "launcher.manage.runs",
        "runs_action",
        locks=False,
        config="composed",
        summary="[runs.dir=runs]: every run of a folder, newest first: state, step/total, loss, job id, age",
    ),
    ActionSpec(
        "logs",
        "launcher.manage.logs",
        "run_logs",
        locks=False,
        config="run_dir",
        summary="run.dir=D [logs.rank=N] [logs.follow=true] [logs.tail=N]: a rank's log, every attempt, newest last",
    ),
    ActionSpec(
        "cancel",
        "launcher.manage.cancel",
        "run_cancel",
        locks=False,
        config="run_dir",
        summary="run.dir=D (a run, a sweep or one point): save, stop, never requeue; status says CANCELLED",
    ),
    ActionSpec(
        "report",
        "launcher.manage.report",
        "report_action",
        locks=False,
        config="run_dir",
        summary="run.dir=D: plots and a self-contained report.html of a run or a sweep (D/report/)",
    ),
    ActionSpec(
        "preflight",
        "launcher.launch.preflight_action",
        "run_preflight",
        locks=False,
        config="run_dir",
        summary="GPU, InfiniBand, OS and collective health checks on the selected cluster",
    ),
    ActionSpec(
        "keys",
        "launcher.cli.keys",
        "keys_action",
        locks=False,
        config="composed",
        summary="every key with its type, default and documentation (keys.group=parallel for one group)",
    ),
    ActionSpec(
        "export",
        "launcher.hf.export",
        "run_export",
        locks=False,
        config="run_dir",
        summary="run.dir=D export.output=DIR: a checkpoint as a Hugging Face directory (GPT-2, Llama, Mixtral)",
    ),
    ActionSpec(
        "generate",
        "launcher.hf.generate",
        "run_generate",
        locks=False,
        config="run_dir",
        summary="run.dir=D generate.prompt_tokens=[...]: continue a prompt with a checkpoint (one JSON object)",
    ),
)

BY_NAME: dict[str, ActionSpec] = {a.name: a for a in ACTIONS}


def help_lines() -> str:
    """The actions as `meshrun --help` lists them: one line each, the name then its summary."""
    return "\n".join(f"  {a.name:<10} {a.summary}" for a in ACTIONS)


def action_doc() -> str:
    """The `action` key's documentation (`meshrun action=keys`, docs/KEYS.md): every action with its summary."""
    return "\n| ".join(f"{a.name} ({a.summary})" for a in ACTIONS) + "."
