"""The sweep summary: a Hydra callback that closes every `meshrun -m ...` with one table and sweep.json.

Built in the parent process from files, so it is right whichever Hydra launcher ran the points (in
this process, in joblib workers, in submitit jobs): on_job_end runs where the point ran and writes its
record, point.json, into the point's directory (launcher/records/point.py); on_multirun_end reads every
record of this sweep back, with plan.json of the feasible points, ranks the feasible points by
predicted step time (plan.json's predicted_step_s, launcher/plan/estimate.py), lists the infeasible ones
with their first reason, prints the table (at most WIDTH columns) and writes sweep.json into the sweep
directory; when a waited-for point did not complete, the sweep then exits 1. Registered in
conf/config.yaml (hydra.callbacks).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import uuid
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from launcher.plan.estimate import fmt_bytes, fmt_seconds
from launcher.records.point import read_points, write_point
from training.contract.exit_codes import EXIT_FAILED
from training.contract.layout_text import Layout, format_layout
from training.contract.rundir.paths import RunPaths

WIDTH = 120
"""Columns of the summary table."""
# Point statuses that count as feasible: planned (action=plan), launched, or what a dry run would launch.
FEASIBLE = ("ok", "submitted", "dry_run", "completed")


def _reason(record: dict[str, Any]) -> str:
    errors = record.get("errors") or []
    if errors:
        first = errors[0].splitlines()[0]
        return first.replace("error: ", "", 1)
    return str(record.get("reason", record.get("status", "?")))


def layout_label(plan: dict[str, Any], sp: bool) -> str:
    """The layout in a column's width: tp2·pp2·dp2 vpp1 sp (cp only when > 1)."""
    lay = Layout(tp=plan["tp"], pp=plan["pp"], cp=plan.get("cp", 1), dp=plan["dp"], vpp=plan["vpp"], sp=sp)
    return format_layout(lay, "column")


def point_record(config: DictConfig, job_return: JobReturn, sweep_id: str) -> dict[str, Any]:
    """What point.json holds for one finished job: its identity and its result without the plan
    (plan.json has it; a rejected plan leaves only its memory total)."""
    if job_return.status == JobStatus.COMPLETED:
        result = job_return.return_value
        if not isinstance(result, dict):
            result = {"status": "ok" if result is None else str(result)}
    else:  # the exception itself; return_value would raise it
        result = {"status": "failed", "reason": repr(job_return._return_value)}
    record: dict[str, Any] = {
        "sweep_id": sweep_id,
        "num": OmegaConf.select(config, "hydra.job.num"),
        "overrides": list(job_return.overrides or []),
        "run_dir": str(config.hydra.runtime.output_dir),
        # Sequence parallelism needs tp > 1 (with tp=1 it is off, launcher/plan/validate.py warns).
        "sp": bool(OmegaConf.select(config, "parallel.sp", default=False))
        and int(OmegaConf.select(config, "parallel.tp", default=1)) > 1,
    }
    record.update({k: v for k, v in result.items() if k not in ("plan", "issues")})
    plan = result.get("plan")
    if plan and record.get("status") not in FEASIBLE:
        record["memory_bytes"] = plan["memory_bytes"]["total"]
    return record


def _read_plan(run_dir: str) -> dict[str, Any] | None:
    try:
        with open(RunPaths(run_dir).plan) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Split point records into feasible (ranked: predicted step time, then most headroom) and infeasible."""
    feasible, infeasible = [], []
    for pt in points:
        row: dict[str, Any] = {
            "num": pt.get("num"),
            "overrides": pt.get("overrides", []),
            "status": pt.get("status", "?"),
        }
        for key in ("job_id",):
            if key in pt:
                row[key] = pt[key]
        if isinstance(pt.get("final"), dict):  # wait=true: how the submitted job ended
            row["state"] = pt["final"]["state"]
        plan = _read_plan(pt["run_dir"]) if pt.get("status") in FEASIBLE and pt.get("run_dir") else None
        if plan is not None:
            mem = plan["memory_bytes"]["total"]
            row.update(
                layout=layout_label(plan, bool(pt.get("sp"))),
                world_size=plan["world_size"],
                predicted_step_s=plan.get("predicted_step_s", 0.0),
                memory_bytes=mem,
                headroom_bytes=plan["gpu_memory_bytes"] - mem,
                bubble_ratio=plan["bubble_ratio"],
                run_dir=pt["run_dir"],
                tokens_per_s_per_gpu=plan.get("tokens_per_s_per_gpu", 0.0),
                mfu=plan.get("mfu", 0.0),
            )
            feasible.append(row)
        else:
            row["reason"] = _reason(pt) if pt.get("status") not in FEASIBLE else "plan.json missing"
            if "memory_bytes" in pt:
                row["memory_bytes"] = pt["memory_bytes"]
            infeasible.append(row)
    feasible.sort(key=lambda r: (r["predicted_step_s"], -r["headroom_bytes"], r["num"] or 0))
    return {"feasible": feasible, "infeasible": infeasible}


def common_overrides(points: list[dict[str, Any]]) -> list[str]:
    """Overrides every point has, in the first point's order (shown once above the table)."""
    if not points:
        return []
    rest = [set(p.get("overrides", [])) for p in points[1:]]
    return [o for o in points[0].get("overrides", []) if all(o in s for s in rest)]


def fmt_rate(x: float) -> str:
    """Tokens/s for a narrow column: 3 significant digits, k = 1e3, M = 1e6."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def short_keys(points: list[dict[str, Any]], common: list[str]) -> dict[str, str]:
    """Override key -> its last dotted part (parallel.micro_batch -> micro_batch) where no other swept
    key ends the same way, so a row's own overrides stay readable in the table's width."""
    keys = {o.split("=", 1)[0] for p in points for o in p.get("overrides", []) if o not in common}
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: k.rsplit(".", 1)[-1] if last.count(k.rsplit(".", 1)[-1]) == 1 else k for k in keys}


def format_summary(summary: dict[str, Any], common: list[str], short: dict[str, str] | None = None) -> str:
    """The table, every line at most WIDTH columns: the common overrides once, then one row per feasible
    point (rank, number, layout, predicted step time, tokens/s per GPU and MFU, memory and headroom per GPU,
    bubble, the point's
    own overrides with short keys, job id/state), then the infeasible points with their first reason."""
    feasible, infeasible = summary["feasible"], summary["infeasible"]
    common_set, short = set(common), short or {}

    def own(r: dict[str, Any]) -> str:
        mine = [o.split("=", 1) for o in r["overrides"] if o not in common_set]
        return " ".join(f"{short.get(k, k)}={v}" for k, v in mine) or "-"

    lines = [
        f"sweep summary: {len(feasible)} feasible, {len(infeasible)} infeasible; ranked by predicted step "
        f"time (compute, communication, bubble); memory per GPU"
    ]
    if common:
        lines += textwrap.wrap(
            "every point: " + " ".join(common), WIDTH, subsequent_indent="  ", break_on_hyphens=False
        )
    if feasible:
        lay_w = max(len("layout"), *(len(r["layout"]) for r in feasible))
        extras = [" ".join(f"{k}={r[k]}" for k in ("job_id", "state") if k in r) for r in feasible]
        head = (
            f"{'rank':>4} {'#':>3} {'layout':<{lay_w}} {'step':>8} {'tok/s/GPU':>9} {'MFU':>5} {'memory':>9} "
            f"{'headroom':>9} {'bubble':>6} "
        )
        extra_w = max(len(e) for e in extras)
        ov_w = max(WIDTH - len(head) - (extra_w + 1 if extra_w else 0), 16)
        lines.append(_fit(head + ("overrides".ljust(ov_w) + " job" if extra_w else "overrides"), WIDTH))
        lines.append("-" * min(WIDTH, len(head) + ov_w + (extra_w + 1 if extra_w else 0)))
        for i, (r, extra) in enumerate(zip(feasible, extras), 1):
            row = (
                f"{i:>4} {r['num']!s:>3} {r['layout']:<{lay_w}} {fmt_seconds(r['predicted_step_s']):>8} "
                f"{fmt_rate(r.get('tokens_per_s_per_gpu', 0.0)):>9} {100 * r.get('mfu', 0.0):>4.1f}% "
                f"{fmt_bytes(r['memory_bytes']):>9} {fmt_bytes(r['headroom_bytes']):>9} {r['bubble_ratio']:6.3f} "
            )
            tail = _fit(own(r), ov_w)
            lines.append(_fit((row + tail.ljust(ov_w) + " " + extra) if extra else row + tail, WIDTH))
    if infeasible:
        lines.append("infeasible (first reason):")
        ov_w = min(max(len(own(r)) for r in infeasible), 48)
        for r in infeasible:
            lines.append(
                _fit(f"{'x':>4} {r['num']!s:>4}  {_fit(own(r), ov_w):<{ov_w}}  {r['status']}: {r['reason']}", WIDTH)
            )
    return "\n".join(_fit(line, WIDTH) for line in lines)


class SweepSummary(Callback):
    """Writes each point's record where it ran; builds the summary table and sweep.json from them."""

    def __init__(self) -> None:
        self.sweep_id = ""
        """Set in the parent when the sweep starts; travels to the points with the callback object
        (pickled by joblib/submitit) so records of an older sweep in the same directory are ignored."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_id = uuid.uuid4().hex
        from launcher.manage.latest import point_latest

        sweep_dir = str(config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)  # Hydra's launchers create it too; the link must not dangle
        point_latest(sweep_dir)  # multirun/latest names the newest sweep (launcher/manage/latest.py)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not self.sweep_id or OmegaConf.select(config, "hydra.mode") != RunMode.MULTIRUN:
            return  # a single run has no summary
        record = point_record(config, job_return, self.sweep_id)
        write_point(record["run_dir"], record)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        points = read_points(sweep_dir, self.sweep_id) if os.path.isdir(sweep_dir) else []
        summary = summarize(points)
        common = common_overrides(points)
        print(format_summary(summary, common, short_keys(points, common)))
        os.makedirs(sweep_dir, exist_ok=True)
        path = RunPaths(sweep_dir).sweep
        with open(path, "w") as f:
            json.dump({"common_overrides": common, "points": points, **summary}, f, indent=2, default=str)
        print(f"sweep.json: {os.path.abspath(path)}")
        ended_badly = [r for r in summary["feasible"] if r.get("state", "COMPLETED") != "COMPLETED"]
        if ended_badly:  # wait=true: a script waiting on the sweep must see that a point failed
            print(
                f"meshrun: {len(ended_badly)} sweep point(s) did not complete: "
                + ", ".join(f"#{r['num']} {r['state']}" for r in ended_badly),
                file=sys.stderr,
            )
            raise SystemExit(EXIT_FAILED)
