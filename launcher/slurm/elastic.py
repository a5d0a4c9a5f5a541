"""Elastic shrink and growth of a Slurm run (cluster.elastic.min_nodes > 0).

A job that lost a node is resubmitted without it (launcher/slurm/requeue.py). With elastic on, that
resubmission need not wait for a replacement: when the partition cannot give the full node count (too few
nodes up after the exclusion, or busy nodes that do not free up within cluster.elastic.wait_min), the next
job runs on fewer nodes, down to min_nodes. For a named or given layout only data parallelism shrinks: tp, pp and
cp stay, the global batch stays (more gradient accumulation per rank), the checkpoint is resharded on load
(training/checkpoint/layout.py
describes every piece, ZeRO-1 optimizer shards included, by its place in the layout-free global tensor), and
the data position is the consumed-sample count, which does not depend on dp (training/data/sources.py). So a
shrunk run computes the same steps as the full one, up to floating-point summation order.

A run whose layout parallel=auto chose (config.json's parallel.auto_pinned is not null) is re-planned instead:
each node count gets the layout parallel=auto's rule chooses there (launcher/recommend/auto.py replan: the fastest
that fits, keeping the pinned keys and the global batch; the checkpoint reshards across every key it varies), and
the `shrunk` / `grown` event's `replanned` says what was chosen, the runner-up and why.

The run grows back at a later requeue (a stop after a checkpoint, or another failure) once Slurm reports
enough nodes usable again: the requeue then becomes a resubmission with more nodes, and an excluded node that
Slurm shows idle again (an administrator resumed it) is re-admitted. A node that fails again is excluded
again. The full count is the one of the run's last submission (`submitted` event).

Every node count from min_nodes to cluster.nodes is validated with the planner before the first submission
(`elastic_checks`, called by launcher/launch/gate.py), so a resize can never produce a layout that does not fit
or does not divide the batch. The one function that changes a run's layout is `apply_resize`: config.json
(cluster.nodes, and parallel.dp when it was given; a re-planned run's whole layout), plan.json, and a `shrunk` or
`grown` event with the old and new layouts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.contract.config import Config, derived_dp
from training.contract.layout_text import layout_fields
from training.contract.rundir.events import append_event
from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths

UNUSABLE = {
    "down",
    "drain",
    "drng",
    "drained",
    "draining",
    "fail",
    "failg",
    "failing",
    "maint",
    "inval",
    "futr",
    "future",
    "unk",
    "unknown",
    "npc",
    "pow_dn",
    "powered_down",
    "powering_down",
    "reboot",
}
"""sinfo short states (%t) of a node that cannot take a job now, whatever its allocation."""
FREE = {"idle"}
"""States of a node that can take the whole job now (mixed and allocated nodes run other jobs)."""
POLL_S = 5.0
"""How often a waiting epilogue asks Slurm again."""
TIME_MARGIN_S = 60.0
"""A waiting epilogue stops this long before its own job's time limit, to still submit the next job."""


def auto_chosen(cfg: Config) -> bool:
    """The run's layout came from parallel=auto (parallel.auto_pinned recorded): a resize re-plans it."""
    return cfg.parallel.auto_pinned is not None


def resized(cfg: Config, nodes: int) -> tuple[Config, dict[str, Any] | None]:
    """cfg on `nodes` nodes and, for a layout parallel=auto chose, what its re-plan chose (plan.json's `auto`, the
    event's `replanned`: the layout, the runner-up, why, the kept keys) with `text`, one line saying so. A named or
    given layout, or a count at which the re-plan finds nothing: with_nodes (dp only), None."""
    if nodes == cfg.cluster.nodes or not auto_chosen(cfg):
        return with_nodes(cfg, nodes), None
    from launcher.recommend.auto import replan, replan_text

    choice = replan(cfg, nodes)
    if choice.chosen is None:
        return with_nodes(cfg, nodes), None
    return choice.cfg, {**choice.to_json(), "text": replan_text(choice)}


def with_nodes(cfg: Config, nodes: int) -> Config:
    """cfg on `nodes` nodes: dp follows (an explicit parallel.dp is rescaled, a derived one stays derived);
    tp, pp, cp and the global batch are kept."""
    par = cfg.parallel
    if par.dp is not None:
        mp = par.tp * par.pp * par.cp
        ranks = nodes * cfg.cluster.gpus_per_node
        par = dataclasses.replace(par, dp=ranks // mp if mp and ranks % mp == 0 else 0)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=nodes), parallel=par)


def layout_errors(cfg: Config, nodes: int) -> list[str]:
    """Why cfg cannot run on `nodes` nodes (the planner's errors), or []. A layout parallel=auto chose: why its
    re-plan there finds nothing, or the planner's errors of the layout it finds."""
    from launcher.plan.validate import validate

    if nodes != cfg.cluster.nodes and auto_chosen(cfg):
        from launcher.recommend.auto import replan, replan_text

        choice = replan(cfg, nodes)
        if choice.chosen is None:
            return [replan_text(choice)]
        return [f"{i.key}: {i.message}" for i in validate(choice.cfg).errors]
    mp = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    ranks = nodes * cfg.cluster.gpus_per_node
    if mp <= 0 or ranks % mp:
        return [f"{ranks} ranks are not a multiple of tp x pp x cp = {mp}"]
    return [f"{i.key}: {i.message}" for i in validate(with_nodes(cfg, nodes)).errors]


def elastic_checks(cfg: Config) -> list[str]:
    """The elastic keys' problems, each with its fix; and every node count the job may shrink to, validated
    with the planner (one message per count that would be refused, with the planner's reason)."""
    e, nodes = cfg.cluster.elastic, cfg.cluster.nodes
    out: list[str] = []
    if e.min_nodes < 0:
        out.append(f"cluster.elastic.min_nodes={e.min_nodes} is negative: set 0 (never shrink) or a node count")
    if not e.wait_min >= 0:  # NaN too
        out.append(f"cluster.elastic.wait_min={e.wait_min} must be >= 0 minutes: set 0 (shrink at once) or more")
    if e.min_nodes <= 0 or out:
        return out
    if e.min_nodes > nodes:
        return [
            f"cluster.elastic.min_nodes={e.min_nodes} exceeds cluster.nodes={nodes}: set it to at most "
            f"{nodes}, or 0 (never shrink)"
        ]
    if layout_errors(cfg, nodes):
        return out  # the full layout's own errors are reported by the planner; shrunk ones would only repeat them
    for n in range(e.min_nodes, nodes):
        errors = layout_errors(cfg, n)
        if errors:
            valid = [m for m in range(n + 1, nodes + 1) if not layout_errors(cfg, m)]
            how = "re-planned by parallel=auto" if auto_chosen(cfg) else f"dp={derived_dp(with_nodes(cfg, n))}"
            out.append(
                f"cluster.elastic.min_nodes={e.min_nodes}: the job may shrink to {n} node(s) ({how}), "
                f"which would be refused: {errors[0]}; set "
                f"cluster.elastic.min_nodes={valid[0] if valid else nodes} or change parallel.global_batch "
                "so every node count in between divides it"
            )
            break  # the fix for the smallest bad count covers the ones below it
    return out


def target_nodes(events: Sequence[dict[str, Any]], cfg: Config) -> int:
    """The run's full node count: the one of its last submission (a resize never changes it)."""
    full = cfg.cluster.nodes
    for ev in events:
        if ev.get("event") == "submitted" and isinstance(ev.get("nodes"), int):
            full = ev["nodes"]
    return max(full, cfg.cluster.nodes)


def _state(raw: str) -> str:
    # sinfo appends flags to the short state: * not responding, ~ powered off, # powering up, ! pending power
    # down, % powering down, $ maintenance, @ pending reboot, ^ rebooting, - planned.
    return raw.rstrip("*~#!%$@^-+").lower()


def node_states(partition: str) -> dict[str, str]:
    """Node -> short state of every node of the partition (sinfo %t); {} when Slurm cannot answer."""
    from training.contract.slurm_env import SlurmUnavailable, slurm_command

    try:
        res = slurm_command(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"])
    except SlurmUnavailable:
        return {}
    out: dict[str, str] = {}
    for line in res.stdout.splitlines() if res.returncode == 0 else []:
        name, _, state = line.strip().partition(" ")
        if name:
            raw = state.strip()
            # A node not responding (*) counts as down whatever its base state.
            out[name] = "down" if raw.endswith("*") else _state(raw)
    return out


@dataclass
class Pool:
    """The nodes the next job could get, as Slurm shows them now."""

    free: list[str]
    """Nodes it could start on now: the ending job's own healthy nodes and idle nodes, none excluded."""
    up: list[str]
    """free plus nodes up but busy with other jobs (they may free up)."""
    readmit: list[str]
    """Excluded nodes Slurm shows idle again: re-admitted when the run grows."""


def pool(
    states: dict[str, str], own: Sequence[str], excluded: Sequence[str], keep_excluded: Sequence[str], growing: bool
) -> Pool:
    """The nodes for the next job. own: the ending job's nodes; excluded: the exclusion list for the next job;
    keep_excluded: nodes excluded by this very decision (never re-admitted at once); growing: the run is below
    its full count (only then is an excluded node re-admitted)."""
    readmit = sorted(n for n in excluded if growing and n not in keep_excluded and states.get(n) in FREE)
    barred = set(excluded) - set(readmit)
    free = [
        n for n in sorted(states) if n not in barred and (states[n] in FREE or (n in own and states[n] not in UNUSABLE))
    ]
    up = [n for n in sorted(states) if n not in barred and states[n] not in UNUSABLE]
    return Pool(free, up, readmit)


def node_count(target: int, current: int, min_nodes: int, free: int, valid: Callable[[int], bool]) -> int:
    """Nodes of the next job: as many as are free, at most the full count, at least min_nodes (a job that
    cannot get even those waits in the queue at min_nodes), and a count whose layout is valid."""
    n = max(min_nodes, min(target, free))
    while n > min_nodes and not valid(n):
        n -= 1
    return n if valid(n) else current


@dataclass
class Resize:
    """What the next job of an elastic run looks like."""

    cfg: Config
    """The run's config on the new node count (config.json once the job is submitted)."""
    exclude: list[str]
    """Its exclusion list (re-admitted nodes removed)."""
    old: dict[str, Any]
    """Layout of the ending job."""
    new: dict[str, Any]
    """Layout of the next job."""
    readmitted: list[str] = field(default_factory=list)
    """Excluded nodes given back to the run."""
    reason: str = ""
    """Why, in words."""
    waited_s: float = 0.0
    """How long the epilogue waited for busy nodes."""
    replanned: dict[str, Any] | None = None
    """A layout parallel=auto chose: what its re-plan on the new node count chose and why (resized)."""

    @property
    def event(self) -> str | None:
        """shrunk | grown | None (same node count)."""
        if self.new["nodes"] == self.old["nodes"]:
            return None
        return "shrunk" if self.new["nodes"] < self.old["nodes"] else "grown"


def plan_resize(
    cfg: Config,
    events: Sequence[dict[str, Any]],
    own: Sequence[str],
    excluded: Sequence[str],
    newly_excluded: Sequence[str] = (),
    job_end: float | None = None,
    states_fn: Callable[[str], dict[str, str]] = node_states,
    sleep: Callable[[float], None] = time.sleep,
) -> Resize | None:
    """The next job's node count and exclusions, or None when nothing changes (or Slurm cannot say).

    Shrinks when the full count is not free: at once when too few nodes are up, else after waiting up to
    cluster.elastic.wait_min (and never past job_end - TIME_MARGIN_S) for busy nodes; grows as far as free
    nodes allow when the run is below its full count."""
    e, current = cfg.cluster.elastic, cfg.cluster.nodes
    target = target_nodes(events, cfg)
    growing = current < target
    states = states_fn(cfg.cluster.partition)
    if not states:
        return None
    checked: dict[int, bool] = {}

    def valid(n: int) -> bool:
        if n not in checked:
            checked[n] = not layout_errors(cfg, n)
        return checked[n]

    p = pool(states, own, excluded, newly_excluded, growing)
    n = node_count(target, current, e.min_nodes, len(p.free), valid)
    waited = 0.0
    if n < min(current, target) and len(p.up) > len(p.free):
        deadline = time.time() + e.wait_min * 60
        if job_end is not None:
            deadline = min(deadline, job_end - TIME_MARGIN_S)
        start = time.time()
        while n < min(current, target) and time.time() < deadline:
            sleep(min(POLL_S, max(0.0, deadline - time.time())))
            states = states_fn(cfg.cluster.partition) or states
            p = pool(states, own, excluded, newly_excluded, growing)
            n = node_count(target, current, e.min_nodes, len(p.free), valid)
        waited = time.time() - start
    exclude = [x for x in excluded if x not in p.readmit]
    if n == current and exclude == list(excluded):
        return None
    new_cfg, replanned = resized(cfg, n)
    why = (
        f"{len(p.free)} of the {target} node(s) the run asks for are free ({', '.join(p.free) or 'none'}; "
        f"excluded: {', '.join(exclude) or 'none'})"
    )
    if waited:
        why += f", after waiting {waited:.0f} s for busy nodes (cluster.elastic.wait_min={e.wait_min:g})"
    if replanned is not None:
        why += f"; {replanned['text']}"
    return Resize(
        new_cfg, exclude, layout_fields(cfg), layout_fields(new_cfg), p.readmit, why, waited, replanned=replanned
    )


def apply_resize(run_dir: str, r: Resize, **fields: Any) -> None:
    """The one place a run's layout changes: config.json (and config.yaml), plan.json, and the `shrunk` or
    `grown` event with the old and new layouts (fields: attempt, job_id, new_job_id, ...). A re-planned layout
    (parallel=auto): plan.json's `auto` and the event's `replanned` say what was chosen and why, also printed."""
    from launcher.plan.validate import validate
    from training.contract.rundir.config_files import write_config

    write_config(r.cfg, run_dir)
    report = validate(r.cfg)
    if report.plan is not None:
        path = RunPaths(run_dir).plan
        plan_json = report.plan.to_json()
        if r.replanned is not None:
            plan_json["auto"] = {k: v for k, v in r.replanned.items() if k != "text"}
        write_atomic(path, json.dumps(plan_json, indent=2))
    if r.replanned is not None:
        print(f"meshrun epilogue: {r.replanned['text']}")
    if r.event:
        if r.replanned is not None:
            fields = {**fields, "replanned": r.replanned}
        append_event(
            run_dir,
            r.event,
            old_layout=r.old,
            new_layout=r.new,
            readmitted_nodes=r.readmitted,
            excluded_nodes=r.exclude,
            reason=r.reason,
            waited_s=round(r.waited_s, 1),
            **fields,
        )


def job_end_time(job: str) -> float | None:
    """When this job's time limit ends (Unix seconds), or None (no limit, or Slurm cannot say)."""
    from training.contract.slurm_env import SlurmUnavailable, slurm_command

    try:
        out = slurm_command(["squeue", "-h", "-j", job, "-o", "%e"]).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (SlurmUnavailable, ValueError):
        return None
