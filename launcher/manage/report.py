"""`meshrun action=report run.dir=D`: PNG plots of a run (or a sweep) and one self-contained report.html.

A run: train/eval loss, lr, tokens/s, MFU, per-rank step times, memory against plan.json and the GPU health
samples, each with the run's life marked from events.jsonl (attempts, requeues with their excluded nodes,
checkpoints, health and straggler events). A sweep (a directory holding sweep.json): every feasible point's
measured tokens/s and peak memory beside the plan's prediction. Everything lands in D/report/: the PNGs and
report.html with the same images embedded as data: URIs, so the one file can be mailed or opened offline.
A series the files do not carry is skipped with a note in the report, never an error.

Pure Python plus matplotlib (the Agg backend: no display needed); never imports torch.
"""

from __future__ import annotations

import base64
import bisect
import html
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from training.contract.exit_codes import EXIT_INVALID, EXIT_OK
from training.contract.rundir.files import atomic_path
from training.contract.rundir.metrics import read_rows
from training.contract.rundir.paths import RunPaths

GIB = 2.0**30


@dataclass
class Figure:
    """One plot of the report."""

    name: str
    """File name stem (report/<name>.png)."""
    title: str
    """Heading above it in report.html."""
    path: str = ""
    """Where the PNG was written."""


@dataclass
class Report:
    """What was plotted and what was skipped (and why)."""

    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)


# ---- reading the run directory ---------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Rows of a JSON Lines file; a torn last line (a crash mid-write) is skipped, and so is a line beyond
    training/contract/rundir/lines.py's MAX_LINE_BYTES (never read whole); a file that is not regular reads as none."""
    from training.contract.rundir.lines import read_objects

    return [row for row in read_objects(path) if isinstance(row, dict)]


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def latest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last written (a resumed attempt redoes steps newer than its checkpoint), by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if isinstance(row.get("step"), (int, float)):
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry a finite number under key."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(row["step"]))
            ys.append(float(v))
    return xs, ys


@dataclass
class Marker:
    """A vertical line on every step plot: an event of the run's life."""

    step: float
    label: str
    kind: str
    """attempt | requeue | checkpoint | health | straggler | nan."""


_STYLE = {
    "attempt": ("tab:green", "-"),
    "requeue": ("tab:red", "--"),
    "checkpoint": ("tab:gray", ":"),
    "health": ("tab:orange", "-."),
    "straggler": ("tab:purple", "-."),
    "nan": ("black", "-"),
}


def _step_at(when: float, rows: list[dict[str, Any]]) -> float | None:
    """The step the run had reached at Unix time `when`, from the metrics rows' `time` field."""
    timed = sorted(
        (float(r["time"]), int(r["step"]))
        for r in rows
        if isinstance(r.get("time"), (int, float)) and isinstance(r.get("step"), int)
    )
    if not timed:
        return None
    i = bisect.bisect_right([t for t, _ in timed], when)
    return float(timed[i - 1][1]) if i > 0 else 0.0


def markers(events: list[dict[str, Any]], raw_rows: list[dict[str, Any]]) -> tuple[list[Marker], list[str]]:
    """Markers from events.jsonl; events that carry no step are placed by time (metrics rows carry `time`)."""
    out: list[Marker] = []
    unplaced: list[str] = []

    def place(ev: dict[str, Any]) -> float | None:
        for key in ("step", "last_step"):
            if isinstance(ev.get(key), (int, float)):
                return float(ev[key])
        if isinstance(ev.get("time"), (int, float)):
            return _step_at(float(ev["time"]), raw_rows)
        return None

    for ev in events:
        kind = ev.get("event")
        label, mk = "", ""
        if kind == "started":
            mk, label = "attempt", f"attempt {ev.get('attempt', 0)}"
        elif kind == "resumed":
            mk, label = "attempt", f"resumed @ {ev.get('step')}"
        elif kind == "requeued":
            mk = "requeue"
            excluded = ev.get("excluded_nodes") or []
            label = f"requeue ({ev.get('cause', '?')})" + (f" excl. {','.join(map(str, excluded))}" if excluded else "")
        elif kind == "checkpoint":
            mk, label = "checkpoint", f"ckpt {ev.get('step')}"
        elif kind == "health":
            mk, label = "health", f"health {ev.get('node', '?')}: {ev.get('kind', '')}"
        elif kind == "straggler":
            mk, label = "straggler", f"straggler rank {ev.get('rank')} ({ev.get('node', '?')})"
        elif kind == "nonfinite":
            mk, label = "nan", f"non-finite: rank {ev.get('rank')} {ev.get('layer', '')}"
        if not mk:
            continue
        step = place(ev)
        if step is None:
            unplaced.append(label)
            continue
        out.append(Marker(step, label, mk))
    return out, unplaced


# ---- plotting --------------------------------------------------------------------------------------
def _pyplot():
    import logging

    # Hydra logs INFO to stdout, where this action prints exactly one JSON object: matplotlib's INFO lines
    # ("generated new fontManager" on a first run) must not land there.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")  # headless: no display, the same PNGs everywhere
    import matplotlib.pyplot as plt

    return plt


LABEL_NEAR = 0.03
"""Labels of markers closer than this share of the x axis stand side by side, not on top of each other."""


def label_columns(steps: list[float], span: float) -> list[int]:
    """The column (0, 1, ...: 7 points further left each) of each marker's label: a label within LABEL_NEAR x span
    of an earlier one takes the next free column, so labels at the same or nearby steps never overlap."""
    placed: list[tuple[float, int]] = []
    out = []
    for step in steps:
        near = {k for s, k in placed if abs(s - step) <= LABEL_NEAR * span}
        k = next(i for i in range(len(near) + 1) if i not in near)
        placed.append((step, k))
        out.append(k)
    return out


def _mark(ax, marks: list[Marker], labelled: bool) -> None:
    seen = set()
    lo, hi = ax.get_xlim()
    shown = [m for m in marks if m.kind != "checkpoint"]
    column = dict(zip(map(id, shown), label_columns([m.step for m in shown], max(hi - lo, 1e-9))))
    for m in marks:
        color, style = _STYLE[m.kind]
        # One legend entry per kind; the text of every marker goes into the figure as a small label.
        ax.axvline(
            m.step, color=color, linestyle=style, linewidth=1, label=m.kind if m.kind not in seen else None, alpha=0.7
        )
        seen.add(m.kind)
        if labelled and m.kind != "checkpoint":
            k = column[id(m)]  # labels of nearby steps side by side, not on top
            ax.annotate(
                m.label,
                (m.step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=6,
                va="top",
                ha="right",
                color=color,
                xytext=(-7 * k, 0),
                textcoords="offset points",
            )


def _save(plt, fig, out_dir: str, figure: Figure, report: Report) -> None:
    figure.path = os.path.join(out_dir, figure.name + ".png")
    fig.tight_layout()
    with atomic_path(figure.path, suffix=".png") as tmp:  # never a half-written image under the final name
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
    report.figures.append(figure)


def _step_plot(plt, out_dir, report, name, title, lines, marks, ylabel, logy=False):
    """lines: [(label, (xs, ys))]; skipped with a note when every series is empty."""
    present = [(label, xy) for label, xy in lines if xy[0]]
    if not present:
        report.notes.append(
            f"{title}: not plotted, metrics.jsonl carries no " + " / ".join(label for label, _ in lines)
        )
        return
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for label, (xs, ys) in present:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.2, label=label)
    _mark(ax, marks, labelled=True)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if logy and all(y > 0 for _, (_, ys) in present for y in ys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title, fontsize=10)
    _save(plt, fig, out_dir, Figure(name, title), report)


def _rank_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Per-rank step-time series the metrics carry: scalar keys step_time_* (slowest/fastest rank, ...)."""
    keys = set()
    for row in rows:
        for k, v in row.items():
            if k.startswith("step_time_") and k != "step_time_s" and isinstance(v, (int, float)):
                keys.add(k)
    return sorted(keys)


def _memory_keys(rows: list[dict[str, Any]]) -> list[str]:
    keys = set()
    for row in rows:
        for k, v in row.items():
            if "memory" in k and k.endswith("bytes") and isinstance(v, (int, float)):
                keys.add(k)
    return sorted(keys)


def _lr_lines(run_dir: str, rows: list[dict[str, Any]]):
    """The logged lr and, from config.json, the whole schedule the run follows (training/contract/lr_schedule.py): the
    curve resuming and stopping early never change, so the logged points must lie on it."""
    lines = [("lr", series(rows, "lr"))]
    title = "Learning rate"
    cfg_data = read_json(RunPaths(run_dir).config)
    if cfg_data:
        from training.contract.config import config_from_dict
        from training.contract.lr_schedule import lr_curve

        try:
            train = config_from_dict(cfg_data).train
            curve = lr_curve(train)
        except (KeyError, TypeError, ValueError):
            return title, lines  # a config.json of another version: the logged values only
        title = f"Learning rate ({train.lr_schedule}, warm-up {train.warmup_steps})"
        # metrics' `lr` of step n is the rate step n - 1 (0-based) ran with.
        lines.append((f"{train.lr_schedule} schedule", (list(range(1, len(curve) + 1)), curve)))
    return title, lines


def run_summary(run_dir: str, rows: list[dict[str, Any]], plan: dict[str, Any]) -> list[tuple[str, str]]:
    """What was trained and how it went, first in report.html: model, layout, steps done/total, the last training
    and eval losses, tokens/s, MFU and the run's state (action=status's)."""
    config = read_json(RunPaths(run_dir).config) or {}
    last = rows[-1] if rows else {}
    evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    out = [("model", str((config.get("model") or {}).get("name", "?")))]
    if plan:
        out.append(("layout", " x ".join(f"{k} {plan[k]}" for k in ("tp", "pp", "cp", "dp") if k in plan)))
    total = (config.get("train") or {}).get("steps", "?")
    out.append(("steps", f"{last.get('step', 0)} / {total}"))
    for name, value, fmt in (
        ("final loss", last.get("loss"), "{:.4f}"),
        ("eval loss", evals[-1]["eval_loss"] if evals else None, "{:.4f}"),
        ("tokens/s", last.get("tokens_per_s"), "{:.4g}"),
        ("MFU", 100 * last["mfu"] if isinstance(last.get("mfu"), (int, float)) else None, "{:.2f} %"),
    ):
        out.append((name, fmt.format(value) if isinstance(value, (int, float)) else "-"))
    try:
        from launcher.manage.status import run_status

        out.append(("state", str(run_status(run_dir).get("state", "?"))))
    except Exception as exc:  # a copied folder without its Slurm cluster: the rest of the report still stands
        out.append(("state", f"unknown ({exc.__class__.__name__})"))
    return out


def plot_run(run_dir: str, out_dir: str, plt, report: Report) -> None:
    raw = read_rows(run_dir)
    rows = latest_rows(raw)
    paths = RunPaths(run_dir)
    events = read_jsonl(paths.events)
    plan = read_json(paths.plan) or {}
    summary = read_json(paths.summary) or {}
    marks, unplaced = markers(events, raw)
    if unplaced:
        report.notes.append("events without a step or a time the metrics reach (not marked): " + "; ".join(unplaced))
    report.facts += run_summary(run_dir, rows, plan)
    report.facts += [
        ("run.dir", run_dir),
        ("steps logged", str(len(rows))),
        ("attempts", str(len({e.get("attempt", 0) for e in events if e.get("event") == "started"}) or 1)),
        ("requeues", str(sum(e.get("event") == "requeued" for e in events))),
        ("checkpoints", str(sum(e.get("event") == "checkpoint" for e in events))),
    ]
    excluded = sorted({n for e in events for n in (e.get("excluded_nodes") or [])})
    if excluded:
        report.facts.append(("excluded nodes", ", ".join(excluded)))
    if not rows:
        report.notes.append(f"{run_dir}/metrics.jsonl holds no steps yet: nothing to plot")
        return

    _step_plot(
        plt,
        out_dir,
        report,
        "loss",
        "Loss",
        [("train loss", series(rows, "loss")), ("eval loss", series(rows, "eval_loss"))],
        marks,
        "loss",
    )
    lr_title, lr_lines = _lr_lines(run_dir, rows)
    _step_plot(plt, out_dir, report, "lr", lr_title, lr_lines, marks, "lr")
    _step_plot(
        plt,
        out_dir,
        report,
        "tokens_per_s",
        "Throughput",
        [("tokens/s", series(rows, "tokens_per_s"))],
        marks,
        "tokens/s",
    )
    mfu = series(rows, "mfu")
    _step_plot(plt, out_dir, report, "mfu", "MFU", [("MFU %", (mfu[0], [100 * v for v in mfu[1]]))], marks, "%")
    rank_lines = [("step time (rank 0)", series(rows, "step_time_s"))]
    rank_lines += [(k, series(rows, k)) for k in _rank_keys(rows)]
    if len(rank_lines) == 1:
        report.notes.append(
            "Step time per rank: metrics.jsonl carries only rank 0's step_time_s "
            "(no step_time_* series of the other ranks)"
        )
    _step_plot(plt, out_dir, report, "step_times", "Step time per rank", rank_lines, marks, "seconds")
    _memory_plot(plt, out_dir, report, rows, plan, summary, marks)
    _health_plot(plt, out_dir, report, run_dir, marks)
    _goodput_plot(plt, out_dir, report, run_dir)
    _moe_load_plot(plt, out_dir, report, rows, marks)


_CAUSE_COLOR = {
    "queue": "#bbbbbb",
    "startup": "#f0c05a",
    "productive": "#4c9a4c",
    "lost_steps": "#d9534f",
    "checkpoint_blocking": "#5b7fc7",
    "eval": "#9b6bc7",
    "restart_gap": "#333333",
}


def _goodput_plot(plt, out_dir, report, run_dir) -> None:
    """The attempts as a time line, one row per attempt, coloured by cause (launcher/records/goodput.py); writes
    run_dir/goodput.json; its seconds per cause go into the facts."""
    from launcher.records.goodput import CAUSES, write_goodput

    g = write_goodput(run_dir)
    if not g:
        report.notes.append("Goodput: no attempt has started yet")
        return
    report.facts.append(
        (
            "goodput",
            f"{100 * g['goodput']:.1f} % of {g['wall_s']:.0f} s wall: "
            + ", ".join(f"{c} {g[c]:.1f} s" for c in CAUSES if g[c] > 0)
            + f"; {g['lost_step_count']} step(s) lost",
        )
    )
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.45 * (g["attempts"] + 1)))
    seen = set()
    # Time outside every attempt (a run still waiting after its last one) goes on a row of its own, "-".
    rows = (["-"] if any(a is None for *_, a in g["timeline"]) else []) + list(range(g["attempts"]))
    for cause, start, dur, attempt in g["timeline"]:
        ax.broken_barh(
            [(start, dur)],
            (rows.index("-" if attempt is None else attempt) - 0.4, 0.8),
            color=_CAUSE_COLOR[cause],
            label=cause if cause not in seen else None,
        )
        seen.add(cause)
    ax.set_yticks(range(len(rows)), [r if r == "-" else f"attempt {r}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("s since submission")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = f"Attempts: goodput {100 * g['goodput']:.1f} %"
    ax.set_title(title, fontsize=10)
    _save(plt, fig, out_dir, Figure("goodput", title), report)


def _moe_load_plot(plt, out_dir, report, rows, marks) -> None:
    """Mixture of experts: the load balance per step, `moe_max_load` (the busiest expert's tokens over the mean,
    the largest over layers; 1 is perfect balance) against that ideal, and the dropped tokens in the title.
    Dense runs carry no such rows: no figure and no note."""
    load = series(rows, "moe_max_load")
    if not load[0]:
        return
    dropped = sum(int(r.get("moe_dropped_tokens") or 0) for r in rows)
    title = "Expert load balance (max tokens per expert / mean)" + (f", {dropped} tokens dropped" if dropped else "")
    ideal = ([load[0][0], load[0][-1]], [1.0, 1.0])
    _step_plot(
        plt,
        out_dir,
        report,
        "moe_load",
        title,
        [("moe_max_load", load), ("balanced (1.0)", ideal)],
        marks,
        "max / mean",
    )


def _memory_plot(plt, out_dir, report, rows, plan, summary, marks) -> None:
    planned = (plan.get("memory_bytes") or {}).get("total")
    capacity = plan.get("gpu_memory_bytes")
    lines = [(k, series(rows, k)) for k in _memory_keys(rows)]
    per_rank = summary.get("peak_memory_bytes_per_rank") or []
    if not any(xs for _, (xs, _) in lines) and not per_rank:
        report.notes.append("Memory: no measured memory (neither metrics memory fields nor summary.json)")
        return
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for label, (xs, ys) in lines:
        if xs:
            ax.plot(xs, [y / GIB for y in ys], label=label)
    if per_rank:
        # The run's end: each rank's peak (summary.json), drawn at the last step.
        last = rows[-1]["step"]
        ax.scatter(
            [last] * len(per_rank),
            [b / GIB for b in per_rank],
            s=12,
            color="tab:blue",
            label="peak per rank (summary.json)",
            zorder=3,
        )
    if planned:
        ax.axhline(planned / GIB, color="tab:red", linestyle="--", label="plan: memory total")
    else:
        report.notes.append("Memory: plan.json has no memory_bytes.total to compare against")
    if capacity:
        ax.axhline(capacity / GIB, color="black", linestyle=":", label="device memory (plan)")
    _mark(ax, [m for m in marks if m.kind != "checkpoint"], labelled=False)
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title("Memory against the plan", fontsize=10)
    _save(plt, fig, out_dir, Figure("memory", "Memory against the plan"), report)


_HEALTH = (("utilization_pct", "utilisation %"), ("temperature_c", "temperature °C"), ("power_w", "power W"))


def _health_plot(plt, out_dir, report, run_dir, marks) -> None:
    """health.jsonl (training/observe/health.py): one line per GPU and quantity, against time since the start."""
    rows = read_jsonl(RunPaths(run_dir).health)
    if not rows:
        report.notes.append(
            "GPU health: no health.jsonl (no GPU sampler ran: CPU without an NVML double, "
            "or cluster.health.enabled=false)"
        )
        return
    t0 = min(float(r.get("time", 0.0)) for r in rows)
    fig, axes = plt.subplots(1, len(_HEALTH), figsize=(10, 2.8))
    for ax, (key, label) in zip(axes, _HEALTH):
        by_gpu: dict[str, tuple[list[float], list[float]]] = {}
        for r in rows:
            v = r.get(key)
            if isinstance(v, (int, float)):
                xs, ys = by_gpu.setdefault(f"{r.get('node', '?')}/gpu{r.get('gpu', 0)}", ([], []))
                xs.append(float(r.get("time", t0)) - t0)
                ys.append(float(v))
        for name, (xs, ys) in sorted(by_gpu.items()):
            ax.plot(xs, ys, label=name, linewidth=1)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("s since first sample", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    _save(plt, fig, out_dir, Figure("health", "GPU health samples"), report)


def sweep_points(sweep_dir: str) -> list[dict[str, Any]]:
    """Every feasible point of sweep.json: label, measured tokens/s (mean over its logged steps after the first)
    and peak memory (GiB, the largest rank's, summary.json) beside the plan's tokens/s (tokens_per_step /
    predicted_step_s) and memory total; NaN where a point has not run."""
    sweep = read_json(RunPaths(sweep_dir).sweep) or {}
    out = []
    for pt in sweep.get("feasible") or []:
        run_dir = pt.get("run_dir") or ""
        plan = read_json(RunPaths(run_dir).plan) or {}
        rows = latest_rows(read_rows(run_dir))
        summary = read_json(RunPaths(run_dir).summary) or {}
        rates = [r["tokens_per_s"] for r in (rows[1:] or rows) if isinstance(r.get("tokens_per_s"), (int, float))]
        step_s, tokens = plan.get("predicted_step_s"), plan.get("tokens_per_step")
        peaks = summary.get("peak_memory_bytes_per_rank") or []
        planned = pt.get("memory_bytes") or (plan.get("memory_bytes") or {}).get("total")
        out.append(
            {
                "label": f"#{pt.get('num')} {pt.get('layout', '')}",
                "measured_tokens_per_s": sum(rates) / len(rates) if rates else float("nan"),
                "plan_tokens_per_s": tokens / step_s if step_s and tokens else float("nan"),
                "measured_memory_gib": max(peaks) / GIB if peaks else float("nan"),
                "plan_memory_gib": planned / GIB if planned else float("nan"),
            }
        )
    return out


def plot_sweep(sweep_dir: str, out_dir: str, plt, report: Report) -> None:
    """Measured tokens/s and peak memory of every feasible point beside the plan's prediction."""
    sweep = read_json(RunPaths(sweep_dir).sweep) or {}
    points = sweep_points(sweep_dir)
    labels = [p["label"] for p in points]
    measured_tps = [p["measured_tokens_per_s"] for p in points]
    predicted_tps = [p["plan_tokens_per_s"] for p in points]
    measured_mem = [p["measured_memory_gib"] for p in points]
    planned_mem = [p["plan_memory_gib"] for p in points]
    report.facts += [
        ("sweep", sweep_dir),
        ("feasible points", str(len(points))),
        ("infeasible points", str(len(sweep.get("infeasible") or []))),
    ]
    if not points:
        report.notes.append("the sweep has no feasible point: nothing to plot")
        return
    if all(math.isnan(v) for v in measured_tps):
        report.notes.append("no point has metrics yet (an action=plan sweep): measured bars are empty")
    for name, title, measured, predicted, unit in (
        ("sweep_tokens_per_s", "Tokens/s per point: measured vs plan", measured_tps, predicted_tps, "tokens/s"),
        ("sweep_memory", "Memory per point: measured peak vs plan", measured_mem, planned_mem, "GiB"),
    ):
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels) + 3), 3.4))
        xs = list(range(len(labels)))
        ax.bar([x - 0.2 for x in xs], [0 if math.isnan(v) else v for v in measured], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [0 if math.isnan(v) else v for v in predicted], 0.4, label="plan")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        if unit == "tokens/s" and all(v > 0 for v in measured + predicted if not math.isnan(v)):
            ax.set_yscale("log")  # a CPU run against a GPU plan differs by orders of magnitude
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
        _save(plt, fig, out_dir, Figure(name, title), report)


# ---- the HTML ---------------------------------------------------------------------------------------
def render_html(report: Report, title: str) -> str:
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:60em}td{padding:0 1em 0 0}"
        "img{max-width:100%;border:1px solid #ddd}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><table>",
    ]
    parts += [f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(v)}</td></tr>" for k, v in report.facts]
    parts.append("</table>")
    for fig in report.figures:
        with open(fig.path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        parts.append(
            f"<h2>{html.escape(fig.title)}</h2><img class='plot' alt='{html.escape(fig.name)}' "
            f"src='data:image/png;base64,{data}'>"
        )
    if report.notes:
        parts.append("<h2>Not plotted</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(directory: str) -> tuple[str, Report]:
    """Write directory/report/*.png and report.html; returns (path of report.html, what it holds)."""
    plt = _pyplot()
    paths = RunPaths(directory)
    out_dir = paths.report
    os.makedirs(out_dir, exist_ok=True)
    report = Report()
    is_sweep = os.path.exists(paths.sweep)
    if is_sweep:
        plot_sweep(directory, out_dir, plt, report)
    else:
        plot_run(directory, out_dir, plt, report)
    path = paths.report_html
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    write_atomic(
        path,
        render_html(
            report, f"meshrun {'sweep' if is_sweep else 'run'} report: {os.path.basename(directory.rstrip('/'))}"
        ),
    )
    return path, report


def _unwritable(run_dir: str) -> str:
    """Why the report cannot be written into run_dir/report, else "": checked before any plot is drawn, so a
    linked report/ (its plots would land wherever the link points) or a read-only run directory is an exit 2."""
    out_dir = RunPaths(run_dir).report
    if os.path.islink(out_dir):
        return (
            f"{out_dir} is a symbolic link: meshrun writes the report only into a real directory inside the run "
            f"(the plots would land wherever it points); remove the link and run action=report again"
        )
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        return f"{out_dir} is not a directory: move it away and run action=report again"
    target = out_dir if os.path.isdir(out_dir) else run_dir
    if not os.access(target, os.W_OK) or _read_only_mount(target):
        return f"{target} is not writable by you: make it writable (or copy the run) and run action=report again"
    return ""


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def run_report(run_dir: str) -> int:
    """The action: a run directory (metrics.jsonl / events.jsonl) or a sweep directory (sweep.json)."""
    markers_of_a_run = ("metrics.jsonl", "events.jsonl", "plan.json", "sweep.json")
    if not os.path.isdir(run_dir) or not any(os.path.exists(os.path.join(run_dir, m)) for m in markers_of_a_run):
        print(
            f"meshrun: {run_dir} is neither a run directory (metrics.jsonl, events.jsonl) nor a sweep directory "
            "(sweep.json); pass run.dir=<the run's directory>",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    problem = _unwritable(run_dir)
    if problem:
        print(f"meshrun: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    path, report = build_report(run_dir)
    print(json.dumps({"report": path, "images": [f.path for f in report.figures], "notes": report.notes}))
    return EXIT_OK


def report_action(cfg, run_dir: str) -> int:
    """action=report (the action table, launcher/cli/actions.py)."""
    return run_report(run_dir)
