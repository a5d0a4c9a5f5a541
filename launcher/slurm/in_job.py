"""In-job restart: recover from a failure inside the running Slurm allocation instead of requeueing.

With cluster.max_in_job_restarts >= 1 the batch script runs its prologue, srun and epilogue in a loop
(`batch_loop_*` below). The job asks for cluster.nodes + cluster.spare_nodes nodes with --no-kill (a node
that fails does not end the allocation); each training step (srun) runs on cluster.nodes of them, named with
--nodelist, and the rest wait idle. When the epilogue (launcher/slurm/driver.py) sees a failure, `plan`
decides:
  - a node blamed for it (launcher/slurm/requeue.py blamed_failures, or Slurm shows the node down or drained)
    is replaced by a spare and left out of every later step of this allocation;
  - a failure blamed on no node (a Python exception, a failed save) restarts on the same nodes;
then the epilogue records `restarted_in_job` and exits EXIT_RESTART_IN_JOB, and the loop starts the next
attempt: a new prologue (attempt number, rendezvous port, lock check) and srun, which resumes from the latest
complete checkpoint as a requeued attempt would (metrics after it are purged, secrets re-read, the same code
snapshot). Past cluster.max_in_job_restarts, or with fewer healthy nodes than cluster.nodes, the job falls back
to today's resubmission excluding the bad nodes; a preemption or time-limit stop still requeues (the
allocation is going away).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from training.contract.config import ClusterConfig
from training.contract.exit_codes import EXIT_NODE_BAD, EXIT_RESTART_IN_JOB

EVENT = "restarted_in_job"


def restart_limit(c: ClusterConfig) -> int:
    """In-job restarts an allocation may make: cluster.max_in_job_restarts, or with it 0 and spares asked for, one
    per spare (asking for a spare means wanting in-job restarts: the spares would otherwise only wait idle)."""
    return c.in_job_restart_limit()


def enabled(c: ClusterConfig) -> bool:
    return restart_limit(c) > 0


def config_errors(c: ClusterConfig) -> list[str]:
    """The keys' problems, each with its fix."""
    out = []
    if c.spare_nodes < 0:
        out.append(f"cluster.spare_nodes={c.spare_nodes} is negative: set 0 (no spares) or a node count")
    if c.max_in_job_restarts < 0:
        out.append(
            f"cluster.max_in_job_restarts={c.max_in_job_restarts} is negative: set 0 (every failure "
            "resubmits) or a count"
        )
    if not c.in_job_restart_min >= 0:
        out.append(f"cluster.in_job_restart_min={c.in_job_restart_min} must be >= 0 minutes")
    return out


def allocation_nodes(c: ClusterConfig) -> int:
    """Nodes the job asks Slurm for: the training nodes plus the spares."""
    return c.nodes + (c.spare_nodes if enabled(c) else 0)


# ------------------------------------------------------------------------------------- the batch script
def batch_loop_head() -> list[str]:
    """Setup lines before the prologue: srun runs on the step's nodes (the prologue sets MESHRUN_STEP_ARGS),
    and the loop over attempts of this allocation opens. submitit writes the srun line itself; a shell
    function of the same name adds the step's options in front of its arguments."""
    return ['srun() { command srun "${MESHRUN_STEP_ARGS[@]}" "$@"; }', "while :; do"]


def loop_prologue_line(prologue: str) -> str:
    """The loop's prologue: an epilogue that restarts in this allocation has already run the next attempt's
    prologue in its own process (one Python start less on the restart's path) and printed its exports."""
    return (
        'if [ -n "${MESHRUN_NEXT_PROLOGUE:-}" ]; then MESHRUN_PROLOGUE="$MESHRUN_NEXT_PROLOGUE"; '
        f'MESHRUN_NEXT_PROLOGUE=; eval "$MESHRUN_PROLOGUE"; else {prologue}; fi'
    )


def batch_watch_lines(python: str) -> list[str]:
    """Before the loop: a watcher that waits on a pipe from this script (`driver watch`): told "done" before the
    script's own exit, it sees the pipe close without it when the batch script alone is killed (scancel
    --signal=KILL --batch) and decides the attempt then (launcher/slurm/driver.py batch_script_lost)."""
    return [
        # Its pipe stays in bash's coprocess descriptors (closed in every command the script starts): a copy held by
        # srun would keep the pipe open past the script's death.
        f'coproc MESHRUN_WATCH {{ exec {python} -m launcher.slurm.driver watch "$MESHRUN_RUN_DIR" >/dev/null; }}',
    ]


def batch_loop_tail(epilogue: str) -> list[str]:
    """Teardown lines: the epilogue's EXIT_RESTART_IN_JOB starts the next attempt in this allocation (its
    standard output: the next prologue's exports; anything else it printed goes to the job's log)."""
    return [
        "MESHRUN_SRUN_RC=$?",
        f'MESHRUN_NEXT_PROLOGUE="$({epilogue} --then-prologue)"',
        "MESHRUN_EPILOGUE_RC=$?",
        f'if [ "$MESHRUN_EPILOGUE_RC" -eq {EXIT_RESTART_IN_JOB} ]; then continue; fi',
        '[ -z "$MESHRUN_NEXT_PROLOGUE" ] || printf \'%s\\n\' "$MESHRUN_NEXT_PROLOGUE"',
        "{ printf 'done\\n' >&\"${MESHRUN_WATCH[1]}\"; } 2>/dev/null",
        'exit "$MESHRUN_EPILOGUE_RC"',
        "done",
    ]


def step_args_line(step: Sequence[str], ranks_per_node: int) -> str:
    """The prologue's export of the step's srun options (a bash array, evaluated by the batch script)."""
    args = [
        f"--nodes={len(step)}",
        f"--ntasks={len(step) * ranks_per_node}",
        f"--ntasks-per-node={ranks_per_node}",
        "--nodelist=" + ",".join(step),
    ]
    return "MESHRUN_STEP_ARGS=(" + " ".join(shlex.quote(a) for a in args) + ")"


# ------------------------------------------------------------------------------ this allocation's history
def _same_allocation(ev: dict[str, Any], job_id: str, restart_count: int) -> bool:
    return str(ev.get("job_id")) == str(job_id) and int(ev.get("restart_count") or 0) == restart_count


def restarts(events: Sequence[dict[str, Any]], job_id: str, restart_count: int) -> list[dict[str, Any]]:
    """This allocation's restarted_in_job events (a requeued job is a new allocation: its count starts at 0)."""
    return [ev for ev in events if ev.get("event") == EVENT and _same_allocation(ev, job_id, restart_count)]


def bad_nodes(events: Sequence[dict[str, Any]], job_id: str, restart_count: int) -> list[str]:
    """Nodes of this allocation blamed for a failure: never used again by its steps."""
    out: list[str] = []
    for ev in restarts(events, job_id, restart_count):
        for node in ev.get("bad_nodes") or []:
            if node not in out:
                out.append(node)
    return out


def preflight_passed(events: Sequence[dict[str, Any]], job_id: str, restart_count: int) -> list[str]:
    """Nodes that passed the preflight (no failing check) in an earlier attempt of this allocation. An
    in-job restart does not check them again (training/preflight/runner.py PASSED_ENV): they were checked
    minutes ago in the same allocation, and a node blamed for a failure since is left out of the step."""
    ours = {
        ev.get("attempt")
        for ev in events
        if ev.get("event") == "started" and _same_allocation(ev, job_id, restart_count)
    }
    out: list[str] = []
    for ev in events:
        if ev.get("event") != "preflight" or ev.get("attempt") not in ours:
            continue
        bad = set(ev.get("bad_nodes") or [])
        for node, status in (ev.get("nodes") or {}).items():
            if status != "fail" and node not in bad and node not in out:
                out.append(node)
    return out


def choose_step(
    allocation: Sequence[str], bad: Sequence[str], previous: Sequence[str], nodes: int, unusable: Sequence[str] = ()
) -> list[str] | None:
    """The next step's nodes: the previous step's healthy nodes first (their ranks keep their places), then
    spares in allocation order; None when fewer than `nodes` healthy nodes are left."""
    barred = set(bad) | set(unusable)
    keep = [n for n in previous if n in allocation and n not in barred]
    rest = [n for n in allocation if n not in barred and n not in keep]
    step = (keep + rest)[:nodes]
    return step if len(step) == nodes else None


def spares(allocation: Sequence[str], bad: Sequence[str], step: Sequence[str]) -> list[str]:
    return [n for n in allocation if n not in bad and n not in step]


# ---------------------------------------------------------------------------------------- the decision
def cause_of(failures: Sequence[Any], records: dict[int, dict[str, Any]]) -> str:
    """node_lost (no rank of a node reported) | node_bad (preflight or health sampler) | rank_killed (a signal)
    | save_failed | rank_failed (an exception or another exit code)."""
    for f in failures:
        if f.exit_code is None:
            return "node_lost"
    for f in failures:
        if f.exit_code == EXIT_NODE_BAD:
            return "node_bad"
        if records.get(f.rank, {}).get("cause") == "save_failed":
            return "save_failed"
    for f in failures:
        if isinstance(f.exit_code, int) and f.exit_code < 0:
            return "rank_killed"
    return "rank_failed"


@dataclass
class Restart:
    """What the epilogue does next, in this allocation or not."""

    ok: bool
    """True: relaunch in this allocation; False: fall back to the resubmission (why says why)."""
    why: str = ""
    """The reason it is not possible (or the cause, when it is)."""
    step: list[str] = field(default_factory=list)
    """The next step's nodes."""
    replaced: list[str] = field(default_factory=list)
    """Nodes blamed now (left out of every later step)."""
    spares_used: list[str] = field(default_factory=list)
    """Spares that take the replaced nodes' places."""
    bad: list[str] = field(default_factory=list)
    """Every node of this allocation blamed so far (the exclusion a fallback adds)."""


def plan(
    c: ClusterConfig,
    allocation: Sequence[str],
    step: Sequence[str],
    blamed: Sequence[str],
    bad_before: Sequence[str],
    used: int,
    unusable: Sequence[str] = (),
) -> Restart:
    """allocation: the job's nodes; step: the failed step's nodes; blamed: nodes blamed for this failure;
    bad_before: nodes blamed earlier in this allocation; used: in-job restarts so far in it; unusable: nodes
    Slurm shows down or drained now (blamed too when they ran the step)."""
    newly = [n for n in list(blamed) + [u for u in unusable if u in step] if n in step]
    newly = list(dict.fromkeys(newly))
    bad = list(dict.fromkeys(list(bad_before) + newly))
    if used >= restart_limit(c):
        implied = "" if c.max_in_job_restarts > 0 else f", one per spare of cluster.spare_nodes={c.spare_nodes}"
        return Restart(
            False, f"in-job restarts exhausted (cluster.max_in_job_restarts={restart_limit(c)}{implied})", bad=bad
        )
    nxt = choose_step(allocation, bad, step, c.nodes, unusable)
    if nxt is None:
        healthy = [n for n in allocation if n not in bad and n not in unusable]
        return Restart(
            False,
            f"no spare left: {len(healthy)} healthy node(s) in the allocation "
            f"({', '.join(healthy) or 'none'}), {c.nodes} needed",
            bad=bad,
        )
    used_spares = [n for n in nxt if n not in step]
    return Restart(True, "", nxt, newly, used_spares, bad)
