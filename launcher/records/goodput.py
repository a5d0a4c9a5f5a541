"""Goodput: a run's wall time since submission, split by cause (run_dir/goodput.json, status, report).

The run's time line, from its first `submitted` event (a local run: its first `started`) to its end (the
`completed`, `stopped` or `cancelled` event; a running run: now), is cut into consecutive segments, each with
one cause, so the causes add up to the wall time exactly:
  queue                waiting for an allocation, from Slurm's accounting (sacct: a job's, or a requeued
                       job's, Submit to Start), clipped to the gap before the attempt's prologue;
  startup              the rest of the time before the first attempt, each attempt's prologue to its first
                       step (imports, rendezvous, preflight, checkpoint load), and the last attempt's exit after
                       its last step;
  productive           steps whose results were kept (their rows are in metrics.jsonl);
  lost_steps           steps done after the last complete checkpoint before a failure or stop, and computed
                       again (their rows moved to metrics.purged.jsonl when the next attempt resumed);
  checkpoint_blocking  the part of every save that blocked training (the `checkpoint` event's blocked_s);
  eval                 held-out evaluation (the metrics row's eval_s);
  restart_gap          from an attempt's last step to the next attempt's prologue, queue wait aside (failure
                       detection, teardown, requeue or relaunch).
A step's segment runs from the previous row (or the attempt's first step start) to its own row's time, less
the saves and the evaluation inside it. While an attempt runs, the time since its last row counts as productive
(the step under way; start-up before its first). goodput = productive / wall. `lost_step_count` counts the steps behind
lost_steps (with train.log_every=1: the rows of metrics.purged.jsonl).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from training.contract.rundir.events import read_events, well_formed
from training.contract.rundir.metrics import read_purged_rows, read_rows
from training.contract.rundir.paths import RunPaths

CAUSES = ("queue", "startup", "productive", "lost_steps", "checkpoint_blocking", "eval", "restart_gap")
_END = ("completed", "stopped", "cancelled")
_ATTEMPT_END = ("restarted_in_job", "requeued", "completed", "stopped", "cancelled")


def _step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rec for rec in rows if "step" in rec and "time" in rec]


def _parse_slurm_time(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None  # Unknown, None (not started yet)


def sacct_records(job_ids: Sequence[str]) -> dict[str, list[tuple[float, float]]]:
    """Job id -> (submit, start) of each of its allocations in order (a requeued job has one per requeue:
    sacct --duplicates); {} when Slurm's accounting cannot answer."""
    from training.contract.slurm_env import SlurmUnavailable, slurm_command

    jobs = sorted({str(j) for j in job_ids if j not in (None, "local")})
    if not jobs:
        return {}
    try:
        res = slurm_command(
            ["sacct", "-n", "-P", "-X", "--duplicates", "-j", ",".join(jobs), "-o", "JobID,Submit,Start"]
        )
    except SlurmUnavailable:
        return {}
    out: dict[str, list[tuple[float, float]]] = {}
    for line in res.stdout.splitlines() if res.returncode == 0 else []:
        parts = line.strip().split("|")
        if len(parts) < 3 or parts[0] not in jobs:
            continue
        submit, start = _parse_slurm_time(parts[1]), _parse_slurm_time(parts[2])
        if submit is not None and start is not None:
            out.setdefault(parts[0], []).append((submit, start))
    for recs in out.values():
        recs.sort()
    return out


class _Line:
    """The segments of the time line, in order, each clipped to start where the previous one ended."""

    def __init__(self, t0: float) -> None:
        self.t = t0
        self.segments: list[list[Any]] = []  # [cause, start, end, attempt]

    def add(self, cause: str, until: float, attempt: int | None) -> None:
        if until <= self.t:
            return
        last = self.segments[-1] if self.segments else None
        if last and last[0] == cause and last[3] == attempt and last[2] == self.t:
            last[2] = until
        else:
            self.segments.append([cause, self.t, until, attempt])
        self.t = until


@dataclass
class _Run:
    """What every attempt's segments are cut from: the run's well-formed records, grouped by attempt."""

    events: list[dict[str, Any]]
    starts: list[dict[str, Any]]
    rows: dict[int, list[tuple[dict[str, Any], bool]]]
    """Attempt -> its metrics rows, each with whether it was kept (metrics.jsonl) or purged."""
    saves: dict[int, list[tuple[float, float]]]
    """Attempt -> (time, blocked_s) of each of its saves."""
    allocations: dict[str, list[tuple[float, float]]]
    t_end: float
    finished: bool
    seen_alloc: set = field(default_factory=set)
    """(job, restart count) allocations whose queue wait is counted already."""


def compute(
    events: Sequence[dict[str, Any]],
    kept: Sequence[dict[str, Any]],
    purged: Sequence[dict[str, Any]],
    allocations: dict[str, list[tuple[float, float]]] | None = None,
    now: float | None = None,
) -> dict[str, Any] | None:
    """The goodput.json object of a run (None before its first attempt). allocations: sacct_records' answer."""
    now = time.time() if now is None else now
    # The readers skip malformed lines already; a caller's own records (a sweep's, a test's) are checked here.
    events = [ev for ev in events if well_formed(ev)]
    kept = [rec for rec in kept if well_formed(rec)]
    purged = [rec for rec in purged if well_formed(rec)]
    starts = [ev for ev in events if ev.get("event") == "started" and isinstance(ev.get("time"), (int, float))]
    if not starts:
        return None
    submitted = [ev["time"] for ev in events if ev.get("event") == "submitted" and "time" in ev]
    t0 = min(submitted + [starts[0]["time"]])
    life = [ev for ev in events if ev.get("event") in ("started",) + _ATTEMPT_END and "time" in ev]
    finished = life[-1].get("event") in _END
    t_end = float(life[-1]["time"]) if finished else max(now, float(life[-1]["time"]))
    rows: dict[int, list[tuple[dict[str, Any], bool]]] = {}
    for rec, keep in [(r, True) for r in kept] + [(r, False) for r in purged]:
        rows.setdefault(int(rec.get("attempt", 0) or 0), []).append((rec, keep))
    saves: dict[int, list[tuple[float, float]]] = {}
    for ev in events:
        if ev.get("event") == "checkpoint" and "time" in ev:
            saves.setdefault(int(ev.get("attempt", 0) or 0), []).append(
                (float(ev["time"]), float(ev.get("blocked_s") or 0.0))
            )
    run = _Run(events, starts, rows, saves, allocations or {}, t_end, finished)
    line = _Line(t0)
    lost_steps = sum(_attempt(line, run, i) for i in range(len(starts)))
    line.add("restart_gap" if not finished else "startup", t_end, None)
    return _goodput_object(line, t0, t_end, lost_steps, len(starts), finished)


def _attempt(line: _Line, run: _Run, i: int) -> int:
    """Cut attempt i's segments onto the line: the gap before it (queue wait included), its start-up, its steps,
    its tail; returns how many of its steps were lost."""
    st = run.starts[i]
    a = int(st.get("attempt", i) or 0)
    s_a = max(float(st["time"]), line.t)
    gap_cause = "startup" if i == 0 else "restart_gap"
    _queue_wait(line, run, st, gap_cause, s_a, a)
    line.add(gap_cause, s_a, a)
    nxt = float(run.starts[i + 1]["time"]) if i + 1 < len(run.starts) else run.t_end
    own_end = [
        float(ev["time"])
        for ev in run.events
        if ev.get("event") in _ATTEMPT_END and ev.get("attempt") == a and "time" in ev and float(ev["time"]) >= s_a
    ]
    e_a = min(max(own_end) if own_end else nxt, nxt, run.t_end)
    mine = sorted(run.rows.get(a, []), key=lambda rk: float(rk[0]["time"]))
    mine = [rk for rk in mine if s_a <= float(rk[0]["time"]) <= max(e_a, s_a)]
    my_saves = sorted(run.saves.get(a, []))
    lost_steps = _steps(line, mine, my_saves, a, e_a)
    last = i + 1 == len(run.starts)
    tail_cause = "restart_gap"
    if last and run.finished:
        tail_cause = "startup"  # the run's exit after its last step
    elif last and own_end == []:
        # The attempt runs now: before its first step it starts up, after it the step under way counts as
        # productive until a failure says otherwise.
        tail_cause = "productive" if mine else "startup"
    tail_saves = sum(b for t, b in my_saves if line.t < t <= e_a)
    line.add("checkpoint_blocking", min(e_a, line.t + tail_saves), a)
    line.add(tail_cause, e_a, a)
    return lost_steps


def _queue_wait(line: _Line, run: _Run, st: dict[str, Any], gap_cause: str, s_a: float, a: int) -> None:
    """The queue wait of the attempt's allocation (Slurm's Submit to Start), once per allocation, clipped to the
    gap before the attempt's start."""
    key = (str(st.get("job_id")), int(st.get("restart_count") or 0))
    if key in run.seen_alloc:
        return
    run.seen_alloc.add(key)
    recs = run.allocations.get(key[0], [])
    if key[1] < len(recs):
        submit, start = recs[key[1]]
        q_from, q_to = max(submit, line.t), min(start, s_a)
        if q_to > q_from:
            line.add(gap_cause, q_from, a)
            line.add("queue", q_to, a)


def _steps(
    line: _Line, mine: list[tuple[dict[str, Any], bool]], my_saves: list[tuple[float, float]], a: int, e_a: float
) -> int:
    """The attempt's start-up before its first step, then each step's save, work and evaluation; returns how many
    of its steps were lost (their rows purged)."""
    lost_steps = 0
    prev_step = None
    if mine:
        first = mine[0][0]
        line.add("startup", min(float(first["time"]) - float(first.get("step_time_s") or 0.0), e_a), a)
    for rec, keep in mine:
        t_row = float(rec["time"])
        start_i = line.t
        blocked = sum(b for t, b in my_saves if start_i < t <= t_row)
        evaluation = float(rec.get("eval_s") or 0.0)
        span = t_row - start_i
        ck = min(blocked, span)
        ev_s = min(evaluation, span - ck)
        # In order: the previous step's save (it blocks before this step), the step, its evaluation.
        line.add("checkpoint_blocking", start_i + ck, a)
        line.add("productive" if keep else "lost_steps", t_row - ev_s, a)
        line.add("eval", t_row, a)
        step = int(rec["step"])
        if not keep:
            lost_steps += step - prev_step if prev_step is not None and step > prev_step else 1
        prev_step = step
    return lost_steps


def _goodput_object(line: _Line, t0: float, t_end: float, lost_steps: int, attempts: int, finished: bool) -> dict:
    """The segments added up per cause, with the time line itself."""
    totals = {c: 0.0 for c in CAUSES}
    for cause, s, e, _ in line.segments:
        totals[cause] += e - s
    wall = t_end - t0
    out: dict[str, Any] = {"wall_s": round(wall, 3)}
    out.update({c: round(v, 3) for c, v in totals.items()})
    # From the figures the file shows, so that productive / wall_s read off it gives goodput (the millisecond
    # rounding of both moves the quotient by up to about 1e-5 on a run of a minute), as in the merge below.
    out["goodput"] = round(out["productive"] / out["wall_s"], 6) if out["wall_s"] > 0 else 0.0
    out["lost_step_count"] = lost_steps
    out["attempts"] = attempts
    out["finished"] = finished
    out["start_time"] = t0
    out["timeline"] = [[c, round(s - t0, 3), round(e - s, 3), a] for c, s, e, a in line.segments]
    return out


def run_goodput(
    run_dir: str,
    events: list[dict[str, Any]] | None = None,
    allocations: dict[str, list[tuple[float, float]]] | None = None,
) -> dict[str, Any] | None:
    """compute() for a run directory, with Slurm's accounting for its jobs (asked here when not given)."""
    events = read_events(run_dir) if events is None else events
    if allocations is None:
        allocations = sacct_records([ev.get("job_id") for ev in events if ev.get("event") == "started"])
    return compute(events, _step_rows(read_rows(run_dir)), _step_rows(read_purged_rows(run_dir)), allocations)


def write_goodput(run_dir: str) -> dict[str, Any] | None:
    """run_dir/goodput.json, replaced atomically; returns what it wrote (None: no attempt yet)."""
    from training.contract.rundir.files import write_atomic

    out = run_goodput(run_dir)
    if out is not None:
        write_atomic(RunPaths(run_dir).goodput, json.dumps(out, indent=1))
    return out


def write_goodput_quietly(run_dir: str) -> None:
    """write_goodput for the launchers' end of an attempt: a failure to account never costs the run its next
    step (it is printed on stderr)."""
    try:
        write_goodput(run_dir)
    except Exception as exc:  # noqa: BLE001 - reported; accounting is not the run
        print(f"meshrun: goodput.json not written: {exc!r}", file=sys.stderr)


def summary(g: dict[str, Any] | None) -> dict[str, Any] | None:
    """The per-cause seconds and goodput, without the time line (what status prints)."""
    if not g:
        return None
    return {k: g[k] for k in ("wall_s", *CAUSES, "goodput", "lost_step_count")}


def total(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """A sweep's goodput: the seconds of its runs added per cause; goodput = productive / wall of the sum."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    out: dict[str, Any] = {k: round(sum(float(p.get(k, 0.0)) for p in parts), 3) for k in ("wall_s", *CAUSES)}
    out["lost_step_count"] = sum(int(p.get("lost_step_count", 0)) for p in parts)
    out["goodput"] = round(out["productive"] / out["wall_s"], 6) if out["wall_s"] > 0 else 0.0
    out["runs"] = len(parts)
    return out
