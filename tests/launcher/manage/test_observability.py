"""Observability and run management (docs/USER_CONTRACTS.md "Observability"): metrics rows with time and attempt and the
job-wide figures, TensorBoard read back with tensorboard's own EventAccumulator (one loss per step across a stop
and a resume), W&B off unless asked for, the progress line, `action=status` (progress fields, table),
`action=logs` and `action=cancel` on local runs. The Slurm side is tests/slurm/test_logs_cancel_slurm.py.

Training runs and `action=logs logs.follow=true` (which must outlive the command that cancels) are real processes;
status, logs, cancel and the W&B refusal run the same CLI in this process (tests/helpers/cli.py)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import time

import pytest
from helpers import ROOT
from helpers.cli import run_cli
from helpers.local_run import PYTHON, TINY_RUN

from launcher.manage.status_table import format_table
from training.contract.rundir.paths import PURGED_FILE
from training.observe.metrics import purge_after
from training.observe.progress import Progress, format_duration

# One rank, a tiny model, random tokens: the launches below are about the files, not the numbers.
TINY = [*TINY_RUN, "cluster.peak_tflops=1"]


def meshrun(*args: str, cwd: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [PYTHON, "-m", "launcher", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **kw
    )


def rows(path: str):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---- units ---------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_without_terminal_prints_every_n_seconds_not_every_5_percent():
    out, clock = io.StringIO(), Clock()
    bar = Progress(1000, True, every_s=10.0, stream=out, clock=clock)
    for step in range(1, 1001):
        clock.now += 0.1  # 100 s in all: 10 lines by time (the first step's included), not 20 by steps
        bar.update(step, "loss 1.0")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[") and " 1/1000 " in lines[0]
    assert " 1000/1000 " in lines[-1]
    assert 10 <= len(lines) <= 12, lines
    assert "elapsed" in lines[-1] and "left" in lines[-1]


def test_progress_on_a_terminal_is_one_bar_with_elapsed_and_eta():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out, clock = Tty(), Clock()
    bar = Progress(10, True, stream=out, clock=clock, start_step=4)  # a resumed attempt: pace from its own steps
    clock.now = 2.0
    bar.update(5, "loss 1.0")
    text = out.getvalue()
    assert text.startswith("\r") and "\n" not in text
    assert "0:02 elapsed, 0:10 left" in text  # 2 s per step, 5 steps left
    assert format_duration(3725) == "1:02:05" and format_duration(None) == "?"
    bar.note("step 5: eval loss 0.9000 (0.1 s)")  # replaces the bar's line, then the bar comes back below it
    bar.update(6, "loss 0.9")
    assert out.getvalue()[len(text) :].startswith("\r\x1b[Kstep 5: eval loss 0.9000 (0.1 s)\n\r[")


def test_progress_notes_are_plain_lines_without_a_terminal():
    out = io.StringIO()
    bar = Progress(10, True, stream=out, clock=Clock(), every_s=30)
    bar.update(1, "loss 1.0")
    bar.update(2, "loss 0.9")  # within every_s: not printed
    bar.note("step 2: eval loss 0.8000 (0.1 s)")
    assert out.getvalue().splitlines()[-1] == "step 2: eval loss 0.8000 (0.1 s)" and "\r" not in out.getvalue()
    Progress(10, False, stream=out).note("hidden")
    assert "hidden" not in out.getvalue()


def test_purge_moves_rows_after_the_checkpoint_and_loses_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5')
    assert purge_after(str(tmp_path), 2) == 3  # steps 3, 4 and the torn line of a killed attempt
    assert [r["step"] for r in rows(str(path))] == [1, 2]
    assert (tmp_path / PURGED_FILE).read_text().count("\n") == 3
    assert purge_after(str(tmp_path), 2) == 0


def test_status_table_shows_a_sweep_as_one_table():
    status = {
        "sweep_dir": "multirun/x",
        "states": {"RUNNING": 1, "SKIPPED": 1},
        "points": [
            {
                "num": 0,
                "overrides": ["parallel.tp=1"],
                "state": "RUNNING",
                "job_id": "12_0",
                "attempt": 1,
                "step": 40,
                "total_steps": 100,
                "last_loss": 2.5,
                "tokens_per_s": 12345.6,
                "eta_s": 90.0,
                "log": "/s/12_0_0_log.out",
            },
            {"num": 1, "overrides": ["parallel.tp=8"], "state": "SKIPPED", "reason": "tp=8 > heads"},
        ],
    }
    lines = format_table(status).splitlines()
    assert lines[0] == "sweep multirun/x: 2 point(s): 1 RUNNING, 1 SKIPPED"
    assert lines[1].split() == ["#", "OVERRIDES", "STATE", "JOB", "ATTEMPT", "STEP", "LOSS", "TOKENS/S", "ETA", "LOG"]
    assert lines[2].split() == [
        "0",
        "parallel.tp=1",
        "RUNNING",
        "12_0",
        "1",
        "40/100",
        "2.5000",
        "12,346",
        "1:30",
        "/s/12_0_0_log.out",
    ]
    assert lines[3].split()[:3] == ["1", "parallel.tp=8", "SKIPPED"] and lines[3].endswith("tp=8 > heads")


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is not None,
    reason="wandb is installed here: the message for a missing wandb cannot be shown",
)
def test_wandb_asked_for_but_not_installed_is_exit_2_with_the_fix(tmp_path):
    res = run_cli("train.wandb=true", f"run.dir={tmp_path / 'run'}", *TINY, cwd=str(tmp_path))
    assert res.returncode == 2, res.stderr
    assert "pip install wandb" in res.stderr and "train.wandb=false" in res.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()


# ---- runs ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensorboard_has_one_loss_per_step_across_a_stop_and_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    common = [f"run.dir={run}", "train.steps=6", "train.checkpoint_every=2", "train.progress_every_s=0"] + TINY
    first = meshrun(*common, "train.exit_interval=4", cwd=str(tmp_path))
    assert first.returncode == 3, first.stderr[-2000:]  # stopped at step 4 after a checkpoint
    # Resume from step 2: steps 3 and 4 of the first attempt are redone, so they must be purged.
    second = meshrun(f"run.dir={run}", "train.resume=2", "train.exit_interval=0", cwd=str(tmp_path))
    assert second.returncode == 0, second.stderr[-2000:]

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "memory/peak_bytes_max_over_ranks",
        "perf/step_time_slowest_rank_s",
        "perf/step_time_fastest_rank_s",
    } <= tags
    assert len(os.listdir(run / "tensorboard")) == 2  # one event file per attempt

    kept, purged = rows(str(run / "metrics.jsonl")), rows(str(run / PURGED_FILE))
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in purged] == [3, 4]
    assert [r["attempt"] for r in kept] == [0, 0, 1, 1, 1, 1]
    assert all(isinstance(r["time"], float) and abs(r["time"] - time.time()) < 3600 for r in kept)
    assert all(r["peak_memory_bytes"] > 0 and r["step_time_max_s"] >= r["step_time_min_s"] > 0 for r in kept)
    # TensorBoard holds what metrics.jsonl holds; the resumed steps reproduce the purged ones (same data order).
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in kept], rel=1e-6)
    assert [r["loss"] for r in kept[2:4]] == pytest.approx([r["loss"] for r in purged], rel=1e-5)
    assert not (run / "wandb.json").exists()  # W&B is off unless asked for

    status = json.loads(run_cli("action=status", f"run.dir={run}", cwd=str(tmp_path)).stdout)
    assert status["state"] == "COMPLETED" and status["step"] == 6 and status["total_steps"] == 6
    assert status["last_loss"] == pytest.approx(kept[-1]["loss"]) and status["eta_s"] is None
    assert status["log"] == str(run / "logs" / "rank_0.log")
    logs = run_cli("action=logs", f"run.dir={run}", cwd=str(tmp_path))
    assert logs.returncode == 0
    assert "===== meshrun attempt 0" in logs.stdout and "===== meshrun attempt 1" in logs.stdout
    assert logs.stdout.index("attempt 0") < logs.stdout.index("attempt 1")  # every attempt, newest last

    # Each attempt's start-up timeline (training/observe/startup.py), written by rank 0 after its first step.
    from training.contract.rundir.events import read_events

    startups = [e for e in read_events(str(run)) if e["event"] == "startup"]
    assert [(e["attempt"], e["step"]) for e in startups] == [(0, 1), (1, 3)]
    order = [
        "process_start",
        "imported",
        "process_group",
        "preflight",
        "built",
        "resumed",
        "observers",
        "first_batch",
        "first_step",
    ]
    for e in startups:
        assert set(e["marks"]) == set(order)  # no Slurm task wrapper here: no task_start
        stamps = [e["marks"][k] for k in order]
        assert stamps == sorted(stamps)  # (events.jsonl sorts keys: the order is the times')
        assert e["marks"]["first_step"] <= e["time"] + 0.001 and e["time"] - e["marks"]["process_start"] < 600
        assert 0 < e["cpu_s"] < 600


@pytest.mark.slow
def test_cancel_a_local_run_saves_stops_and_status_says_cancelled(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT)
    launch = subprocess.Popen(
        [PYTHON, "-m", "launcher", f"run.dir={run}", "train.steps=100000", "+cluster.env.MESHRUN_PACE_STEP_S=2", *TINY],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    follow = None
    try:
        deadline = time.time() + 300
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert time.time() < deadline and launch.poll() is None, "the run never logged a step"
            time.sleep(0.5)
        follow = subprocess.Popen(
            [PYTHON, "-m", "launcher", "action=logs", f"run.dir={run}", "logs.follow=true"],
            cwd=str(tmp_path),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        running = json.loads(run_cli("action=status", f"run.dir={run}", cwd=str(tmp_path)).stdout)
        assert running["state"] == "RUNNING" and running["total_steps"] == 100000 and running["eta_s"] > 0
        table = run_cli("action=status", f"run.dir={run}", "status.format=table", cwd=str(tmp_path)).stdout
        assert table.splitlines()[1].startswith("RUNNING  local")

        res = run_cli("action=cancel", f"run.dir={run}", cwd=str(tmp_path))
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == {str(run): "CANCELLED"}
        assert launch.wait(timeout=120) == 3  # stopped after a complete checkpoint
        out, _ = follow.communicate(timeout=120)  # following ends with the run
    finally:
        for proc in (launch, follow):
            if proc is not None and proc.poll() is None:
                proc.kill()
    status = json.loads(run_cli("action=status", f"run.dir={run}", cwd=str(tmp_path)).stdout)
    assert status["state"] == "CANCELLED"
    events = rows(str(run / "events.jsonl"))
    cancelled = [e for e in events if e["event"] == "cancelled"]
    assert len(cancelled) == 1 and not cancelled[0].get("forced")
    step = cancelled[0]["checkpoint_step"]
    assert step >= 1 and (run / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert any(e["event"] == "checkpoint" and e["step"] == step and e["reason"] == "SIGUSR2" for e in events)
    assert "SIGUSR2 received" in out and "summary:" in out
    again = run_cli("action=cancel", f"run.dir={run}", cwd=str(tmp_path))
    assert again.returncode == 0 and "already CANCELLED" in again.stderr
