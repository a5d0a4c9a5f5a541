"""Fault-and-abuse matrix, engine side: one test per scenario, each through the real rank entry point
(training/main.py's main(RUN_DIR), one process) on a run directory with real checkpoints, asserting
what is lost (nothing beyond the last good checkpoint), what is written, the exit code and the message.

The entry point runs in a rank forked from training/run/local_ranks.py's forkserver (torch and the engine already
imported; its stderr file descriptor captured), not in a fresh interpreter each time: the SIGTERM test keeps
`python -m training.main RUN_DIR` in a subprocess, where the signal and the exit code cross the process boundary.

The launcher and Slurm scenarios (locks, sbatch script, requeue) live in the launcher's and Slurm's tests;
the validation scenarios here go through `meshrun` itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from helpers import ROOT
from helpers.dist import run_distributed

from training.checkpoint import storage
from training.contract.config import Config, config_to_dict
from training.contract.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_STOPPED
from training.contract.rundir.events import read_events

# Checkpoints at steps 10 and 20. The SIGTERM test holds the rank before its 4th step until the signal has
# arrived, so the run need not be long for the signal to land mid-run.
STEPS, EVERY = 20, 10


def _cfg() -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    p = cfg.parallel
    p.tp, p.dp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, 1, False, 0, 2, 8
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.checkpoint_every, t.keep_last = STEPS, 3, False, EVERY, 5
    cfg.data.kind, cfg.data.max_bytes = "text", 60_000
    return cfg


def _write_config(run_dir: str, **train) -> None:
    cfg = _cfg()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_to_dict(cfg), f)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MESHRUN_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@dataclass
class _Exit:
    """What a launch of the entry point gives the assertions (subprocess.CompletedProcess's names)."""

    returncode: int
    stderr: str


def _main_in_rank(run_dir: str, stderr_path: str) -> int:
    """training.main's main() in this rank as `python -m training.main RUN_DIR` runs it, with the environment
    _env() gives a subprocess and everything written to file descriptor 2 kept in stderr_path."""
    for key in [k for k in os.environ if k.startswith(("SLURM_", "MESHRUN_"))]:
        del os.environ[key]
    from training.main import main

    sys.stderr.flush()
    saved = os.dup(2)
    with open(stderr_path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            return int(main([run_dir]) or 0)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _launch(run_dir: str, **train) -> _Exit:
    _write_config(run_dir, **train)
    stderr_path = run_dir.rstrip(os.sep) + ".stderr"
    (code,) = run_distributed(_main_in_rank, 1, args=(run_dir, stderr_path), timeout_s=300)
    with open(stderr_path) as f:
        return _Exit(code, f.read())


def _losses(run_dir: str) -> dict[int, float]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _digest(directory: str) -> dict[str, str]:
    out = {}
    for root, _d, names in os.walk(directory):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The uninterrupted run: its losses are the reference; it leaves checkpoints step_10 and step_20."""
    run_dir = str(tmp_path_factory.mktemp("base") / "run")
    p = _launch(run_dir)
    assert p.returncode == EXIT_OK, p.stderr[-3000:]
    assert storage.history(run_dir) == [STEPS, EVERY]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return run_dir, losses


def _copy(base_dir: str, dst: str) -> str:
    """A run dir holding only the base run's checkpoints (no metrics: every row read later is new)."""
    shutil.copytree(storage.checkpoints_dir(base_dir), storage.checkpoints_dir(dst))
    return dst


def _reseal(directory: str) -> None:
    path = os.path.join(directory, storage.MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"] = storage.build_manifest(directory)
    storage.write_json_durable(path, manifest)


class _RunsCommand:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


@pytest.mark.slow  # base trains (training.main in a rank)
def test_crafted_metadata_pickle_exits_2_and_runs_nothing(base, tmp_path):
    run = _copy(base[0], str(tmp_path / "run"))
    canary = tmp_path / "canary"
    newest = storage.step_dir(run, STEPS)
    with open(os.path.join(newest, storage.DCP_METADATA), "wb") as f:
        pickle.dump(_RunsCommand(f"touch {canary}"), f)
    _reseal(newest)  # an attacker who can write run.dir can fix the manifest too
    before = _digest(storage.checkpoints_dir(run))
    p = _launch(run)
    assert p.returncode == EXIT_INVALID, p.stderr[-3000:]
    assert "posix.system" in p.stderr and "refused unread (nothing in it ran)" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not canary.exists()  # the payload never ran
    assert _digest(storage.checkpoints_dir(run)) == before  # nothing deleted, moved or rewritten
    assert _losses(run) == {}  # nothing trained on top of a checkpoint that could not be trusted


@pytest.mark.slow  # base trains (training.main in a rank)
def test_same_size_shard_damage_resumes_the_previous_checkpoint(base, tmp_path):
    base_dir, ref = base
    run = _copy(base_dir, str(tmp_path / "run"))
    newest = storage.step_dir(run, STEPS)
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    with open(os.path.join(newest, shard), "r+b") as f:  # flip bytes in the middle: the size stays
        f.seek(os.path.getsize(f.name) // 2)
        f.write(b"\xff" * 64)
    p = _launch(run)
    assert p.returncode == EXIT_OK, p.stderr[-3000:]
    assert f"checkpoint step_{STEPS} is incomplete or corrupt, skipped: {shard} checksum mismatch" in p.stderr
    assert f"resumed at step {EVERY}" in p.stderr
    # Lost: only the steps after the last good checkpoint, trained again to the same losses.
    assert _losses(run) == {s: ref[s] for s in range(EVERY + 1, STEPS + 1)}
    bad = [e for e in read_events(run) if e["event"] == "checkpoint_invalid"]
    assert [e["step"] for e in bad] == [STEPS]
    # The damaged directory is kept for inspection (abandoned/), not deleted; the new last checkpoint is whole.
    abandoned = os.listdir(os.path.join(storage.checkpoints_dir(run), storage.ABANDONED))
    assert [n.split("_")[1] for n in abandoned] == [str(STEPS)]
    assert storage.verify(storage.step_dir(run, STEPS)).ok and storage.history(run) == [STEPS, EVERY]


@pytest.mark.slow  # base trains (training.main in a rank)
def test_symlink_in_checkpoint_with_explicit_resume_exits_2(base, tmp_path):
    run = _copy(base[0], str(tmp_path / "run"))
    newest = storage.step_dir(run, STEPS)
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    outside = str(tmp_path / "outside.distcp")
    os.replace(os.path.join(newest, shard), outside)
    os.symlink(outside, os.path.join(newest, shard))  # same bytes, but from outside the checkpoint
    p = _launch(run, resume=str(STEPS))
    assert p.returncode == EXIT_INVALID, p.stderr[-3000:]
    assert f"train.resume={STEPS}: checkpoint step_{STEPS} is damaged (symlinks are not allowed" in p.stderr, p.stderr[
        -2000:
    ]
    assert "Traceback" not in p.stderr and _losses(run) == {}
    assert os.path.exists(outside) and storage.list_steps(run) == [STEPS, EVERY]  # nothing followed or deleted


@pytest.mark.slow  # base trains (training.main in a rank)
def test_rollback_is_never_undone_by_auto_and_keeps_the_newer_checkpoints(base, tmp_path):
    base_dir, ref = base
    run = _copy(base_dir, str(tmp_path / "run"))
    old_last = _digest(storage.step_dir(run, STEPS))
    stop = (EVERY + STEPS) // 2
    first = _launch(run, resume=str(EVERY), exit_interval=stop)
    assert first.returncode == EXIT_STOPPED, first.stderr[-3000:]
    assert f"rolled back to step_{EVERY}: checkpoints ['step_{STEPS}'] are off the line now" in first.stderr
    assert storage.history(run) == [stop, EVERY] and storage.read_latest(run) == stop
    # The abandoned line's last checkpoint is kept whole, under abandoned/, never resumed.
    base_abandoned = os.path.join(storage.checkpoints_dir(run), storage.ABANDONED)
    (name,) = os.listdir(base_abandoned)
    assert name.startswith(f"step_{STEPS}_") and _digest(os.path.join(base_abandoned, name)) == old_last
    second = _launch(run)  # train.resume=auto: a requeue, or the user's next launch
    assert second.returncode == EXIT_OK, second.stderr[-3000:]
    assert f"resumed at step {stop}" in second.stderr
    assert _losses(run) == {s: ref[s] for s in range(EVERY + 1, STEPS + 1)}  # the same run, continued exactly
    assert [e["step"] for e in read_events(run) if e["event"] == "resumed"] == [EVERY, stop]
    assert os.listdir(base_abandoned) == [name]


# The rank waits before its 4th step until the stop signal has arrived (at most 120 s): the signal lands
# mid-run however slow or fast the machine is, instead of within a few seconds' window of a short run.
HOLD_FOR_SIGNAL = """import sys
if "training.main" in getattr(sys, "orig_argv", []):
    import time
    import training.run.loop
    from training.run import signals
    real = training.run.loop.Trainer.train_step

    def step(self, *args, **kwargs):
        if self.state.step == 3:
            deadline = time.monotonic() + 120
            while signals.received() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(self, *args, **kwargs)

    training.run.loop.Trainer.train_step = step
"""


@pytest.mark.slow  # base trains (training.main in a rank)
def test_sigterm_stops_at_a_checkpoint_and_resumes_exactly(base, tmp_path):
    _, ref = base
    run = str(tmp_path / "run")
    _write_config(run)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(HOLD_FOR_SIGNAL)
    env = _env()
    env["PYTHONPATH"] = f"{inject}{os.pathsep}{env['PYTHONPATH']}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.main", run],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while len(_losses(run)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    trained = max(_losses(run))
    assert 3 <= trained < STEPS
    assert f"SIGTERM received: saving step {trained} and stopping (exit {EXIT_STOPPED})" in err
    # Nothing lost: the checkpoint is the last step trained.
    assert storage.read_latest(run) == trained and storage.verify(storage.step_dir(run, trained)).ok
    events = read_events(run)
    assert any(e["event"] == "signal" and e["name"] == "SIGTERM" and e["step"] == trained for e in events)
    p = _launch(run)
    assert p.returncode == EXIT_OK, p.stderr[-3000:]
    assert _losses(run) == ref  # every step, before and after the stop, exactly as the uninterrupted run


def _assert_refused_before_anything_starts(p, run, key) -> None:
    assert p.returncode == EXIT_INVALID, p.stderr[-2000:]
    assert f"error: {key}:" in p.stderr and "nothing was launched" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    written: list[str] = os.listdir(run) if run.exists() else []
    assert not [n for n in written if n not in (".hydra",)], written  # no config.json, no checkpoints


# The message checks run the console entry point in this process (tests/helpers/cli.py); one case also goes
# through `python -m launcher` in a subprocess, where the exit code crosses the process boundary.
@pytest.mark.parametrize(
    "override,key",
    [
        ("train.lr=nan", "train.lr"),
        ("train.min_lr=-inf", "train.min_lr"),
        ("cluster.master_port=22", "cluster.master_port"),
    ],
)
def test_invalid_value_exits_2_before_anything_starts(tmp_path, monkeypatch, override, key):
    from helpers.cli import run_cli

    for name in list(os.environ):
        if name.startswith(("SLURM_", "MESHRUN_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    run = tmp_path / "run"
    _assert_refused_before_anything_starts(run_cli(override, f"run.dir={run}", cwd=str(tmp_path)), run, key)


def test_invalid_value_exits_2_from_a_subprocess(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "launcher", "train.lr=nan", f"run.dir={run}"],
        cwd=str(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_refused_before_anything_starts(p, run, "train.lr")
