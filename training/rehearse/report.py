"""The rehearsal's table and run.dir/rehearsal.json (pure Python)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from training.rehearse.checks import Defect
from training.rehearse.memory import PARTS, compare, plan_for_stage

PHASES = ("setup", "forward_backward", "optimizer", "save", "resume")


def group_kind(call, kinds: dict[str, tuple], world: int) -> str:
    """The mesh kind(s) of a call's group ("tp", "dp/dp_cp", "world", "p2p:pp")."""
    if call.op in ("new_group", "new_subgroups"):
        return "setup"
    g = tuple(call.group)
    names = [k for k, ranks in kinds.items() if tuple(ranks) == g]
    name = "/".join(names) if names else ("world" if len(g) == world else f"other[{len(g)}]")
    return f"p2p:{name}" if call.op in ("isend", "irecv", "send", "recv") else name


def counts(result, world: int) -> dict[str, dict[str, int]]:
    """{group kind: {phase: calls}} of one rank."""
    out: dict[str, Counter] = defaultdict(Counter)
    for c in result.calls:
        out[group_kind(c, result.groups, world)][c.phase or "setup"] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def to_json(
    layout: dict[str, Any], results, why: dict[int, str], defects: list[Defect], plan: dict | None, seconds: float
) -> dict[str, Any]:
    """rehearsal.json's content (docs/REHEARSAL.md)."""
    world = layout["world_size"]
    ranks = []
    for r in sorted(results, key=lambda x: x.rank):
        ranks.append(
            {
                "rank": r.rank,
                "coords": r.coords,
                "why": why.get(r.rank, ""),
                "seconds": round(r.seconds, 3),
                "error": r.error,
                "calls": len(r.calls),
                "collectives": counts(r, world),
                "memory": compare(r.memory, plan_for_stage(plan or {}, r.coords.get("pp", 0))) if r.memory else [],
                "peak_bytes": int(r.memory.get("peak", 0)),
            }
        )
    return {
        "layout": layout,
        "rehearsed_ranks": len(results),
        "representative": len(results) < world,
        "seconds": round(seconds, 3),
        "ok": not defects and not any(r.error for r in results),
        "defects": [d.to_json() for d in defects],
        "ranks": ranks,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:8.2f}"


def table(doc: dict[str, Any]) -> str:
    """The readable summary: memory by part per stage (worst rank), collectives per group kind and phase,
    then OK or the defects (the first in full)."""
    lay = doc["layout"]
    lines = [
        f"rehearsal  world {lay['world_size']} = tp {lay['tp']} x pp {lay['pp']} x cp {lay['cp']} x dp {lay['dp']}"
        f" (ep {lay['ep']}, zero {lay['zero']}, vpp {lay['vpp']});  {doc['rehearsed_ranks']} rank(s) rehearsed"
        + (" (representative mode)" if doc["representative"] else "")
        + f" in {doc['seconds']:.1f} s"
    ]
    by_stage: dict[int, dict[str, Any]] = {}
    for r in doc["ranks"]:
        if not r["memory"]:
            continue
        stage = r["coords"].get("pp", 0)
        if stage not in by_stage or r["peak_bytes"] > by_stage[stage]["peak_bytes"]:
            by_stage[stage] = r
    if by_stage:
        lines.append("memory (GiB, worst rank of each stage): part  rehearsed  planned  difference")
        for stage, r in sorted(by_stage.items()):
            lines.append(f"  stage {stage} (rank {r['rank']})")
            for row in r["memory"]:
                if not row["rehearsed"] and not row["planned"]:
                    continue
                diff = "" if row["difference"] is None else f"{row['difference'] * 100:+6.1f} %"
                mark = "" if row["ok"] else "   <- differs"
                lines.append(f"    {row['part']:<19}{_gib(row['rehearsed'])} {_gib(row['planned'])}   {diff}{mark}")
    total: dict[str, Counter] = defaultdict(Counter)
    for r in doc["ranks"]:
        for kind, per in r["collectives"].items():
            total[kind].update(per)
    if total:
        lines.append("calls (all rehearsed ranks) per group kind and phase: " + "  ".join(PHASES))
        for kind, per in sorted(total.items()):
            lines.append(f"  {kind:<24}" + "".join(f"{per.get(p, 0):>10}" for p in PHASES))
    errors = [r for r in doc["ranks"] if r["error"]]
    for r in errors[:3]:
        lines.append(
            f"ERROR rank {r['rank']}: the engine did not run on meta:\n    " + r["error"].replace("\n", "\n    ")
        )
    if doc["defects"]:
        first = doc["defects"][0]
        lines.append(f"DEFECT ({len(doc['defects'])} found) {first['kind']}: {first['message']}")
        for rank, seq in first["sequences"].items():
            lines.append(f"  rank {rank}:")
            lines.extend(f"    {s}" for s in seq)
        for d in doc["defects"][1:6]:
            lines.append(f"DEFECT {d['kind']}: {d['message']}")
    elif not errors:
        lines.append(
            "OK: collectives match, no deadlock under NCCL's rules, no tensor off the device"
            + (", memory as planned" if by_stage else "")
        )
    return "\n".join(lines)


__all__ = ["PARTS", "table", "to_json"]
