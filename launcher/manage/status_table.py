"""`meshrun action=status status.format=table`: the status object as a table for people (stdout).

A run is one row; a sweep is one table, a row per point (skipped points with their reason), then the count of
points per state. The JSON form (the default) stays the contract for programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from launcher.records.goodput import CAUSES
from training.observe.progress import format_duration

COLUMNS = ("state", "job", "attempt", "step", "loss", "tokens/s", "eta", "log")


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _row(st: dict[str, Any]) -> list[str]:
    step, total = st.get("step"), st.get("total_steps")
    step_txt = (
        "-"
        if step is None and st.get("last_step") is None
        else (f"{step if step is not None else st.get('last_step')}/{total if total is not None else '?'}")
    )
    eta = st.get("eta_s")
    return [
        str(st.get("state", "?")),
        str(st.get("job_id") or "-"),
        _num(st.get("attempt"), "d"),
        step_txt,
        _num(st.get("last_loss"), ".4f"),
        _num(st.get("tokens_per_s"), ",.0f"),
        format_duration(eta) if eta is not None else "-",
        str(st.get("log") or st.get("reason") or "-"),
    ]


def _render(head: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(head)]
    lines = ["  ".join(str(h).upper().ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_table(status: dict[str, Any]) -> str:
    if "points" not in status:
        text = _render(COLUMNS, [_row(status)])
        extra: str | None = status.get("reason") if status.get("log") else None
        return text + (f"\nreason: {extra}" if extra else "") + _goodput_line(status)
    rows = []
    for pt in status["points"]:
        overrides = " ".join(pt.get("overrides", [])) or "-"
        if pt.get("state") == "SKIPPED":
            rows.append(
                [str(pt.get("num")), overrides, "SKIPPED", "-", "-", "-", "-", "-", "-", str(pt.get("reason") or "-")]
            )
        else:
            rows.append([str(pt.get("num")), overrides] + _row(pt))
    counts = ", ".join(f"{n} {state}" for state, n in sorted(status.get("states", {}).items()))
    return (
        f"sweep {status.get('sweep_dir')}: {len(rows)} point(s): {counts}\n"
        + _render(("#", "overrides") + COLUMNS, rows)
        + _goodput_line(status)
    )


def _goodput_line(status: dict[str, Any]) -> str:
    """The wall time split by cause (launcher/records/goodput.py) and, with in-job restarts, the spares left."""
    g = status.get("goodput_s")
    if not g:
        return ""
    parts = ", ".join(f"{c} {g[c]:.0f} s" for c in CAUSES if g.get(c))
    line = f"\ngoodput: {100 * g['goodput']:.1f} % of {g['wall_s']:.0f} s ({parts})"
    if "spares_left" in status:
        line += (
            f"\nin-job restarts: {status['in_job_restarts_used']} of {status['max_in_job_restarts']} used in "
            f"this allocation, {status['spares_left']} spare node(s) left"
        )
    return line
