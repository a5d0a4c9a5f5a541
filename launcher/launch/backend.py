"""The seam between meshrun and a cluster kind: the Backend protocol and the BACKENDS table, keyed by
`cluster.kind`.

A launch (launcher/cli/app.py start), the launch gate's own rules (launcher/launch/gate.py), action=preflight,
and the status, logs and cancel of a run that exists (launcher/manage/) ask the backend of the kind instead of
checking the kind's name; the planner reads the kind's ClusterFacts (launcher/plan/cluster_facts.py) as plain
values. A run's kind is the one recorded in its config.json (cluster.kind), written by the gate before the launch.

A new kind is one module with a class of this protocol and one register() call (tests/launcher/launch/test_backend_seam.py
runs a train, status and cancel through a stand-in kind)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from launcher.launch.local_backend import LocalBackend
from launcher.launch.slurm_backend import SlurmBackend
from launcher.plan.cluster_facts import KINDS, ClusterFacts
from launcher.records.readers import current_job_id
from training.contract.config import Config
from training.contract.rundir.paths import RunPaths


class Backend(Protocol):
    """What meshrun asks of a cluster kind."""

    facts: ClusterFacts
    """The plain facts the planner and the gate read (launcher/plan/cluster_facts.py)."""

    def checks(self, cfg: Config) -> list[str]:
        """The kind's own rules for a launch, as error messages (validate()'s cluster_checks add them)."""
        ...

    def submit(self, cfg: Config, run_dir: str, plan_result: dict[str, Any], multirun: bool, queue: bool) -> dict:
        """Launch the planned run (action=train): a local launch returns when it ends, a queued one at once with
        status "submitted" (followed by launcher/manage/follow.py when wait=true) or "queued" (queue: a sweep
        point whose arrays the sweep launcher submits)."""
        ...

    def preflight(self, cfg: Config, run_dir: str) -> tuple[int, dict[str, Any]]:
        """Run the preflight ranks alone (action=preflight): their exit code and the launch's own fields."""
        ...

    def states(self, runs: list[list[dict[str, Any]]]) -> dict[str, str]:
        """The scheduler's states of the current jobs of many runs (their events), asked once for all of them: a
        1,000-point sweep answers as fast as one. {} for a kind without a scheduler."""
        ...

    def state(
        self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str] | None
    ) -> tuple[str | None, str | None]:
        """(state, reason) of a launched run whose events record no end (completed, cancelled, stopped); None
        when unknown. states: the scheduler's states already asked for (a sweep asks once for all its runs)."""
        ...

    def log_files(self, run_dir: str, rank: int, events: list[dict[str, Any]]) -> list[str]:
        """The files that hold `rank`'s output, oldest first (they may not exist yet)."""
        ...

    def cancel(self, run_dir: str, events: list[dict[str, Any]], states: dict[str, str]) -> Any:
        """Ask a running run to stop (its cancel mark is written already; states: as for state()): a handle to wait
        on with cancel_wait, or None when nothing is left to wait for (stopped at once, `cancelled` recorded)."""
        ...

    def cancel_wait(
        self, run_dir: str, handle: Any, timeout_s: float, deadline: float, ended: Callable[[str], bool]
    ) -> None:
        """Wait until deadline for the run to stop (ended(run_dir): its `cancelled` event or a final state), then
        force it; the `cancelled` event records which."""
        ...


BACKENDS: dict[str, Backend] = {}
"""cluster.kind -> its backend; the command line's choices of cluster.kind are training/contract/config.py's."""


def register(backend: Backend) -> None:
    """Make `backend` the one of its facts' kind: the planner's facts and this table."""
    KINDS[backend.facts.kind] = backend.facts
    BACKENDS[backend.facts.kind] = backend


register(LocalBackend())
register(SlurmBackend())


def backend_for(kind: object) -> Backend:
    """The backend of a cluster.kind value (a choice member or its string)."""
    return BACKENDS[str(kind)]


def run_kind(run_dir: str, events: list[dict[str, Any]]) -> str:
    """The cluster kind a run was launched with: its config.json's cluster.kind. A directory without a readable
    config.json (written by hand, not by a launch) counts as Slurm when its events name a job, else local."""
    try:
        with open(RunPaths(run_dir).config) as f:
            return str(json.load(f)["cluster"]["kind"])
    except (OSError, ValueError, KeyError, TypeError):
        return "slurm" if current_job_id(events) is not None else "local"


def backend_of_run(run_dir: str, events: list[dict[str, Any]]) -> Backend:
    """The backend that launched the run in run_dir (status, logs and cancel ask it)."""
    return backend_for(run_kind(run_dir, events))


def states_of(events_of: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """The scheduler's states of many runs (run dir -> its events), one question to each kind among them: the
    `states` that state() and cancel() take."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for run_dir, events in events_of.items():
        runs.setdefault(run_kind(run_dir, events), []).append(events)
    out: dict[str, str] = {}
    for kind, events_list in runs.items():
        out.update(backend_for(kind).states(events_list))
    return out
