"""The in-job restart's shortcuts (launcher/slurm/rank_task.py _StepEnder, launcher/slurm/in_job.py
preflight_passed, training/preflight/runner.py): real processes and files, no Slurm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from launcher.slurm import in_job
from launcher.slurm.rank_task import STEP_END_GRACE_S, _StepEnder, peers_gone
from training.contract.slurm_env import PREFLIGHT_PASSED_ENV
from training.preflight.runner import passed_earlier, step_nodes


def _record(adir, rank, **kw):
    with open(os.path.join(adir, f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, **kw}, f)


def _child():
    # A rank stuck in a collective: ignores SIGTERM (as the engine's handler does while it is blocked).
    return subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); time.sleep(60)"])


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
        {"event": "preflight", "attempt": 0, "job_id": "7", "nodes": {"n1": "warn", "n2": "fail"},
         "bad_nodes": ["n2"]},
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
