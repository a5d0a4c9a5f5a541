"""The sweep summary: a Hydra callback that closes every `meshrun -m ...` with one table and sweep.json.

Each job's return value (the dict from plan_or_reject, or from a launcher: it may carry job_id and
run_dir, and with wait=true the final state) is collected in on_job_end; on_multirun_end ranks the
feasible points by memory headroom (most first) then bubble (least first), lists the infeasible ones
with their first reason, prints the table and writes sweep.json into the sweep directory; when a
waited-for point did not complete, the sweep then exits 1. Registered in conf/config.yaml
(hydra.callbacks)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

GIB = 2**30


def _reason(ret: Dict[str, Any]) -> str:
    errors = ret.get("errors") or []
    if errors:
        first = errors[0].splitlines()[0]
        return first.replace("error: ", "", 1)
    return str(ret.get("reason", ret.get("status", "?")))


def summarize(points: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Split points into feasible (ranked) and infeasible; each point: overrides, num, result."""
    feasible, infeasible = [], []
    for pt in points:
        res = pt.get("result") or {}
        plan = res.get("plan") or {}
        row = {"num": pt.get("num"), "overrides": pt.get("overrides", []), "status": res.get("status", "?")}
        for key in ("job_id", "run_dir"):
            if key in res:
                row[key] = res[key]
        if "final" in res:  # wait=true: how the submitted job ended
            row["state"] = res["final"]["state"]
        if res.get("status") in ("ok", "submitted") and plan:
            mem = plan["memory_bytes"]["total"]
            row.update(memory_bytes=mem, headroom_bytes=plan["gpu_memory_bytes"] - mem,
                       bubble_ratio=plan["bubble_ratio"], world_size=plan["world_size"],
                       layout=f"tp{plan['tp']} pp{plan['pp']} cp{plan['cp']} dp{plan['dp']} vpp{plan['vpp']}")
            feasible.append(row)
        else:
            row["reason"] = _reason(res)
            if plan:
                row["memory_bytes"] = plan["memory_bytes"]["total"]
            infeasible.append(row)
    feasible.sort(key=lambda r: (-r["headroom_bytes"], r["bubble_ratio"]))
    return {"feasible": feasible, "infeasible": infeasible}


def format_summary(summary: Dict[str, Any]) -> str:
    """One table: rank, point number, overrides, memory/headroom (GiB = 2^30 B), bubble, job id / run dir."""
    mems = [r["memory_bytes"] for r in summary["feasible"] + summary["infeasible"] if "memory_bytes" in r]
    unit, scale = ("GiB", GIB) if max(mems, default=GIB) >= GIB else ("MiB", 2**20)
    lines = [f"sweep summary: {len(summary['feasible'])} feasible, {len(summary['infeasible'])} infeasible "
             f"(memory per GPU in {unit} = {scale} bytes; ranked by headroom, then bubble)"]
    header = f"{'rank':>4} {'#':>3}  {'mem ' + unit:>8} {'free ' + unit:>8} {'bubble':>7}  {'overrides':<50} extra"
    lines.append(header)
    lines.append("-" * len(header))
    for i, r in enumerate(summary["feasible"], 1):
        extra = " ".join(f"{k}={r[k]}" for k in ("job_id", "state", "run_dir") if k in r)
        lines.append(f"{i:>4} {r['num']!s:>3}  {r['memory_bytes'] / scale:8.2f} {r['headroom_bytes'] / scale:8.2f} "
                     f"{r['bubble_ratio']:7.3f}  {' '.join(r['overrides']):<50} {extra}")
    for r in summary["infeasible"]:
        mem = f"{r['memory_bytes'] / scale:8.2f}" if "memory_bytes" in r else f"{'-':>8}"
        lines.append(f"{'x':>4} {r['num']!s:>3}  {mem} {'-':>8} {'-':>7}  {' '.join(r['overrides']):<50} "
                     f"{r['status']}: {r['reason']}")
    return "\n".join(lines)


class SweepSummary(Callback):
    """Collects each job's result and writes the sweep's summary table and sweep.json."""

    def __init__(self) -> None:
        self.points: List[Dict[str, Any]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.points = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.COMPLETED:
            result = job_return.return_value
            if not isinstance(result, dict):
                result = {"status": "ok" if result is None else str(result)}
        else:
            result = {"status": "failed", "reason": repr(job_return._return_value)}
        num = None
        try:
            num = config.hydra.job.num
        except Exception:  # RUN mode has no job number; the callback only matters in MULTIRUN
            pass
        self.points.append({"num": num, "overrides": list(job_return.overrides or []), "result": result})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summary = summarize(self.points)
        print(format_summary(summary))
        sweep_dir = str(config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)
        path = os.path.join(sweep_dir, "sweep.json")
        with open(path, "w") as f:
            json.dump({"points": self.points, **summary}, f, indent=2, default=str)
        print(f"sweep.json: {os.path.abspath(path)}")
        ended_badly = [r for r in summary["feasible"] if r.get("state", "COMPLETED") != "COMPLETED"]
        if ended_badly:  # wait=true: a script waiting on the sweep must see that a point failed
            print(f"meshrun: {len(ended_badly)} sweep point(s) did not complete: "
                  + ", ".join(f"#{r['num']} {r['state']}" for r in ended_badly), file=sys.stderr)
            raise SystemExit(1)
