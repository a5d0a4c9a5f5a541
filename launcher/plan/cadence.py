"""Checkpoint cadence from failure rates: the Young/Daly interval and the goodput it buys (pure Python).

A job of n nodes, each failing on average every node_mtbf_h hours (independent, exponential), fails every
M = node_mtbf_h / n hours. Saving costs delta seconds of training; a failure costs the restart (requeue,
scheduling, start-up, load: R) plus the work done since the last complete checkpoint. Young (1974) gives the
interval that minimises the loss, tau = sqrt(2 delta M); Daly (2006) gives the expected wall time of one
segment of tau seconds of work plus its save, M e^(R/M) (e^((tau + delta)/M) - 1), hence the goodput (useful
work / wall time) of any interval. docs/COST_MODEL.md shows the table and the simulation that checks it
(tests/launcher/plan/test_cadence.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from launcher.plan.cluster_facts import cluster_facts
from launcher.plan.model_size import params_total
from training.contract.config import Config
from training.contract.precision import OPTIMIZER_BYTES, PARAM_BYTES
from training.contract.rundir.events import read_events

DEFAULT_WRITE_GBPS_PER_NODE = 1.0
"""Checkpoint write rate per node when cluster.checkpoint_write_gbps is 0 (an assumption: docs/COST_MODEL.md)."""
RECENT_SAVES = 5
"""Checkpoint events whose median save time is used."""


# --------------------------------------------------------------------------------------------------
# The formulas
# --------------------------------------------------------------------------------------------------


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, sqrt(2 x save time x MTBF)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def expected_goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful work / wall time with a checkpoint after every interval_s of work (Daly 2006, exponential failures
    that may also strike during saves and restarts)."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 0.0
    try:
        segment = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    except OverflowError:  # an MTBF far below the restart or save time: a segment practically never completes
        return 0.0
    return interval_s / segment


# --------------------------------------------------------------------------------------------------
# The job's numbers
# --------------------------------------------------------------------------------------------------


def requested(cfg: Config) -> str:
    """train.checkpoint_every_min as asked: the train value, else the cluster preset's default."""
    value = str(cfg.train.checkpoint_every_min).strip()
    return value or str(cfg.cluster.checkpoint_every_min).strip() or "0"


def _minutes(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def cadence_problems(cfg: Config) -> list[tuple[str, str, str]]:
    """(key, message, fix) for every cadence setting that cannot work: bad minutes, auto without an MTBF."""
    out = []
    c = cfg.cluster
    for key, text in (
        ("train.checkpoint_every_min", str(cfg.train.checkpoint_every_min).strip()),
        ("cluster.checkpoint_every_min", str(c.checkpoint_every_min).strip()),
    ):
        if text and text != "auto" and _minutes(text) is None:
            out.append(
                (
                    key,
                    f"{text!r} is neither a number of minutes >= 0 nor auto",
                    f"{key}=60 (minutes), {key}=0 (no time-based saves) or {key}=auto",
                )
            )
    if requested(cfg) == "auto" and not c.node_mtbf_h > 0:
        out.append(
            (
                "cluster.node_mtbf_h",
                f"train.checkpoint_every_min=auto needs the nodes' mean time between failures, got {c.node_mtbf_h}",
                "cluster.node_mtbf_h=<hours, e.g. 10000> or train.checkpoint_every_min=<minutes>",
            )
        )
    for key, value in (
        ("cluster.node_mtbf_h", c.node_mtbf_h),
        ("cluster.checkpoint_write_gbps", c.checkpoint_write_gbps),
        ("cluster.restart_min", c.restart_min),
    ):
        if value < 0:
            out.append((key, f"must be >= 0, got {value}", f"{key}=0"))
    return out


def checkpoint_bytes(cfg: Config) -> int:
    """Bytes of one complete checkpoint: every parameter's weight and optimizer state (fp32 masters included)."""
    prec = cfg.train.precision
    return params_total(cfg) * (PARAM_BYTES[prec] + OPTIMIZER_BYTES[prec])


def measured_save_s(run_dir: str | None, async_save: bool) -> tuple[float | None, int]:
    """Median seconds training waited for the run's recent saves (events.jsonl `checkpoint`: total_s, or
    blocked_s for background saves), and how many; (None, 0) without any."""
    if not run_dir:
        return None, 0
    key = "blocked_s" if async_save else "total_s"
    times = [float(e[key]) for e in read_events(run_dir) if e.get("event") == "checkpoint" and key in e]
    if not times:
        return None, 0
    recent = times[-RECENT_SAVES:]
    return statistics.median(recent), len(recent)


def measured_restart_s(run_dir: str | None) -> tuple[float | None, int]:
    """Median seconds from a failure or requeue to the next attempt's `resumed` (or `started`) event."""
    if not run_dir:
        return None, 0
    return _restart_gaps(run_dir, in_job=False)


def measured_in_job_restart_s(run_dir: str | None) -> tuple[float | None, int]:
    """Median seconds from a failure to the next attempt's `resumed` (or `started`) when it restarted inside its
    job (`restarted_in_job`, launcher/slurm/in_job.py)."""
    return _restart_gaps(run_dir, in_job=True) if run_dir else (None, 0)


def _restart_gaps(run_dir: str, in_job: bool) -> tuple[float | None, int]:
    """Restart gaps of one kind: through the queue (requeue, resubmission) or inside the job."""
    gaps, down, inside = [], None, False
    for e in read_events(run_dir):
        kind = e.get("event")
        if kind in ("failed", "requeued") and down is None:
            down = float(e.get("time", 0))
        if kind == "restarted_in_job":
            inside = True
            down = float(e.get("time", 0)) if down is None else down
        elif kind in ("resumed", "started") and down is not None and int(e.get("attempt", 0) or 0) > 0:
            if inside == in_job:
                gaps.append(float(e.get("time", 0)) - down)
            down, inside = None, False
    gaps = [g for g in gaps if g >= 0]
    return (statistics.median(gaps), len(gaps)) if gaps else (None, 0)


def in_job_share(cfg: Config) -> int:
    """Node failures an allocation absorbs in-job before one goes through the queue: min(spares, in-job
    restarts); 0 without in-job restarts or spares (a blamed node then needs a new allocation)."""
    c = cfg.cluster
    limit = c.in_job_restart_limit()
    return min(c.spare_nodes, limit) if limit > 0 and c.spare_nodes > 0 else 0


def blended_restart_s(cfg: Config, run_dir: str | None, requeue_s: float, requeue_source: str) -> tuple[float, str]:
    """The mean cost of one failure's restart: with m = in_job_share spares per allocation, m of every m + 1
    node failures restart in the job (no queue wait) and one goes through the queue."""
    m = in_job_share(cfg)
    if m == 0:
        return requeue_s, requeue_source
    inside, n = measured_in_job_restart_s(run_dir)
    source = (
        f"measured: median of the run's {n} in-job restart(s)" if inside is not None else "cluster.in_job_restart_min"
    )
    inside = 60.0 * cfg.cluster.in_job_restart_min if inside is None else inside
    blended = (m * inside + requeue_s) / (m + 1)
    return blended, (
        f"{m} of {m + 1} failures restart in the job ({inside:.3g} s, {source}) on a spare, one "
        f"requeues ({requeue_s:.3g} s, {requeue_source})"
    )


@dataclass
class Cadence:
    """What the plan reports about checkpoint cadence (plan.json `checkpoint_cadence`)."""

    requested: str
    """train.checkpoint_every_min as asked (minutes or auto)."""
    resolved_min: float
    """Minutes the engine saves by (resolved.checkpoint_every_min)."""
    nodes: int
    node_mtbf_h: float
    job_mtbf_h: float
    """node_mtbf_h / nodes; 0 when the MTBF is unknown."""
    checkpoint_bytes: int
    save_s: float
    save_source: str
    restart_s: float
    restart_source: str
    optimal_min: float
    """Young's interval sqrt(2 x save x job MTBF), minutes (0 when the MTBF is unknown)."""
    effective_min: float
    """The interval the configured cadence gives: the time-based minutes, step-based saves at the predicted
    step time, or a Slurm attempt's time limit (saved at USR2), whichever is shortest; 0: none."""
    goodput_configured: float
    goodput_optimal: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _effective_min(cfg: Config, minutes: float, step_s: float) -> float:
    options = [minutes] if minutes > 0 else []
    if cfg.train.checkpoint_every > 0 and step_s > 0:
        options.append(cfg.train.checkpoint_every * step_s / 60)
    if cluster_facts(cfg).time_limit and cfg.cluster.time_min > 0:
        options.append(float(cfg.cluster.time_min))
    return min(options) if options else 0.0


def advise(cfg: Config, run_dir: str | None = None, step_s: float = 0.0) -> Cadence:
    """The cadence numbers of this job; the run's own measurements (events.jsonl) win over the estimates."""
    c = cfg.cluster
    nbytes = checkpoint_bytes(cfg)
    save, n = measured_save_s(run_dir, cfg.train.async_save)
    if save is not None:
        save_source = f"measured: median of the run's last {n} checkpoint(s)"
    else:
        gbps = c.checkpoint_write_gbps or DEFAULT_WRITE_GBPS_PER_NODE * c.nodes
        save = nbytes / (gbps * 1e9)
        save_source = f"estimated: {nbytes / 1e9:.4g} GB at {gbps:g} GB/s" + (
            "" if c.checkpoint_write_gbps else f" ({DEFAULT_WRITE_GBPS_PER_NODE:g} GB/s per node assumed)"
        )
    restart, n = measured_restart_s(run_dir)
    if restart is not None:
        restart_source = f"measured: median of the run's {n} restart(s)"
    else:
        restart, restart_source = 60.0 * c.restart_min, "cluster.restart_min"
    # Spares make most restarts cheap (launcher/slurm/in_job.py): the expected goodput uses the mean restart.
    restart, restart_source = blended_restart_s(cfg, run_dir, restart, restart_source)
    job_mtbf_h = c.node_mtbf_h / max(c.nodes, 1) if c.node_mtbf_h > 0 else 0.0
    mtbf_s = job_mtbf_h * 3600
    optimal_s = young_interval_s(save, mtbf_s) if mtbf_s > 0 else 0.0
    want = requested(cfg)
    if want == "auto":
        resolved = optimal_s / 60
    else:
        resolved = _minutes(want) or 0.0
    effective = _effective_min(cfg, resolved, step_s)
    return Cadence(
        requested=want,
        resolved_min=resolved,
        nodes=c.nodes,
        node_mtbf_h=c.node_mtbf_h,
        job_mtbf_h=job_mtbf_h,
        checkpoint_bytes=nbytes,
        save_s=save,
        save_source=save_source,
        restart_s=restart,
        restart_source=restart_source,
        optimal_min=optimal_s / 60,
        effective_min=effective,
        goodput_configured=expected_goodput(60 * effective, save, restart, mtbf_s)
        if mtbf_s > 0 and effective > 0
        else 0.0,
        goodput_optimal=expected_goodput(optimal_s, save, restart, mtbf_s) if mtbf_s > 0 else 0.0,
    )


def resolve(cfg: Config, run_dir: str | None = None, step_s: float = 0.0) -> Cadence:
    """advise(), and write the resolved minutes into cfg.resolved.checkpoint_every_min (config.json)."""
    cad = advise(cfg, run_dir, step_s)
    cfg.resolved.checkpoint_every_min = cad.resolved_min
    return cad


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 60:.3g} min" if seconds >= 60 else f"{seconds:.3g} s"


def format_advice(cad: Cadence) -> str:
    """The plan's checkpoint-cadence lines."""
    lines = [
        f"  checkpoint cadence  ({cad.requested} -> every {cad.resolved_min:.4g} min of wall clock"
        + (")" if cad.resolved_min > 0 else ", none by time)")
    ]
    if cad.job_mtbf_h <= 0:
        lines.append(
            "    cluster.node_mtbf_h unknown: set it (hours) for the failure-aware interval "
            "(train.checkpoint_every_min=auto)"
        )
        return "\n".join(lines)
    lines += [
        f"    job MTBF {_duration(cad.job_mtbf_h * 3600)} (node MTBF {cad.node_mtbf_h:g} h / {cad.nodes} nodes)",
        f"    save {_duration(cad.save_s)} ({cad.save_source}); restart {_duration(cad.restart_s)} ({cad.restart_source})",
        f"    Young/Daly optimum sqrt(2 x save x MTBF) = {cad.optimal_min:.3g} min: expected goodput "
        f"{100 * cad.goodput_optimal:.2f} %",
    ]
    if cad.effective_min > 0:
        lines.append(
            f"    configured: a checkpoint every {cad.effective_min:.3g} min: expected goodput "
            f"{100 * cad.goodput_configured:.2f} %"
        )
    else:
        lines.append(
            "    configured: no periodic checkpoint: a failure loses everything since the start or the last save"
        )
    if cad.requested != "auto" and cad.effective_min > 0 and cad.goodput_optimal - cad.goodput_configured > 0.001:
        lines.append(
            f"    advice: train.checkpoint_every_min=auto (or {cad.optimal_min:.3g}) gains "
            f"{100 * (cad.goodput_optimal - cad.goodput_configured):.2f} points of goodput"
        )
    elif cad.requested != "auto" and cad.effective_min <= 0:
        lines.append("    advice: train.checkpoint_every_min=auto")
    return "\n".join(lines)
