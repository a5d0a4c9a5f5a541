"""The run directory's safety: config.json is never overwritten by a mistake, no write
inside run.dir follows a symbolic link, cluster.env cannot set meshrun's own variables, sbatch options are
reserved by prefix as sbatch reads them, and action=prepare never replaces a dataset silently.

One tiny local training run (module fixture) gives a real run directory with a checkpoint; every case works
on a copy of it. The launches that must be refused exit 2 before any rank starts, and plan, status and logs
start none: they run in this process through the console entry point (tests/helpers/cli.py). Launches that
train, and the signals sent to them, are real `python -m launcher` processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import pytest
from helpers import ROOT
from helpers.cli import run_cli
from helpers.local_run import PYTHON, TINY_RUN, wait_for

TINY = [
    *TINY_RUN,
    "cluster=local",
    "cluster.peak_tflops=1",
    "train.tensorboard=false",
]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT)


def meshrun(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "launcher", *args], cwd=str(cwd), env=_env(), capture_output=True, text=True, timeout=600
    )


def meshrun_many(cases, cwd):
    """Commands that exit before any rank starts (refusals, plans), one after another in this process."""
    return [run_cli(*args, cwd=str(cwd)) for args in cases]


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("trained")
    run = base / "run"
    p = meshrun(f"run.dir={run}", *TINY, "train.steps=2", cwd=base)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (run / "checkpoints" / "step_2").is_dir()
    return run


def _copy(trained, tmp_path, name: str):
    dest = tmp_path / name
    shutil.copytree(trained, dest, symlinks=True)
    return dest


@pytest.mark.slow  # trains (the module's `trained` run)
def test_config_json_is_never_overwritten_by_a_mistake(trained, tmp_path, capsys):
    """Each case leaves config.json byte for byte and the checkpoint's own config.json intact."""
    runs = {
        name: _copy(trained, tmp_path, name) for name in ("model", "plan", "typo", "truncated", "nonnumber", "list")
    }
    with open(runs["typo"] / "config.json") as f:
        cfg = json.load(f)
    cfg["train"]["stepz"] = 5  # a hand-added misspelt key
    (runs["typo"] / "config.json").write_text(json.dumps(cfg))
    text = (runs["truncated"] / "config.json").read_text()
    (runs["truncated"] / "config.json").write_text(text[: len(text) // 2])
    cfg["train"].pop("stepz")
    cfg["model"]["hidden_size"] = "sixty-four"
    (runs["nonnumber"] / "config.json").write_text(json.dumps(cfg))
    (runs["list"] / "config.json").write_text("[1, 2]")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}\n')
    before = {name: _sha(run / "config.json") for name, run in runs.items()}
    ckpt_cfg = {name: _sha(run / "checkpoints" / "step_2" / "config.json") for name, run in runs.items()}
    plan_before = _sha(runs["plan"] / "plan.json")
    model, plan, foreign_run = meshrun_many(
        [
            [f"run.dir={runs['model']}", "model.num_layers=3"],
            [f"run.dir={runs['plan']}", "action=plan", "model.num_layers=3"],
            [f"run.dir={foreign}", *TINY],
        ],
        cwd=tmp_path,
    )
    assert model.returncode == 2 and "model.num_layers: checkpoint 2, now 3" in model.stderr, model.stderr
    assert "train.resume=none" in model.stderr
    assert plan.returncode == 0 and "is an existing run: this plan is shown only" in plan.stderr, plan.stderr
    assert _sha(runs["plan"] / "plan.json") == plan_before
    # The damaged files, through the same code a launch runs first (launcher/manage/resume.py), in this process.
    from launcher.manage.resume import resume_config
    from training.contract.config import Config

    for name, what in (
        ("typo", "stepz"),
        ("truncated", "cannot be read"),
        ("nonnumber", "model.hidden_size='sixty-four'"),
        ("list", "holds a JSON list"),
    ):
        now = Config()
        now.action = "train"
        with pytest.raises(SystemExit) as stop:
            resume_config(str(runs[name]), now, [])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and what in err and str(runs[name] / "config.json") in err, (name, err)
    assert foreign_run.returncode == 2 and "meshrun did not create" in foreign_run.stderr, foreign_run.stderr
    assert (foreign / "config.json").read_text() == '{"architectures": ["GPT2LMHeadModel"]}\n'
    assert sorted(os.listdir(foreign)) == ["config.json"]
    for name, run in runs.items():
        if name not in ("typo", "truncated", "nonnumber", "list"):
            assert _sha(run / "config.json") == before[name], name
        assert _sha(run / "checkpoints" / "step_2" / "config.json") == ckpt_cfg[name], name
        assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    for name in ("typo", "truncated", "nonnumber", "list"):
        assert _sha(runs[name] / "config.json") == before[name], name  # the damaged file is left for the user
    # The run itself was not harmed: a plain relaunch afterwards still says "no changes".
    again = run_cli(f"run.dir={runs['model']}", "action=plan", cwd=str(tmp_path))
    assert again.returncode == 0 and "(no changes)" in again.stderr, again.stderr


@pytest.mark.slow  # trains (the module's `trained` run)
def test_writes_never_follow_symlinks_out_of_run_dir(trained, tmp_path):
    """Launches on a run with planted links exit 2 and leave every target unchanged; the writers themselves
    (events, metrics, logs, summary/plan/config, the lock) refuse a link without the launcher's check."""
    run = _copy(trained, tmp_path, "linked")
    outside = tmp_path / "outside"
    outside.mkdir()
    names = ["events.jsonl", "metrics.jsonl", "summary.json", "plan.json", ".meshrun.lock", "logs/rank_0.log"]
    for name in names:
        target = outside / name.replace("/", "_")
        target.write_text(f"precious {name}\n")
        os.unlink(run / name)
        os.symlink(target, run / name)
    snapshot = {p.name: p.read_text() for p in outside.iterdir()}
    train, plan = meshrun_many([[f"run.dir={run}", "train.steps=3"], [f"run.dir={run}", "action=plan"]], tmp_path)
    for res in (train, plan):
        assert res.returncode == 2 and "symbolic links" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert {p.name: p.read_text() for p in outside.iterdir()} == snapshot

    # The one writer, without the launcher's check (what a rank or any later write goes through).
    from training.contract.rundir.events import append_event
    from training.contract.rundir.files import LinkRefused, append_bytes, open_append, write_atomic
    from training.contract.rundir.lock import acquire

    with pytest.raises(LinkRefused, match="symbolic link"):
        append_event(str(run), "probe")
    with pytest.raises(LinkRefused):
        append_bytes(str(run / "metrics.jsonl"), b"{}\n")
    with pytest.raises(LinkRefused):
        open_append(str(run / "logs" / "rank_0.log"), binary=True)
    with pytest.raises(LinkRefused):
        acquire(str(run))
    write_atomic(str(run / "summary.json"), "{}")  # replaces the link itself, never its target
    assert not os.path.islink(run / "summary.json") and (run / "summary.json").read_text() == "{}"
    os.rename(run / "logs", run / "logs.real")
    os.symlink(outside, run / "logs")  # a linked directory below run.dir
    with pytest.raises(LinkRefused):
        open_append(str(run / "logs" / "rank_1.log"))
    assert not (outside / "rank_1.log").exists()
    assert {p.name: p.read_text() for p in outside.iterdir()} == snapshot


def test_reserved_env_names_and_sbatch_prefixes_are_refused(tmp_path):
    runs = [tmp_path / f"r{i}" for i in range(3)]
    cases = [
        [
            "action=plan",
            f"run.dir={runs[0]}",
            "+cluster.env.PYTHONPATH=/tmp/x",
            "+cluster.env.MESHRUN_RUN_DIR=/tmp/y",
            "+cluster.env.PYTHONSAFEPATH=0",
            "+cluster.env.MY_FLAG=1",
        ],
        [
            "action=plan",
            f"run.dir={runs[1]}",
            "cluster=slurm_dev",
            "+cluster.sbatch_extra.arr=0-3",
            "+cluster.sbatch_extra.err=/tmp/e",
            "+cluster.sbatch_extra.constraint=fast",
        ],
        ["action=plan", f"run.dir={runs[2]}", "train.profile_steps=[5,2]"],
    ]
    env, sbatch, profile = meshrun_many(cases, tmp_path)
    assert env.returncode == 2, env.stderr
    for name in ("PYTHONPATH", "MESHRUN_RUN_DIR", "PYTHONSAFEPATH"):
        assert f"cluster.env.{name}" in env.stderr, env.stderr
    assert "MY_FLAG" not in env.stderr
    assert sbatch.returncode == 2, sbatch.stderr
    assert "sbatch_extra.arr abbreviates --array" in sbatch.stderr, sbatch.stderr
    assert "sbatch_extra.err abbreviates --error" in sbatch.stderr
    assert "constraint" not in sbatch.stderr.split("sbatch_extra.err")[1].split("\n")[0]
    assert profile.returncode == 2 and "train.profile_steps" in profile.stderr, profile.stderr
    assert not any((run / "config.json").exists() for run in runs)
    from launcher.slurm.sbatch import reserved_option

    assert [reserved_option(k) for k in ("arr", "err", "ti", "nod", "constraint", "mem-per-gpu", "gres")] == [
        "array",
        "error",
        "time",
        "nodes",
        "",
        "",
        "",
    ]


def test_prepare_refuses_an_existing_dataset_and_the_tokenizer_sha_is_checked(tmp_path):
    from launcher.data.prepare import prepare
    from launcher.data.prepare.config import PrepareConfig
    from training.contract.tokenizer import TokenizerError, load_tokenizer
    from training.data.sources import DataError

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"document {i} says hello world\n\n" for i in range(50)))
    out = str(tmp_path / "data" / "ds")
    pc = PrepareConfig(inputs=[str(corpus)], output=out, tokenizer="bpe", vocab_size=300, workers=1, progress=False)
    prepare(pc)
    from launcher.data.datasets import resolve_indexed
    from training.contract.config import Config
    from training.hf.tokenizer_files import run_tokenizer

    run_cfg = Config()
    run_cfg.data.kind, run_cfg.data.prefixes = "indexed", [out]
    resolve_indexed(run_cfg, ["model.vocab_size=300"])  # the run's first launch records the tokenizer
    assert run_cfg.data.tokenizer_sha256 == _sha(out + ".tokenizer.json")
    files = {n: _sha(os.path.join(tmp_path, "data", n)) for n in os.listdir(tmp_path / "data")}
    with pytest.raises(DataError, match="already holds a dataset.*prepare.overwrite=true"):
        prepare(PrepareConfig(**{**pc.__dict__, "vocab_size": 280}))
    assert {n: _sha(os.path.join(tmp_path, "data", n)) for n in os.listdir(tmp_path / "data")} == files
    prepare(PrepareConfig(**{**pc.__dict__, "vocab_size": 280, "overwrite": True}))
    assert load_tokenizer(out).vocab_size == 280
    # The run that trained on the old dataset: a relaunch exits 2, export/generate refuse the new tokenizer.
    with pytest.raises(SystemExit) as stop:
        resolve_indexed(run_cfg, ["model.vocab_size=300"])
    assert stop.value.code == 2
    with pytest.raises(TokenizerError, match="prepared again with another tokenizer"):
        run_tokenizer(run_cfg)
    # A tokenizer file replaced behind the description's back is refused wherever it is read by prefix.
    with open(out + ".tokenizer.json") as f:
        tok = json.load(f)
    tok["added_tokens"][0]["content"] = "<|other|>"
    with open(out + ".tokenizer.json", "w") as f:
        json.dump(tok, f)
    with pytest.raises(TokenizerError, match="is not the tokenizer .* was prepared with"):
        load_tokenizer(out)
    # A description naming its own dataset as the tokenizer: an error, not a RecursionError.
    with open(out + ".json") as f:
        desc = json.load(f)
    desc["tokenizer"] = {"name": out}
    with open(out + ".json", "w") as f:
        json.dump(desc, f)
    with pytest.raises(TokenizerError, match="which is a dataset, not a tokenizer file"):
        load_tokenizer(out)


def _last_step(run) -> int:
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return 0
    return max((int(r.get("step", 0)) for r in rows), default=0)


def _training_rank(launcher: subprocess.Popen):
    """The launcher's rank once it catches the stop signals (its checkpoint manager exists: a stop from now on
    saves the step it trains)."""
    import signal as sig

    from launcher.ranks.exits import catches
    from launcher.ranks.proc_tree import children

    def ready():
        kids = [pid for pid in children(launcher.pid) if catches(pid, sig.SIGUSR2) and catches(pid, sig.SIGTERM)]
        return kids[0] if kids else None

    return wait_for(ready, 240, "the rank to install its stop handlers")


def _status(run, cwd):
    return json.loads(run_cli("action=status", f"run.dir={run}", cwd=str(cwd)).stdout)


@pytest.mark.slow  # trains (the module's `trained` run)
def test_local_launcher_signals_rank_kill_and_dead_launcher(trained, tmp_path):
    """SIGINT to a local launcher saves and stops like action=cancel and says how to resume; a rank killed with
    SIGKILL is exit 1 (in the table) with the reason in status; after SIGKILL of the launcher its ranks save and
    stop, and a relaunch takes the lock over; logs.rank beyond the world size is exit 2."""
    import signal as sig

    run = _copy(trained, tmp_path, "signals")

    def launch():
        return subprocess.Popen(
            [PYTHON, "-m", "launcher", f"run.dir={run}", "train.steps=500", "+cluster.env.MESHRUN_PACE_STEP_S=2"],
            cwd=str(tmp_path),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    # 1. Ctrl-C: a checkpoint of the step just trained, `cancelled`, the resume command, no traceback.
    first = launch()
    _training_rank(first)
    first.send_signal(sig.SIGINT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 130, err[-3000:]
    latest = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert latest > 2 and f"checkpoint step_{latest}" in err and f"Resume with: meshrun run.dir={run}" in err, err
    assert "Traceback" not in err and "Traceback" not in (run / "logs" / "rank_0.log").read_text()
    status = _status(run, tmp_path)
    assert status["state"] == "CANCELLED" and "interrupted by SIGINT" in status["reason"], status

    # 2. A rank killed with SIGKILL: exit 1 (not 247), the reason in the event and in status.
    second = launch()
    pid = _training_rank(second)
    os.kill(pid, sig.SIGKILL)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 1 and "rank 0 was killed by SIGKILL" in err, (second.returncode, err[-2000:])
    status = _status(run, tmp_path)
    assert status["state"] == "FAILED" and "killed by SIGKILL" in status["reason"], status

    # 3. The launcher killed with SIGKILL: its rank saves and stops; a relaunch takes the dead holder over.
    third = launch()
    _training_rank(third)
    before = (run / "checkpoints" / "latest").read_text()
    third.kill()
    third.communicate(timeout=60)
    plan = wait_for(
        lambda: (lambda p: p if p.returncode == 0 else None)(
            run_cli("action=plan", f"run.dir={run}", cwd=str(tmp_path))
        ),
        120,
        "the relaunch to take the run over",
    )
    assert "is an existing run" in plan.stderr
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(ev["event"] == "lock_taken_over" and "its process is gone" in ev["reason"] for ev in events)
    assert events[-2]["event"] == "checkpoint" and events[-2]["reason"] == "SIGTERM"
    assert (run / "checkpoints" / "latest").read_text() != before

    logs = run_cli("action=logs", f"run.dir={run}", "logs.rank=1", cwd=str(tmp_path))
    assert logs.returncode == 2 and "has 1 ranks" in logs.stderr, logs.stderr


def test_read_only_run_dir_exits_2(tmp_path, capsys):
    """A run.dir on a read-only file system (a real read-only tmpfs) is exit 2 with the fix, not a traceback
    (the launcher's claim of run.dir, the first thing a train or plan does, called directly)."""
    from launcher.launch.claim import claim_run_dir

    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        (mnt / "empty").mkdir()
        assert os.system(f"mount -o remount,ro {mnt}") == 0
        for run in (mnt / "empty", mnt / "new" / "run"):
            with pytest.raises(SystemExit) as stop:
                claim_run_dir(str(run))
            assert stop.value.code == 2
            err = capsys.readouterr().err
            assert "writable" in err or "cannot be written" in err, err
    finally:
        os.system(f"umount {mnt}")
