"""The in-job restart's shortcuts (launcher/slurm/rank_task.py _StepEnder, launcher/slurm/in_job.py
preflight_passed, training/preflight/runner.py): real processes and files, no Slurm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.slurm import in_job
from launcher.slurm.rank_task import STEP_END_GRACE_S, _StepEnder, peers_gone
from training.contract.slurm_env import PREFLIGHT_PASSED_ENV
from training.preflight.runner import passed_earlier, step_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/slurm/this file


def _record(adir, rank, **kw):
    with open(os.path.join(adir, f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, **kw}, f)


def _child():
    # A rank stuck in a collective: ignores SIGTERM (as the engine's handler does while it is blocked).
    return subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
    )


def test_step_ender_kills_a_stuck_rank_only_when_a_peer_is_gone(tmp_path):
    adir = str(tmp_path)
    # A lost node: ranks 2, 3 never wrote a record; the survivors wrote their provisional SIGTERM records.
    for r in (0, 1):
        _record(adir, r, exit_code=-15, provisional=True)
    assert peers_gone(adir, 4) == [2, 3]
    child = _child()
    ender = _StepEnder(adir, 4, child.pid)
    t0 = time.time()
    ender.on_sigterm()
    code = child.wait(timeout=30)
    took = time.time() - t0
    assert code == -signal.SIGKILL and ender.gone == [2, 3]
    assert STEP_END_GRACE_S - 0.2 <= took < 30

    # A SIGTERM to the whole job: every rank writes its provisional record; nobody is killed (they save).
    for r in (2, 3):
        _record(adir, r, exit_code=-15, provisional=True)
    child = _child()
    ender = _StepEnder(adir, 4, child.pid)
    ender.on_sigterm()
    ender.thread.join(timeout=30)
    assert child.poll() is None and ender.gone == []
    child.kill()
    child.wait()

    # A crashed peer (its final record says so) with the others stuck: they are ended after the grace.
    _record(adir, 3, exit_code=1, error="RuntimeError: boom")
    assert peers_gone(adir, 4) == [3]
    child = _child()
    ender = _StepEnder(adir, 4, child.pid)
    ender.on_sigterm()
    assert child.wait(timeout=30) == -signal.SIGKILL and ender.gone == [3]


def test_preflight_is_reused_only_within_the_allocation():
    events = [
        {"event": "started", "attempt": 0, "job_id": "7", "restart_count": 0},
        {"event": "preflight", "attempt": 0, "job_id": "7", "nodes": {"n1": "warn", "n2": "fail"}, "bad_nodes": ["n2"]},
        {"event": "started", "attempt": 1, "job_id": "7", "restart_count": 0},
        {"event": "preflight", "attempt": 1, "job_id": "7", "nodes": {"n1": "ok", "n3": "ok"}, "bad_nodes": []},
        # a requeued allocation of the same job id: its preflight is not this allocation's
        {"event": "started", "attempt": 2, "job_id": "7", "restart_count": 1},
        {"event": "preflight", "attempt": 2, "job_id": "7", "nodes": {"n4": "ok"}, "bad_nodes": []},
    ]
    assert in_job.preflight_passed(events, "7", 0) == ["n1", "n3"]
    assert in_job.preflight_passed(events, "7", 1) == ["n4"]
    assert in_job.preflight_passed(events, "8", 0) == []
    env = {PREFLIGHT_PASSED_ENV: "n1,n3", "SLURM_STEP_NODELIST": "n[1,3]"}
    assert passed_earlier(env) == ["n1", "n3"] and step_nodes(env) == ["n1", "n3"]
    assert passed_earlier({}) == []


def test_preflight_not_run_when_every_node_of_the_step_passed(tmp_path, monkeypatch):
    """A restart in place: before_training returns before any process group or check (no rank env here:
    running the preflight would fail)."""
    from training.contract.config import Config
    from training.preflight.runner import before_training

    cfg = Config()
    cfg.cluster.preflight.mode = "gate"
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n[1,3]")
    monkeypatch.setenv(PREFLIGHT_PASSED_ENV, "n3,n1")
    before_training(cfg, str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.slow  # 4 CPU ranks started by the CLI
def test_preflight_checks_only_the_new_node_and_every_rank_s_links(tmp_path):
    """A restart onto a spare: the node that passed earlier gets no node checks or matmul; the new node does,
    and the collectives run over every rank (the spare's links)."""
    import socket

    run_dir = str(tmp_path / "run")
    old = f"{socket.gethostname().split('.')[0]}-0"  # launcher/launch/preflight.py's fake node names
    env = {**os.environ, PREFLIGHT_PASSED_ENV: old}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "action=preflight",
            "cluster=local",
            "cluster.nodes=2",
            "cluster.gpus_per_node=2",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.load(open(os.path.join(run_dir, "preflight.json")))
    assert data["meta"]["reused_nodes"] == [old] and data["bad_nodes"] == []
    by = {}
    for c in data["checks"]:
        by.setdefault(c["name"], []).append(c)
    assert [c["node"] for c in by["preflight.reused"]] == [old]
    assert {c["node"] for c in by["gpu.nvml"]} == {f"{old[:-2]}-1"}  # node checks on the new node only
    mm = by["gpu.matmul"] + by.get("gpu.straggler", [])
    assert sorted(c["subject"] for c in mm) == ["rank2", "rank3"]
    assert sorted(c["subject"] for c in by["coll.all_reduce"]) == ["ranks[0-1]", "ranks[0-3]", "ranks[2-3]"]
