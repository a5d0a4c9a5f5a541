"""The read-only commands' Hydra-free path (launcher/cli/fast.py, the CLI latency of bench/bench_cli.py): its
composition equals Hydra's for the command lines it takes, it hands everything else to Hydra, the fast commands
never import Hydra, and `--help` lists every action and every preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.cli import compose_cfg

from launcher.cli.actions import ACTIONS
from launcher.cli.fast import compose, help_text
from launcher.cli.precheck import presets
from training.contract.config import Config, config_to_dict

TAKEN = [
    ["action=keys"],
    ["action=keys", "keys.group=parallel", "model=llama3_8b", "cluster=dgx_h100"],
    ["action=status", "run.dir=runs/x", "status.format=table"],
    ["action=logs", "run.dir=/tmp/r", "logs.rank=3", "logs.follow=true", "logs.tail=12"],
    ["action=keys", "cluster=dgx_a100", "parallel=tp8_pp2", "train.steps=7", "cluster.gpu_memory_gb=40"],
    ["action=keys", "model=mixtral_8x7b", "data=synthetic", "parallel.cp_comm=all_gather", "train.precision=bf16"],
    ["action=runs", "runs.dir=elsewhere"],
]
LEFT_TO_HYDRA = [
    ["action=keys", "+cluster.env.X=1"],
    ["action=keys", "parallel.tp=2,4"],
    ["action=keys", "--config-dir", "/tmp"],
    ["action=keys", "model=nope"],
    ["action=keys", "parallel.tpp=2"],
    ["action=keys", "parallel.tp=two"],
    ["action=keys", "cluster.env={A: 1}"],
    ["action=keys", "run.dir=${oc.env:HOME}"],
]


def _without_run_dir(cfg):
    d = config_to_dict(cfg)
    d["run"].pop("dir")
    return d


@pytest.mark.parametrize("argv", TAKEN, ids=lambda a: " ".join(a))
def test_composition_equals_hydras(argv):
    fast = compose(argv)
    assert fast is not None, argv
    hydra = compose_cfg(*argv)
    assert _without_run_dir(fast) == _without_run_dir(hydra)
    # Choice fields are the schema's Enum members, as Hydra gives them (the planner compares either way).
    assert type(fast.parallel.schedule) is type(hydra.parallel.schedule)
    explicit = [a.split("=", 1)[1] for a in argv if a.startswith("run.dir=")]
    assert fast.run.dir == (explicit[0] if explicit else fast.run.dir) and fast.run.dir.startswith(
        explicit[0] if explicit else "runs/"
    )


@pytest.mark.parametrize("argv", LEFT_TO_HYDRA, ids=lambda a: " ".join(a))
def test_anything_else_is_left_to_hydra(argv):
    assert compose(argv) is None


def test_help_lists_every_action_and_preset():
    text = help_text()
    for action in ACTIONS:
        assert f"\n  {action.name} " in text, action.name
    for group in ("model", "parallel", "cluster", "train", "data"):
        assert f"{group}: {', '.join(presets(group))}" in text
    assert "$APP_CONFIG_GROUPS" not in text and "$FLAGS_HELP" not in text


def test_fast_commands_run_without_importing_hydra(tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank_0.log").write_text("one\ntwo\n")
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(Config())))
    probe = (
        "import sys, json, contextlib, io\n"
        "from launcher.cli.main import main\n"
        "out = {}\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    sys.argv = ['meshrun', *argv]\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main()\n"
        "        except SystemExit as e:\n"
        "            assert not e.code, (argv, e.code)\n"
        "    out[' '.join(argv)] = buf.getvalue()\n"
        "out['hydra'] = 'hydra' in sys.modules\n"
        "print(json.dumps(out))\n"
    )
    argvs = [
        ["--help"],
        ["action=keys", "keys.group=parallel"],
        ["action=status", f"run.dir={run_dir}"],
        ["action=logs", f"run.dir={run_dir}", "logs.tail=1"],
        ["action=runs", f"runs.dir={tmp_path}"],
    ]
    p = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(argvs)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["hydra"] is False
    assert "Usage: meshrun" in out["--help"]
    assert "parallel.auto: bool = False" in out["action=keys keys.group=parallel"]
    assert json.loads(out[f"action=status run.dir={run_dir}"])["log"].endswith("rank_0.log")
    assert out[f"action=logs run.dir={run_dir} logs.tail=1"].rstrip().endswith("two")
    assert str(run_dir) in out[f"action=runs runs.dir={tmp_path}"]


def test_console_script_takes_the_fast_path():
    """The installed `meshrun` is launcher.cli.main:main (pyproject.toml), whose --help is this one."""
    exe = os.path.join(os.path.dirname(sys.executable), "meshrun")
    if not os.path.exists(exe):
        pytest.skip("no installed console script beside this interpreter (make install puts one in .venv/bin)")
    p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.rstrip() == help_text().rstrip()
