"""A cluster kind is one module and one registration (launcher/launch/backend.py).

A stand-in backend, ScratchBackend below, is registered for a scratch `cluster.kind` and a whole
train -> status -> logs -> cancel -> status cycle runs through the command line (tests/helpers/cli.py, in-process).
What it proves:
- `meshrun action=train cluster.kind=scratch` passes the gate with the kind's own checks and launches through the
  backend's submit: no step of the launch dispatches on the name of a built-in kind;
- the run records its kind (config.json's cluster.kind), and status, logs and cancel ask that backend for the
  scheduler's states, the state, the log files and the stop (nothing is inferred from the events);
- the planner reads the kind's facts as plain values (launcher/plan/cluster_facts.py): a kind that reads no Slurm
  key is told of none ignored when none is set.

The schema's cluster.kind choices stay local|slurm for users; the fixture adds the scratch value to the choice type
for this test alone (Hydra checks a choice at composition) and removes it again."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from helpers.cli import run_cli

from launcher.launch import backend as backend_mod
from launcher.plan.cluster_facts import KINDS, ClusterFacts
from launcher.records.readers import record_cancelled
from training.contract.config import ClusterKind, Config
from training.contract.rundir.events import append_event

KIND = "scratch"


class ScratchBackend:
    """The whole of a new kind: its facts and the protocol's methods (here: events and a log file, no processes)."""

    facts = ClusterFacts(KIND, ranks_here=False, shared_fs=False, time_limit=False, adds_nodes=False, slurm_keys=False)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def checks(self, cfg: Config) -> list[str]:
        self.calls.append("checks")
        return []

    def submit(self, cfg: Config, run_dir: str, plan_result: dict[str, Any], multirun: bool, queue: bool) -> dict:
        self.calls.append("submit")
        append_event(run_dir, "started", attempt=0, scratch=True)
        with open(self._log(run_dir, 0), "w") as f:
            f.write("scratch rank 0 says hello\n")
        return {"status": "running", "run_dir": run_dir}

    def preflight(self, cfg: Config, run_dir: str) -> tuple[int, dict[str, Any]]:
        self.calls.append("preflight")
        return 0, {}

    def states(self, runs: list[list[dict[str, Any]]]) -> dict[str, str]:
        self.calls.append("states")
        return {}

    def state(
        self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str] | None
    ) -> tuple[str | None, str | None]:
        self.calls.append("state")
        return ("RUNNING", None) if any(ev.get("scratch") for ev in events) else (None, None)

    def log_files(self, run_dir: str, rank: int, events: list[dict[str, Any]]) -> list[str]:
        self.calls.append("log_files")
        return [self._log(run_dir, rank)]

    def cancel(self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str]) -> Any:
        self.calls.append("cancel")
        return "handle"

    def cancel_wait(
        self, run_dir: str, handle: Any, timeout_s: float, deadline: float, ended: Callable[[str], bool]
    ) -> None:
        self.calls.append(f"cancel_wait:{handle}")
        record_cancelled(run_dir, "cancelled by the scratch backend")

    @staticmethod
    def _log(run_dir: str, rank: int) -> str:
        return os.path.join(run_dir, f"scratch_{rank}.log")


@pytest.fixture
def scratch():
    """ScratchBackend registered for cluster.kind=scratch, and `scratch` a value of the schema's choice for now."""
    member = str.__new__(ClusterKind, KIND)
    member._name_, member._value_ = KIND, KIND
    ClusterKind._member_map_[KIND] = member
    ClusterKind._value2member_map_[KIND] = member
    ClusterKind._member_names_.append(KIND)
    double = ScratchBackend()
    backend_mod.register(double)
    try:
        yield double
    finally:
        backend_mod.BACKENDS.pop(KIND)
        KINDS.pop(KIND)
        ClusterKind._member_names_.remove(KIND)
        del ClusterKind._value2member_map_[KIND], ClusterKind._member_map_[KIND]


def test_a_new_kind_runs_train_status_logs_and_cancel_through_its_backend(scratch, tmp_path):
    run_dir = str(tmp_path / "run")
    res = run_cli("action=train", f"cluster.kind={KIND}", f"run.dir={run_dir}", cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert scratch.calls[:2] == ["checks", "submit"]
    assert "ignores Slurm-only keys" not in res.stderr  # the kind reads none, and none is set
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["cluster"]["kind"] == KIND  # the run's record names its backend

    status = run_cli("action=status", f"run.dir={run_dir}", cwd=str(tmp_path))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "RUNNING"
    assert "state" in scratch.calls and "log_files" in scratch.calls

    logs = run_cli("action=logs", f"run.dir={run_dir}", cwd=str(tmp_path))
    assert logs.returncode == 0, logs.stderr
    assert "scratch rank 0 says hello" in logs.stdout

    cancel = run_cli("action=cancel", f"run.dir={run_dir}", cwd=str(tmp_path))
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout) == {run_dir: "CANCELLED"}
    assert {"states", "cancel", "cancel_wait:handle"} <= set(scratch.calls)

    after = run_cli("action=status", f"run.dir={run_dir}", cwd=str(tmp_path))
    assert json.loads(after.stdout)["state"] == "CANCELLED"
    assert json.loads(after.stdout)["reason"] == "cancelled by the scratch backend"


def test_the_built_in_kinds_are_registered_with_their_facts():
    assert set(backend_mod.BACKENDS) == {"local", "slurm"}
    assert {k: b.facts for k, b in backend_mod.BACKENDS.items()} == {k: KINDS[k] for k in ("local", "slurm")}
    assert [m.value for m in ClusterKind] == ["local", "slurm"]  # the users' choices
