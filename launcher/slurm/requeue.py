"""What to do when an attempt's srun step has ended (pure functions; the epilogue acts on them).

Rank exit codes (training/contract/exit_codes.py, docs/CONTRACTS.md): EXIT_OK finished, EXIT_STOPPED stopped early
after a complete checkpoint, EXIT_NODE_BAD preflight found the node bad, EXIT_INVALID invalid config/data,
anything else (or no record) a failure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from launcher.ranks.exits import Failure, failure_of, root_cause, terminated_by_srun
from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_NODE_BAD, EXIT_OK, EXIT_STOPPED


@dataclass
class Decision:
    """The epilogue's verdict on one attempt."""

    action: str
    """completed | requeue (same job again) | resubmit (new job, nodes excluded) | stop."""
    reason: str = ""
    """Why, in words (goes to events.jsonl)."""
    failures: list[Failure] = field(default_factory=list)
    """The ranks blamed for a failure (the first to fail, or every rank that reported a bad node)."""
    exclude: list[str] = field(default_factory=list)
    """Nodes excluded from the next job (old exclusions included)."""
    note: str = ""
    """A remark for events.jsonl (e.g. a node that could not be excluded)."""
    consequences: list[int] = field(default_factory=list)
    """The other ranks that failed in the attempt (a peer's collective error, srun's SIGTERM): what the failure
    caused, not its cause; listed in the `failed` event."""
    cause: str = ""
    """requeue/resubmit: stopped_early (costs no retry), no_progress, save_failed or failure (each costs one of
    cluster.max_retries; launcher/records/readers.py RETRY_CAUSES)."""


# Exceptions that point at the machine rather than the program: a rank that raised one implicates its node.
_HARDWARE = re.compile(
    r"CUDA error|NCCL error|ECC|uncorrectable|Xid|device-side assert|cudaError|"
    r"Input/output error on device|hardware",
    re.IGNORECASE,
)


def _implicates_node(rec: dict) -> bool:
    """Whether a failed rank's end is evidence against its node: killed by a signal, preflight found the node
    bad, an error naming hardware, or an exit code Python itself never gives. A plain Python exception
    (exit 1: a bug, a configuration problem, a failed save) says nothing about the node it ran on."""
    code = rec.get("exit_code")
    if code == EXIT_NODE_BAD or (isinstance(code, int) and code < 0):
        return True
    if code == EXIT_FAILED:
        # "oom": CUDA out of memory is the layout's (training/observe/oom.py), not the node's.
        return rec.get("cause") not in ("exception", "save_failed", "invalid", "oom", "") or bool(
            _HARDWARE.search(rec.get("error") or "")
        )
    return code not in (EXIT_OK, EXIT_STOPPED, EXIT_INVALID)


def decide(
    records: Sequence[dict],
    world_size: int,
    rank_nodes: dict[int, str],
    progressed: bool,
    retries_used: int,
    max_retries: int,
    excluded: Sequence[str],
    partition_nodes: Sequence[str],
    nodes_needed: int,
    saved: bool = True,
) -> Decision:
    """records: rank_<R>.json dicts of this attempt; rank_nodes: rank -> node from the job layout;
    progressed: a new step was logged in this attempt; retries_used: requeues so far that cost a retry;
    saved: this attempt wrote a checkpoint (a stop without one costs a retry). The decision's consequences are
    the failed ranks it does not blame."""
    d = _decide(
        records,
        world_size,
        rank_nodes,
        progressed,
        retries_used,
        max_retries,
        excluded,
        partition_nodes,
        nodes_needed,
        saved,
    )
    blamed = {f.rank for f in d.failures}
    d.consequences = sorted(
        int(r["rank"])
        for r in records
        if r.get("exit_code") not in (EXIT_OK, EXIT_STOPPED) and int(r["rank"]) not in blamed
    )
    return d


def _decide(
    records: Sequence[dict],
    world_size: int,
    rank_nodes: dict[int, str],
    progressed: bool,
    retries_used: int,
    max_retries: int,
    excluded: Sequence[str],
    partition_nodes: Sequence[str],
    nodes_needed: int,
    saved: bool = True,
) -> Decision:
    """records: rank_<R>.json dicts of this attempt; rank_nodes: rank -> node from the job layout;
    progressed: a new step was logged in this attempt; retries_used: requeues so far that cost a retry;
    saved: this attempt wrote a checkpoint (a stop without one costs a retry)."""
    by_rank = {int(r["rank"]): r for r in records}
    exhausted = retries_used >= max_retries
    early = _ended_without_failure(by_rank, world_size, saved, exhausted, max_retries)
    if early is not None:
        return early
    save_failed = [by_rank[r] for r in sorted(by_rank) if by_rank[r].get("cause") == "save_failed"]
    if save_failed:
        # Storage failed under a save; the previous checkpoint is intact and no node is to blame.
        failures = [failure_of(save_failed[0])]
        reason = f"saving a checkpoint failed on rank {save_failed[0]['rank']}: {save_failed[0].get('error', '')}"
        if exhausted:
            return Decision(
                "stop", f"{reason}; retries exhausted (cluster.max_retries={max_retries})", failures, list(excluded)
            )
        return Decision(
            "requeue", f"{reason}; requeued from the previous checkpoint", failures, list(excluded), cause="save_failed"
        )
    failures = _failures(by_rank, world_size, rank_nodes)
    bug = _same_error_everywhere(by_rank, world_size, progressed)
    if bug:
        return Decision(
            "stop",
            f"the same error on every rank before any step: {bug} (a bug or a config problem: not retried)",
            failures,
        )
    if exhausted:
        return Decision("stop", f"retries exhausted (cluster.max_retries={max_retries})", failures, list(excluded))
    # Only evidence against a node excludes it: a rank that raised a Python exception (a bug or a
    # configuration problem) leaves its healthy node in the pool.
    blamed = blamed_failures(failures, by_rank)
    exclude, note = plan_exclusion(excluded, [f.node for f in blamed], partition_nodes, nodes_needed)
    if failures and not blamed:
        note = (note + "; " if note else "") + (
            "no node excluded: the failing rank raised an exception, "
            "which is the program's or its input's, not the node's"
        )
    reason = "; ".join(f"rank {f.rank} on {f.node}: exit {f.exit_code} {f.reason}".strip() for f in failures)
    return Decision("resubmit", reason, failures, exclude, note, cause="failure")


def _ended_without_failure(
    by_rank: dict[int, dict], world_size: int, saved: bool, exhausted: bool, max_retries: int
) -> Decision | None:
    """The attempt completed, stopped on an invalid configuration, or stopped early on purpose; None otherwise."""
    codes = {r: by_rank[r]["exit_code"] for r in by_rank}
    if len(by_rank) == world_size and all(c == EXIT_OK for c in codes.values()):
        return Decision("completed")
    if any(c == EXIT_INVALID for c in codes.values()):
        ranks = sorted(r for r, c in codes.items() if c == EXIT_INVALID)
        error = by_rank[ranks[0]].get("error") or "see the rank's log"
        return Decision(
            "stop",
            f"invalid configuration or data (exit {EXIT_INVALID} on rank(s) {ranks}), not retried: {error}",
            [failure_of(by_rank[r]) for r in ranks],
        )
    if len(by_rank) == world_size and all(c in (EXIT_OK, EXIT_STOPPED) for c in codes.values()):
        if saved:
            return Decision(
                "requeue",
                "stopped early after a checkpoint (preemption, time limit or exit_interval)",
                cause="stopped_early",
            )
        why = "stopped early without writing a checkpoint newer than the previous attempt's"
        if exhausted:
            return Decision("stop", f"{why}, again: retries exhausted (cluster.max_retries={max_retries})")
        return Decision("requeue", f"{why} (costs one of cluster.max_retries)", cause="no_progress")
    return None


def _failures(by_rank: dict[int, dict], world_size: int, rank_nodes: dict[int, str]) -> list[Failure]:
    """The ranks a failed attempt is blamed on: those that found their node bad, else a node that vanished, else
    the root cause among the failed ranks, else the ranks that never reported."""
    missing = sorted(set(range(world_size)) - set(by_rank))
    reported_nodes = {rec.get("node") for rec in by_rank.values()}
    lost = [r for r in missing if rank_nodes.get(r, "?") not in reported_nodes]
    failed = [rec for rec in by_rank.values() if rec["exit_code"] not in (EXIT_OK, EXIT_STOPPED)]
    bad_node = [r for r, rec in by_rank.items() if rec["exit_code"] == EXIT_NODE_BAD]
    if bad_node:
        return [failure_of(by_rank[r]) for r in sorted(bad_node)]
    if lost and by_rank and not any(_implicates_node(rec) and not terminated_by_srun(rec) for rec in failed):
        # A whole node vanished (none of its ranks reported); the survivors' errors (a peer gone from a
        # collective) are the consequence, not the cause, and so is a survivor ended by SIGTERM: srun
        # (--kill-on-bad-exit) sends it to every other task once the lost node's tasks have ended. Blame the node
        # that vanished.
        return [Failure(r, rank_nodes.get(r, "?"), None, "never reported (its node was lost)") for r in lost]
    if failed:
        # The rank that died by a signal (or, failing that, raised an error of its own) is the cause; the peers'
        # collective errors and srun's SIGTERMs (--kill-on-bad-exit) that follow are consequences.
        return [failure_of(root_cause(failed))]
    failures = [Failure(r, rank_nodes.get(r, "?"), None, "never reported (node or task lost)") for r in missing]
    return failures or [Failure(-1, "?", None, "step failed without a failing rank")]


def _same_error_everywhere(by_rank: dict[int, dict], world_size: int, progressed: bool) -> str:
    """A bug, not a bad node: the error when every rank raised the same exception and no step was ever completed,
    else "". The first rank to exit makes srun (--kill-on-bad-exit) kill the others, often after they printed the
    same exception but before they exited 1: a rank killed by a signal counts when its last error line is that
    same exception."""
    codes = [rec["exit_code"] for rec in by_rank.values()]
    errors = {by_rank[r].get("error", "") for r in by_rank}
    if (
        not progressed
        and len(by_rank) == world_size
        and any(c == EXIT_FAILED for c in codes)
        and all(c == EXIT_FAILED or (isinstance(c, int) and c < 0) for c in codes)
        and len(errors) == 1
        and "" not in errors
    ):
        return by_rank[0].get("error", "")
    return ""


def blamed_failures(failures: Sequence[Failure], by_rank: dict[int, dict]) -> list[Failure]:
    """The failures that are evidence against their node (a node lost, a signal, a bad node, hardware errors);
    by_rank: rank -> its rank_<R>.json record."""
    return [
        f
        for f in failures
        if f.node != "?"
        and (f.exit_code is None or _implicates_node({**by_rank.get(f.rank, {}), "exit_code": f.exit_code}))
    ]


def plan_exclusion(excluded: Sequence[str], new: Sequence[str], partition_nodes: Sequence[str], nodes_needed: int):
    """Exclusions for the next job: old ones plus new failing nodes, never so many that fewer than
    nodes_needed partition nodes remain. Returns (exclude list, note about nodes left usable)."""
    out = list(dict.fromkeys(excluded))
    skipped = []
    for node in new:
        if node in out:
            continue
        usable = [n for n in partition_nodes if n not in out and n != node]
        if partition_nodes and len(usable) < nodes_needed:
            skipped.append(node)
            continue
        out.append(node)
    note = ""
    if skipped:
        note = (
            f"not excluding {', '.join(skipped)}: the partition would keep fewer than the "
            f"{nodes_needed} nodes the job needs"
        )
    return out, note
