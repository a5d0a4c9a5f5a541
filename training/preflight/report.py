"""Check results, their verdict per node and for the job, the table and preflight.json.

Pure Python (no torch): the launcher reads preflight.json with the same helpers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths

OK, WARN, FAIL = "ok", "warn", "fail"
_RANK = {OK: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    """One finding."""

    name: str
    """Dotted check name, e.g. gpu.ecc, ib.state, os.swappiness, coll.all_reduce."""
    status: str
    """ok | warn | fail (fail on a node makes that node bad)."""
    reason: str = ""
    """Why, in words a person on call understands."""
    found: Any = None
    """The value seen."""
    expected: Any = None
    """The value wanted (recommended for OS tunables)."""
    subject: str = ""
    """What was checked inside the node: gpu0, mlx5_0/1, sda, rank3, group[0-1] ..."""
    node: str = ""
    """Host the check ran on; empty for job-wide findings."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def worst(statuses: Iterable[str]) -> str:
    out = OK
    for s in statuses:
        if _RANK[s] > _RANK[out]:
            out = s
    return out


def ok(name, reason="", **kw) -> Check:
    return Check(name, OK, reason, **kw)


def warn(name, reason, **kw) -> Check:
    return Check(name, WARN, reason, **kw)


def fail(name, reason, **kw) -> Check:
    return Check(name, FAIL, reason, **kw)


@dataclass
class Report:
    """All checks of one preflight run, with verdicts."""

    checks: list[Check] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    """Every node of the job, also those without a failing check."""
    meta: dict[str, Any] = field(default_factory=dict)
    """mode, world_size, elapsed_s, versions ..."""

    def node_status(self) -> dict[str, str]:
        out = {n: OK for n in self.nodes}
        for c in self.checks:
            if c.node:
                out[c.node] = worst([out.get(c.node, OK), c.status])
        return out

    @property
    def bad_nodes(self) -> list[str]:
        return sorted(n for n, s in self.node_status().items() if s == FAIL)

    @property
    def status(self) -> str:
        return worst(c.status for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "bad_nodes": self.bad_nodes,
            "nodes": self.node_status(),
            "meta": self.meta,
            "checks": [c.to_dict() for c in self.checks],
        }

    def write(self, run_dir: str) -> str:
        path = RunPaths(run_dir).preflight
        write_atomic(path, json.dumps(self.to_dict(), indent=2, default=str))  # readers never see half a file
        return path


def checks_from_dicts(items: list[dict[str, Any]]) -> list[Check]:
    return [Check(**d) for d in items]


def _short(value: Any, width: int = 36) -> str:
    if value is None:
        text = ""
    elif isinstance(value, dict):
        text = " ".join(f"{k}={v}" for k, v in value.items())
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(data: dict[str, Any], show_ok: bool = True) -> str:
    """The readable table of a preflight.json dict: one line per check, then the verdicts."""
    rows = [("status", "node", "check", "subject", "found", "expected", "reason")]
    for c in data["checks"]:
        if c["status"] == OK and not show_ok:
            continue
        rows.append(
            (
                c["status"].upper(),
                c["node"] or "(job)",
                c["name"],
                c["subject"],
                _short(c["found"]),
                _short(c["expected"]),
                c["reason"],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(6)) + "  " + r[6] for r in rows]
    lines.append("")
    for node, status in sorted(data["nodes"].items()):
        lines.append(f"node {node}: {status.upper()}")
    bad = data["bad_nodes"]
    lines.append(f"job: {data['status'].upper()}" + (f" (bad nodes: {','.join(bad)})" if bad else ""))
    return "\n".join(lines)
