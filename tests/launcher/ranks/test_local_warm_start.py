"""Warm rank starts of a local launch (launcher/ranks/warm/local.py, training/run/warm_agent.py --local): one
agent per launch forks the ranks, which are then the ranks a cold launch starts as far as the launcher, the lock,
the stop paths and the losses can tell; an agent that cannot serve leaves every rank to a cold start, visibly.

Four tiny 2-rank launches, real processes: a cold one and a forced fallback (3 steps each, their losses the
reference), a warm one stopped by action=cancel and, on the same run directory, a warm one whose launcher is
killed with SIGKILL.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time

import pytest
from helpers import ROOT
from helpers.cli import run_cli
from helpers.local_run import PYTHON, wait_for

TINY = [
    "data=synthetic",
    "parallel=single",
    "cluster=local",
    "cluster.gpus_per_node=2",
    "parallel.dp=2",
    "model.num_layers=2",
    "model.seq_length=32",
    "parallel.global_batch=4",
    "parallel.micro_batch=1",
    "cluster.peak_tflops=1",
    "train.tensorboard=false",
    "train.progress=false",
    "train.log_every=1",
]
STEPS = 3


def _launch(run, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "launcher", *TINY, f"run.dir={run}", *overrides],
        cwd=str(run.parent),
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _events(run, name=None):
    try:
        rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return []
    return [ev for ev in rows if name is None or ev["event"] == name]


def _losses(run):
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:  # no step logged yet
        return {}
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _status_field(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return line.split()[1]
    return ""


def _alive(pid: int) -> bool:
    try:
        return _status_field(pid, "State") not in ("Z", "X")
    except OSError:
        return False


def _lock_free(run) -> bool:
    """Whether nobody holds the run directory's kernel lock (the flock the launcher took and its ranks keep)."""
    fd = os.open(run / ".meshrun.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _warm_ranks(run, launcher: subprocess.Popen, attempt: int):
    """(agent pid, rank pids) of a warm launch, once both ranks catch the stop signals and 3 steps are logged."""
    from launcher.ranks.exits import catches
    from launcher.ranks.proc_tree import children

    started = wait_for(
        lambda: [ev for ev in _events(run, "ranks_started") if ev["attempt"] == attempt] or launcher.poll() is not None,
        240,
        "the ranks to be forked",
    )
    assert launcher.poll() is None, launcher.communicate()
    assert started[0]["warm_ranks"] == [0, 1], started
    agent = started[0]["agent_pid"]

    def ready():
        kids = [p for p in children(agent) if catches(p, signal.SIGUSR2) and catches(p, signal.SIGTERM)]
        logged = max([s for s, _ in _losses(run).items()], default=0) >= STEPS * (attempt + 1)
        return kids if len(kids) == 2 and logged else None

    return agent, wait_for(ready, 240, "both ranks to train")


def _another_python_is_refused(agent: int) -> None:
    """The agent serves only its own interpreter's ranks (another one would run other code): a request naming
    another python gets an error and no fork."""
    import socket

    from training.contract.warm_start import recv, send

    with open(f"/proc/{agent}/environ", "rb") as f:  # the name is in its environment (its argv is everyone's)
        (name,) = [
            v[len(b"MESHRUN_WARM_AGENT_NAME=") :].decode()
            for v in f.read().split(b"\0")
            if v.startswith(b"MESHRUN_WARM_AGENT_NAME=")
        ]
    request = {"env": {}, "run_dir": "/nonexistent", "cwd": "/", "umask": 0o22, "python": "/other/bin/python"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + name)
        send(sock, request, [0, 1, 2])
        sock.settimeout(30)
        reply, _ = recv(sock)
    assert "pid" not in reply and "is not the agent's" in reply.get("error", ""), reply


@pytest.fixture(scope="module")
def cold_losses(tmp_path_factory):
    """A cold launch (cluster.warm_start=false): no agent, the reference losses."""
    run = tmp_path_factory.mktemp("warm") / "cold"
    proc = _launch(run, f"train.steps={STEPS}", "cluster.warm_start=false")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert not _events(run, "warm_agent") and not _events(run, "ranks_started")
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow  # two real warm launches
def test_warm_ranks_are_the_agents_children_hold_the_lock_and_stop_as_cold_ones(cold_losses, tmp_path):
    """The agent (the launcher's child) forks both ranks: their parent is the agent, their command line and
    environment are the ranks', their output is in the rank logs, they keep the run's lock, their losses are the
    cold launch's bit for bit, the agent refuses another python; action=cancel saves and stops them; on the same run directory, a launcher killed
    with SIGKILL leaves its ranks to stop through SIGTERM (a checkpoint) while they alone hold the lock, then
    the agent leaves and the lock is free."""
    from launcher.ranks.proc_tree import children

    run = tmp_path / "run"
    # Paced steps (MESHRUN_PACE_STEP_S, training/run/pacing.py): the ranks idle between steps while the test looks at them, instead of
    # training on the cores the other tests share.
    first = _launch(run, "train.steps=400", "+cluster.env.MESHRUN_PACE_STEP_S=0.5")
    agent, ranks = _warm_ranks(run, first, 0)
    assert int(_status_field(agent, "PPid")) == first.pid
    envs = {}
    for pid in ranks:
        assert int(_status_field(pid, "PPid")) == agent != first.pid
        assert os.getsid(pid) == pid  # a session of its own, as a cold rank
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[:4] == [PYTHON.encode(), b"-m", b"training.main", str(run).encode()]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)
        envs[int(env["RANK"])] = env
        assert env["MESHRUN_WARM_AGENT_PID"] == str(agent) and env["MESHRUN_LAUNCHER_PID"] == str(first.pid)
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        assert str(run / ".meshrun.lock") in fds  # the launcher's locked file, kept open
    assert sorted(envs) == [0, 1] and not _lock_free(run)
    _another_python_is_refused(agent)
    assert sorted(children(agent)) == sorted(ranks)
    assert {s: _losses(run)[s] for s in cold_losses} == cold_losses

    cancel = run_cli("action=cancel", f"run.dir={run}", cwd=str(tmp_path))
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    out, err = first.communicate(timeout=300)
    assert first.returncode == 3, err[-3000:]  # stopped after a checkpoint (exit 3), as cold ranks are
    cancelled = _events(run, "cancelled")
    assert len(cancelled) == 1 and not cancelled[0].get("forced"), cancelled
    assert _events(run, "checkpoint")[-1]["reason"] == "SIGUSR2"
    assert not _alive(agent) and not any(_alive(p) for p in ranks) and _lock_free(run)
    log = (run / "logs" / "rank_0.log").read_text()  # the rank's stdout and stderr, through the launcher's pipe
    assert log.startswith("===== meshrun attempt 0") and "summary: " in log and "SIGUSR2" in log, log[-2000:]
    assert "summary: " in err  # rank 0's output also on the launcher's stderr

    second = _launch(run, "train.steps=400", "+cluster.env.MESHRUN_PACE_STEP_S=0.5")
    agent, ranks = _warm_ranks(run, second, 1)
    before = len(_events(run, "checkpoint"))
    second.kill()
    second.wait()
    held_by_ranks_alone = False
    deadline = time.time() + 120
    while any(_alive(p) for p in ranks) and time.time() < deadline:
        free = _lock_free(run)
        alive = any(_alive(p) for p in ranks)
        assert not (free and alive), "the lock was free while a rank lived"
        held_by_ranks_alone = held_by_ranks_alone or (alive and not free)
        time.sleep(0.02)
    assert held_by_ranks_alone and not any(_alive(p) for p in ranks)
    saved = _events(run, "checkpoint")[before:]
    assert saved and saved[-1]["reason"] == "SIGTERM", saved
    wait_for(lambda: not _alive(agent), 30, "the agent to leave after its launcher's death")
    assert _lock_free(run)


@pytest.mark.slow  # one real launch
def test_an_agent_that_cannot_serve_leaves_every_rank_cold_and_the_run_completes(cold_losses, tmp_path):
    """OpenBLAS threads (cluster.env) make the agent unsafe to fork from: it says so, each rank starts cold with
    its `warm_start_missed`, and the run completes with the cold launch's losses."""
    run = tmp_path / "run"
    proc = _launch(run, f"train.steps={STEPS}", "+cluster.env.OPENBLAS_NUM_THREADS=2")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    agent = _events(run, "warm_agent")
    assert len(agent) == 1 and agent[0]["ready"] is False and "threads" in agent[0]["reason"], agent
    missed = _events(run, "warm_start_missed")
    assert sorted(ev["rank"] for ev in missed) == [0, 1] and all("threads" in ev["reason"] for ev in missed), missed
    assert "rank 1 starts cold" in err
    assert _events(run, "ranks_started")[0]["warm_ranks"] == []
    assert _events(run, "completed") and _losses(run) == cold_losses
