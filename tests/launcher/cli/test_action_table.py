"""The action table (launcher/cli/actions.py): every entry runs through one dispatch, its names are the contract's
(training/contract/actions.py ACTION_NAMES), its summaries are what --help and the `action` key's documentation
list, and a new action is one table entry, its name, and one module, shown by adding one in a scratch copy of the
tree and running it through `meshrun`."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys

from launcher.cli.actions import ACTIONS, CONFIG_KINDS, action_doc
from launcher.cli.fast import help_text
from launcher.cli.keys import field_docstrings
from training.contract.actions import ACTION_NAMES
from training.contract.config import Action

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repository, above tests/


def test_every_entry_names_a_function_of_cfg_and_run_dir_and_the_config_offers_exactly_the_table():
    assert sorted(a.name for a in ACTIONS) == sorted(str(a) for a in Action)
    assert len({a.name for a in ACTIONS}) == len(ACTIONS)
    for spec in ACTIONS:
        assert spec.module.startswith("launcher."), spec
        assert spec.config in CONFIG_KINDS, spec
        fn = getattr(importlib.import_module(spec.module), spec.function)
        params = list(inspect.signature(fn).parameters)
        assert len(params) >= 2 and params[:2] == ["cfg", "run_dir"], (spec, params)
    # Only the launches, and the rehearsal (a launch's config, run on meta: docs/REHEARSAL.md), take the run lock
    # and resolve a launch's config (resume, data, init_from).
    assert {a.name for a in ACTIONS if a.locks} == {"train", "plan", "rehearse"}
    assert {a.name for a in ACTIONS if a.config == "launch"} == {"train", "plan", "rehearse"}


def test_the_contract_names_exactly_the_table_in_its_order():
    assert ACTION_NAMES == tuple(a.name for a in ACTIONS)
    assert tuple(str(a) for a in Action) == ACTION_NAMES


def test_help_and_the_action_key_list_every_summary_from_the_table():
    text = help_text()
    lines = [line for line in text.splitlines() if line.startswith("  ") and line.split()[0] in ACTION_NAMES]
    assert lines == [f"  {a.name:<10} {a.summary}" for a in ACTIONS]
    doc = field_docstrings()[("Config", "action")]
    assert doc.endswith(action_doc())
    for spec in ACTIONS:
        assert f"{spec.name} ({spec.summary})" in doc, spec.name


def test_a_new_action_is_one_table_entry_and_one_module(tmp_path):
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for top in ("launcher", "training", "hydra_plugins"):
        shutil.copytree(os.path.join(ROOT, top), tree / top, ignore=ignore)
    table = tree / "launcher" / "cli" / "actions.py"
    text = table.read_text()
    assert text.count("\n)\n\nBY_NAME") == 1
    table.write_text(
        text.replace(
            "\n)\n\nBY_NAME",
            '\n    ActionSpec("hello", "launcher.hello", "hello", locks=False, config="run_dir", summary="hi"),'
            "\n)\n\nBY_NAME",
        )
    )
    names = tree / "training" / "contract" / "actions.py"
    text = names.read_text()
    assert text.count('    "generate",\n)') == 1
    names.write_text(text.replace('    "generate",\n)', '    "generate",\n    "hello",\n)'))
    (tree / "launcher" / "hello.py").write_text(
        "import json\n\n\n"
        "def hello(cfg, run_dir):\n"
        "    print(json.dumps({'action': str(cfg.action), 'run_dir': run_dir, 'cfg_run_dir': cfg.run.dir}))\n"
        "    return 0\n"
    )
    run_dir = tmp_path / "runs" / "r1"
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run(
        [sys.executable, "-m", "launcher", "action=hello", f"run.dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"action": "hello", "run_dir": str(run_dir), "cfg_run_dir": str(run_dir)}
    # the same action name in the unmodified tree is refused as a bad value (exit 2)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "action=hello",
            f"run.dir={run_dir}",
            f"hydra.run.dir={tmp_path / 'hydra2'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 2, res.stdout + res.stderr
