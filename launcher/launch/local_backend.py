"""cluster.kind=local: the ranks are processes of this machine, started by launcher/launch/local.py.

The backend launcher/launch/backend.py registers for `local`: a launch runs the ranks to their end, the run's
state is its launcher's own events (and whether that launcher still runs), the logs are run.dir/logs/rank_N.log,
and a cancel signals the ranks itself and waits for the launcher."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from launcher.plan.cluster_facts import LOCAL
from launcher.ranks.proc_tree import children
from launcher.records.readers import record_cancelled
from training.contract.config import Config
from training.contract.rundir.paths import RunPaths

POLL_S = 1.0


class LocalBackend:
    facts = LOCAL

    def checks(self, cfg: Config) -> list[str]:
        return []  # the machine checks (launcher/launch/host_checks.py) are the gate's for every kind

    def submit(self, cfg: Config, run_dir: str, plan_result: dict[str, Any], multirun: bool, queue: bool) -> dict:
        from launcher.launch.local import launch_local

        return launch_local(cfg, run_dir)

    def preflight(self, cfg: Config, run_dir: str) -> tuple[int, dict[str, Any]]:
        from launcher.launch.preflight import run_local

        return run_local(cfg, run_dir), {}

    def states(self, runs: list[list[dict[str, Any]]]) -> dict[str, str]:
        return {}  # no scheduler: each run's launcher records its own life

    def state(
        self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str] | None
    ) -> tuple[str | None, str | None]:
        # The launcher's own events decide; the ranks' (checkpoint, signal, ...) come between.
        life = [ev for ev in events if ev.get("event") in ("started", "completed", "failed", "stopped")]
        state = {"started": "RUNNING", "failed": "FAILED"}.get(life[-1]["event"]) if life else None
        reason = None
        if state == "FAILED":
            reason = life[-1].get("reason")  # the launcher's own words: which rank, its code, its log
        if state == "RUNNING" and not _launcher_alive(life[-1]):
            state = "FAILED"
            reason = (
                f"the local launcher (pid {life[-1]['launcher_pid']}) ended without recording how; "
                "run again with the same run.dir to resume from the last checkpoint"
            )
        return state, reason

    def log_files(self, run_dir: str, rank: int, events: list[dict[str, Any]]) -> list[str]:
        return [RunPaths(run_dir).rank_log(rank)]  # each attempt appends under a header line

    def cancel(self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str]) -> Any:
        started = [ev for ev in events if ev.get("event") == "started" and "launcher_pid" in ev]
        return started[-1] if started else None  # signalled while waiting: a rank catches SIGUSR2 only once set up

    def cancel_wait(
        self, run_dir: str, handle: Any, timeout_s: float, deadline: float, ended: Callable[[str], bool]
    ) -> None:
        cancel_local(run_dir, handle, timeout_s, deadline)


def _launcher_alive(started: dict[str, Any]) -> bool:
    """False only when the started event names a launcher on this host that no longer runs (killed -9,
    machine rebooted): then nothing will ever write the run's end. Unknown cases count as alive."""
    pid = started.get("launcher_pid")
    if pid is None or socket.gethostname() not in started.get("nodes", []):
        return True
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"launcher" in cmdline or b"meshrun" in cmdline  # the pid may have been reused by another program


def rank_pids(launcher: int) -> list[int]:
    """A local launcher's rank processes: its children, where its warm agent (launcher/ranks/warm/local.py)
    stands for the ranks it forked (its children); the agent itself stops with the launch."""
    out = []
    for pid in children(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                warm_agent = b"training.run.warm_agent" in f.read()
        except OSError:
            continue
        out += children(pid) if warm_agent else [pid]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cancel_local(run_dir: str, started: dict[str, Any], timeout_s: float, deadline: float) -> dict[str, Any]:
    """Signal a local run's ranks and wait for its launcher until deadline (the whole cancel's clock, which
    started at timeout_s before it): the reason names timeout_s as the user wrote it."""
    from launcher.ranks.exits import catches

    launcher = int(started["launcher_pid"])
    signalled: set = set()
    while _alive(launcher) and time.time() < deadline:
        for pid in rank_pids(launcher):
            # Before the rank installs its handler SIGUSR2 would kill it: wait until it catches the signal.
            if pid not in signalled and catches(pid, signal.SIGUSR2):
                try:
                    os.kill(pid, signal.SIGUSR2)
                    signalled.add(pid)
                except OSError:
                    pass
        time.sleep(POLL_S / 4)
    if _alive(launcher):
        for pid in rank_pids(launcher):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return record_cancelled(
            run_dir,
            f"the ranks did not stop within cancel.timeout_s={timeout_s:g} s: killed; "
            "the last complete checkpoint is kept",
            forced=True,
        )
    if not _checkpointing(run_dir):
        return record_cancelled(
            run_dir,
            "cancelled by meshrun action=cancel: stopped at a step boundary; no checkpoint was written "
            "(train.checkpointing=false): nothing to resume",
        )
    return record_cancelled(run_dir, "cancelled by meshrun action=cancel: saved a checkpoint and stopped")


def _checkpointing(run_dir: str) -> bool:
    """The run's train.checkpointing (config.json); True when it cannot be read (the usual case's words)."""
    try:
        with open(RunPaths(run_dir).config) as f:
            train = json.load(f).get("train")
    except (OSError, ValueError, AttributeError):
        return True
    return not (isinstance(train, dict) and train.get("checkpointing") is False)
