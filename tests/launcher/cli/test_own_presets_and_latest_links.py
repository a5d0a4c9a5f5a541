"""What a practitioner reaches for on the first day: presets kept in a directory of one's own (Hydra's
--config-dir and hydra.searchpath), listed by `meshrun --help`, composed and validated like the packaged ones;
`runs/latest` and `multirun/latest` naming the newest run and sweep, so status and logs need no timestamp;
`logs.tail=N`. In a scratch working directory: the one training run is a real `meshrun` process (it starts
ranks); every other command runs in this process through the same entry point (tests/helpers/cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.cli import run_cli

MESHRUN = os.path.join(os.path.dirname(sys.executable), "meshrun")


def _meshrun(cwd, *args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([MESHRUN, *args], capture_output=True, text=True, cwd=str(cwd), timeout=timeout, env=env)


def _cli(cwd, *args):
    """The same command as _meshrun, in this process (no ranks are started)."""
    return run_cli(*args, cwd=str(cwd))


def _team_presets(root):
    """A team's own presets, outside the package: a model, a layout and a cluster."""
    (root / "model").mkdir(parents=True)
    (root / "parallel").mkdir()
    (root / "cluster").mkdir()
    (root / "model" / "team_small.yaml").write_text(
        "# our smallest model\nname: team_small\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 2\n"
        "seq_length: 16\nvocab_size: 256\nnorm: rmsnorm\n"
    )
    (root / "parallel" / "team_single.yaml").write_text("tp: 1\npp: 1\nsp: false\nzero: 0\nglobal_batch: 2\n")
    (root / "parallel" / "team_tp4.yaml").write_text("tp: 4\nsp: true\n")  # 2 heads: refused by validation
    (root / "cluster" / "team_box.yaml").write_text(
        "name: team_box\nkind: local\nnodes: 1\ngpus_per_node: 1\ndevice: cpu\npeak_tflops: 1.0\n"
    )
    (root / "model" / "team_typo.yaml").write_text("name: typo\nnum_layer: 2\n")  # a misspelt key


def test_presets_of_ones_own_compose_validate_and_are_listed(tmp_path):
    team = tmp_path / "team_conf"
    _team_presets(team)
    listed = _cli(tmp_path, "--config-dir", str(team), "--help")
    assert listed.returncode == 0, listed.stderr
    groups = {line.split(":")[0]: line for line in listed.stdout.splitlines() if ": " in line}
    assert "team_small" in groups["model"] and "tiny" in groups["model"]  # beside the packaged presets
    assert "team_single" in groups["parallel"] and "team_box" in groups["cluster"]
    # Composed and validated like a packaged preset: the plan carries the preset's values.
    for how in (["--config-dir", str(team)], [f"hydra.searchpath=[file://{team}]"]):
        run = tmp_path / f"plan{len(how)}"
        r = _cli(
            tmp_path,
            *how,
            "action=plan",
            "model=team_small",
            "parallel=team_single",
            "cluster=team_box",
            f"run.dir={run}",
        )
        assert r.returncode == 0, r.stderr
        cfg = json.load(open(run / "config.json"))
        assert cfg["model"]["name"] == "team_small" and cfg["model"]["norm"] == "rmsnorm"
        assert cfg["cluster"]["name"] == "team_box" and cfg["parallel"]["global_batch"] == 2
    # The same rules as for packaged presets: a layout that breaks them, a misspelt key -> exit 2, nothing written.
    bad = _cli(
        tmp_path,
        "--config-dir",
        str(team),
        "action=plan",
        "model=team_small",
        "parallel=team_tp4",
        f"run.dir={tmp_path / 'bad'}",
    )
    assert bad.returncode == 2 and "divisible" in bad.stderr and not (tmp_path / "bad").exists()
    typo = _cli(tmp_path, "--config-dir", str(team), "action=plan", "model=team_typo", f"run.dir={tmp_path / 'typo'}")
    assert typo.returncode == 2 and "num_layer" in typo.stderr and not (tmp_path / "typo").exists()


@pytest.mark.slow  # a local training run
def test_latest_links_follow_the_newest_run_and_sweep(tmp_path):
    args = [
        "model.num_layers=1",
        "model.hidden_size=16",
        "model.num_attention_heads=2",
        "model.seq_length=8",
        "parallel=single",
        "parallel.global_batch=2",
        "cluster.gpus_per_node=1",
        "cluster.peak_tflops=1",
        "data=synthetic",
        "train.steps=3",
        "train.tensorboard=false",
    ]
    # The link is pointed once a training run's plan passes, before its launch (launcher/cli/app.py: start); a
    # plan-only action (or a dry run) never moves it (issue 47): the first, older directory is a plan, the
    # newest one trains, and a later plan leaves the link on the training run.
    first = _cli(tmp_path, *args, "action=plan")
    assert first.returncode == 0, first.stderr
    runs = tmp_path / "runs"
    (one,) = [d for d in os.listdir(runs) if d != "latest"]
    assert not os.path.lexists(runs / "latest")
    second = _meshrun(tmp_path, *args, "train.steps=4")
    assert second.returncode == 0, second.stderr
    two = [d for d in os.listdir(runs) if d not in ("latest", one)]
    assert len(two) == 1 and os.readlink(runs / "latest") == two[0]  # relative: the folder can move
    later = _cli(tmp_path, *args, "action=plan")
    assert later.returncode == 0 and os.readlink(runs / "latest") == two[0], later.stderr
    status = _cli(tmp_path, "action=status", "run.dir=runs/latest")
    assert status.returncode == 0, status.stderr
    got = json.loads(status.stdout)
    assert got["state"] == "COMPLETED" and got["last_step"] == 4
    whole = (runs / two[0] / "logs" / "rank_0.log").read_text().splitlines()
    tail = _cli(tmp_path, "action=logs", "run.dir=runs/latest", "logs.tail=3")
    assert tail.returncode == 0, tail.stderr
    header, *lines = tail.stdout.splitlines()
    assert header == f"==> {runs / two[0] / 'logs' / 'rank_0.log'} <==" and lines == whole[-3:]
    # Resuming through the link runs in the real directory and leaves the link where it was.
    again = _cli(tmp_path, "action=plan", "train.steps=5", "run.dir=runs/latest")
    assert again.returncode == 0, again.stderr
    assert os.readlink(runs / "latest") == two[0] and not (runs / "latest" / "latest").exists()
    assert json.load(open(runs / two[0] / "config.json"))["run"]["dir"] == str(runs / two[0])
    # A sweep: multirun/latest names its directory, and status of it is the sweep's.
    sweep = _cli(tmp_path, "-m", "action=plan", "parallel.tp=1,2", "parallel.sp=false")
    assert sweep.returncode == 0, sweep.stderr
    (sweep_dir,) = [d for d in os.listdir(tmp_path / "multirun") if d != "latest"]
    assert os.readlink(tmp_path / "multirun" / "latest") == sweep_dir
    points = json.loads(_cli(tmp_path, "action=status", "run.dir=multirun/latest").stdout)
    assert len(points["points"]) == 2
    # A real directory called latest is the user's: never replaced.
    own = tmp_path / "elsewhere" / "runs"
    (own / "latest").mkdir(parents=True)
    r = _cli(tmp_path, "action=plan", f"run.dir={own / 'x'}")
    assert r.returncode == 0 and (own / "latest").is_dir() and not (own / "latest").is_symlink()


def test_logs_tail_counts_lines_across_attempts(tmp_path):
    from launcher.manage.logs import _tail_offsets

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("a1\na2\na3\n")
    b.write_text("b1\nb2")  # the last line without its newline
    for n, want in ((1, "b2"), (2, "b1\nb2"), (3, "a3\nb1\nb2"), (9, "a1\na2\na3\nb1\nb2")):
        off = _tail_offsets([str(a), str(b)], n)
        text = a.read_bytes()[off[str(a)] :] + b.read_bytes()[off[str(b)] :]
        assert text.decode().rstrip("\n") == want, n
