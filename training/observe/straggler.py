"""Slow ranks and unhealthy nodes, decided once per log interval from one small gather.

Every rank measures its compute time per step (the schedule's forward and backward, without the optimizer's
reduction, so a fast rank's wait for a slow one does not count) and, at each logged step, all ranks gather
[mean compute time of the interval, the node's health flag] (training/observe/health.py). From that, on every
rank alike (the same numbers give the same answers, so no further collective is needed):
- a rank slower than the ranks' median by train.straggler_margin for train.straggler_intervals intervals in a
  row is a straggler: rank 0 appends a `straggler` event (rank, node, its time and the median) and says so on
  stderr. Tensor- and pipeline-parallel peers of a slow rank wait for it inside the step and may be named too;
- a node's tokens/s share below cluster.health.min_throughput_fraction of its own baseline is unhealthy
  (a `health` event, kind throughput);
- with cluster.health.action=requeue, any unhealthy node stops the attempt (the loop checkpoints first).

On stderr a rank's straggler line is printed at most once per STRAGGLER_QUIET_S; the rest are counted and
summarised in one line at the end (every one is still an event). A CPU run with more local ranks than cores
(which the launcher warns about) reports no stragglers at all: every rank waits for a core, so they all are.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch

from training.contract.rundir.events import append_event
from training.observe.health import THROUGHPUT, ThroughputShare, kinds, record_cause, start_sampler
from training.observe.observer import StepObserver, StepRecord
from training.observe.progress import TTY_ENV
from training.parallel import collectives as comm


def node_name() -> str:
    from training.preflight.runner import node_name as preflight_node_name

    return preflight_node_name()


def gather_nodes(device) -> list[str]:
    """Every rank's node name, in rank order (one collective at start-up)."""
    mine = node_name()
    if not (comm.is_initialized() and comm.world_size() > 1):
        return [mine]
    out: list[Any] = [None] * comm.world_size()
    comm.all_gather_object(out, mine)
    return [str(n) for n in out]


def median_of(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class StragglerDetector:
    """Ranks whose time stays above the median by a margin for `intervals` consecutive log intervals."""

    def __init__(self, margin: float, intervals: int):
        self.margin, self.intervals = margin, max(1, intervals)
        self.streak: dict[int, int] = {}

    def update(self, times: list[float]) -> list[int]:
        """The ranks that have just become stragglers (reported once per streak)."""
        if self.margin <= 0 or len(times) < 2:
            return []
        median = median_of(times)
        out = []
        for rank, t in enumerate(times):
            if median > 0 and t > median * (1 + self.margin):
                self.streak[rank] = self.streak.get(rank, 0) + 1
                if self.streak[rank] == self.intervals:
                    out.append(rank)
            else:
                self.streak[rank] = 0
        return out


STRAGGLER_QUIET_S = 300.0
"""Seconds between two stderr lines about the same straggling rank."""


def oversubscribed(device_type: str, environ=os.environ) -> bool:
    """More local ranks than CPU cores on a CPU run: the slowdown is the machine's, not a rank's."""
    if device_type != "cpu":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return int(environ.get("LOCAL_WORLD_SIZE", "1")) > cores


class StragglerLines:
    """What rank 0 prints about stragglers: one line per rank per quiet_s, the others counted for summary()."""

    def __init__(self, quiet_s: float = STRAGGLER_QUIET_S, clock=time.monotonic):
        self.quiet_s, self.clock = quiet_s, clock
        self.last: dict[int, float] = {}
        self.held: dict[int, int] = {}

    def line(self, rank: int, msg: str) -> str:
        """The line to print now, or "" (counted) when this rank was reported less than quiet_s ago."""
        now = self.clock()
        if rank in self.last and now - self.last[rank] < self.quiet_s:
            self.held[rank] = self.held.get(rank, 0) + 1
            return ""
        self.last[rank] = now
        # On a terminal rank 0's bar has no newline yet (training/observe/progress.py): end it first.
        return ("\n" if os.environ.get(TTY_ENV) == "1" else "") + f"straggler: {msg}"

    def summary(self) -> str:
        if not self.held:
            return ""
        ranks = ", ".join(f"rank {r} x{n}" for r, n in sorted(self.held.items()))
        return f"straggler: {sum(self.held.values())} more not printed ({ranks}); events.jsonl has every one"


class IntervalWatch(StepObserver):
    """The loop's one observer (observe/observer.py) for stragglers and node health."""

    def __init__(self, cfg, run_dir: str, mesh):
        self.cfg, self.run_dir, self.mesh = cfg, run_dir, mesh
        t, h = cfg.train, cfg.cluster.health
        self.nodes = gather_nodes(mesh.device)
        self.node = self.nodes[mesh.rank]
        self.sampler = start_sampler(cfg, run_dir, mesh, self.node)
        self.stragglers = StragglerDetector(t.straggler_margin, t.straggler_intervals)
        self.lines = StragglerLines()
        self.oversubscribed = oversubscribed(getattr(mesh.device, "type", str(mesh.device)))
        self.share = ThroughputShare(h.min_throughput_fraction, h.baseline_intervals, h.throttle_samples)
        self.enabled = t.straggler_margin > 0 or h.enabled
        self.compute: list[float] = []
        self.unhealthy: dict[str, int] = {}
        """node -> health flag bits, as agreed by every rank."""
        self.acted: dict[str, int] = {}
        self.last_step = t.steps

    def after_step(self, step: int, record: StepRecord) -> None:
        """Every rank, the same `logged` steps (a collective then); adds fields for rank 0's metrics row."""
        record.fields.update(self.figures(step, record.compute_s, record.logged))

    def figures(self, step: int, compute_s: float, logged: bool) -> dict[str, Any]:
        """After each step: this rank's compute time kept; on a logged step the job-wide figures (a collective)."""
        self.compute.append(compute_s)
        if not (self.enabled and logged):
            return {}
        if self.sampler is not None and (
            step >= self.last_step or time.monotonic() - self.sampler.last_time > 2 * self.sampler.interval_s
        ):
            # The last step, or a thread starved by a busy machine: sample here, so a fault is not missed.
            self.sampler.sample()
        mean = sum(self.compute) / len(self.compute)
        self.compute = []
        flag = self.sampler.flag if self.sampler is not None else 0
        summary = self.sampler.summary if self.sampler is not None else {}
        # [compute time, health flag, max temperature, mean utilisation, power, memory]: NaN where not sampled.
        mine = [mean, float(flag)] + [float(summary.get(k, math.nan)) for k in _SUMMARY]
        rows = self._gather(mine)
        times = [r[0] for r in rows]
        out: dict[str, Any] = {"compute_time_max_s": max(times), "compute_time_median_s": median_of(times)}
        self._stragglers(step, times)
        self._health(step, rows)
        for i, key in enumerate(_SUMMARY):
            values = [r[2 + i] for r in rows if not math.isnan(r[2 + i])]
            if values:
                out[key] = (
                    sum(values)
                    if key == "gpu_power_w"
                    else sum(values) / len(values)
                    if key == "gpu_utilization_mean_pct"
                    else max(values)
                )
        return out

    def _gather(self, mine: list[float]) -> list[list[float]]:
        t = torch.tensor(mine, dtype=torch.float64, device=self.mesh.device)
        if not (comm.is_initialized() and comm.world_size() > 1):
            return [t.tolist()]
        every = [torch.zeros_like(t) for _ in range(comm.world_size())]
        comm.all_gather(every, t)
        return [x.tolist() for x in every]

    def _stragglers(self, step: int, times: list[float]) -> None:
        median = median_of(times)
        found = self.stragglers.update(times)
        if self.oversubscribed:
            return  # every rank waits for a core: no rank is the slow one (the launcher has warned)
        for rank in found:
            msg = (
                f"rank {rank} on {self.nodes[rank]} is a straggler: compute {times[rank]:.4f} s per step vs the "
                f"median {median:.4f} s for {self.stragglers.intervals} log intervals"
            )
            if self.mesh.rank == 0:
                append_event(
                    self.run_dir,
                    "straggler",
                    rank=rank,
                    node=self.nodes[rank],
                    step=step,
                    compute_time_s=times[rank],
                    median_s=median,
                    intervals=self.stragglers.intervals,
                )
                line = self.lines.line(rank, msg)
                if line:
                    print(line, file=sys.stderr)

    def _health(self, step: int, rows: list[list[float]]) -> None:
        for rank, row in enumerate(rows):
            if int(row[1]):
                node = self.nodes[rank]
                self.unhealthy[node] = self.unhealthy.get(node, 0) | int(row[1])
        node_time: dict[str, float] = {}
        node_ranks: dict[str, int] = {}
        for rank, row in enumerate(rows):
            node = self.nodes[rank]
            node_time[node] = max(node_time.get(node, 0.0), row[0])
            node_ranks[node] = node_ranks.get(node, 0) + 1
        for node, why in self.share.update(node_time, node_ranks).items():
            self.unhealthy[node] = self.unhealthy.get(node, 0) | THROUGHPUT
            if self.mesh.rank == 0:
                append_event(self.run_dir, "health", node=node, kind="throughput", step=step, reasons=[why])
                print(f"\nhealth: node {node}: {why}", file=sys.stderr)

    @property
    def requeue_nodes(self) -> list[str]:
        """Unhealthy nodes not yet acted on, when cluster.health.action=requeue (the same list on every rank)."""
        if self.cfg.cluster.health.action != "requeue":
            return []
        return sorted(n for n, f in self.unhealthy.items() if f & ~self.acted.get(n, 0))

    def stop_code(self, nodes: list[str]) -> int:
        """After the loop's checkpoint: EXIT_NODE_BAD on an unhealthy node's ranks (the epilogue excludes the
        node), EXIT_STOPPED elsewhere (the job is requeued)."""
        from training.contract.exit_codes import EXIT_NODE_BAD, EXIT_STOPPED

        for n in nodes:
            self.acted[n] = self.unhealthy.get(n, 0)
        if self.node in nodes:
            why = "health: node {} unhealthy ({})".format(self.node, ",".join(kinds(self.unhealthy[self.node])))
            if self.sampler is not None and self.sampler.reasons:
                why += ": " + "; ".join(self.sampler.reasons[:3])
            record_cause(why)
            print(
                f"{why}; checkpoint written, this node's ranks exit {EXIT_NODE_BAD} so it is excluded", file=sys.stderr
            )
            return EXIT_NODE_BAD
        return EXIT_STOPPED

    def close(self) -> None:
        if self.mesh.rank == 0 and self.lines.summary():
            print(self.lines.summary(), file=sys.stderr)
        if self.sampler is not None:
            self.sampler.close()


_SUMMARY = ("gpu_temperature_max_c", "gpu_utilization_mean_pct", "gpu_power_w", "gpu_mem_used_max_gib")
