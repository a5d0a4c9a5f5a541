"""metrics.jsonl rows, and the same numbers to TensorBoard (and W&B when asked for), for the loop.

Each row carries `time` (Unix seconds) and `attempt` besides the loop's numbers, and the job-wide figures only a
collective can give: `peak_memory_bytes` (the largest peak over the ranks), `step_time_max_s` /
`step_time_min_s` with `slowest_rank` / `fastest_rank`. One run across attempts: when an attempt resumes from the
checkpoint of step S (or starts afresh, S = 0), rows of steps after S, written by an attempt whose work was lost,
move to metrics.purged.jsonl (nothing is deleted), so every step appears once in metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from training.contract.rundir.events import current_attempt
from training.contract.rundir.paths import RunPaths
from training.observe.observer import StepObserver, StepRecord
from training.parallel import collectives as comm


def purge_after(run_dir: str, step: int) -> int:
    """Move rows with a step > `step` from metrics.jsonl to metrics.purged.jsonl; returns how many moved.
    metrics.jsonl is rewritten under a temporary name and renamed, so a reader never sees half of it."""
    path = RunPaths(run_dir).metrics
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return 0
    keep: list[str] = []
    moved: list[str] = []
    for line in lines:
        try:
            newer = int(json.loads(line)["step"]) > step
        except (ValueError, KeyError, TypeError):
            newer = False  # a torn last line of a killed attempt: kept out of the way below
            if not line.endswith("\n"):
                moved.append(line + "\n")
                continue
        (moved if newer else keep).append(line)
    if not moved:
        return 0
    from training.contract.rundir.files import open_append, write_lines_atomic  # never through a link

    with open_append(RunPaths(run_dir).metrics_purged) as f:
        f.writelines(moved)
    write_lines_atomic(path, keep)
    return len(moved)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def rank_figures(step_time_s: float, device: torch.device) -> dict[str, Any]:
    """Job-wide step time spread and peak memory: a collective, so every rank calls it at the same steps."""
    mine = torch.tensor([step_time_s, float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
    if comm.is_initialized() and comm.world_size() > 1:
        every = [torch.zeros_like(mine) for _ in range(comm.world_size())]
        comm.all_gather(every, mine)
        rows = [t.tolist() for t in every]
    else:
        rows = [mine.tolist()]
    times = [r[0] for r in rows]
    slowest = max(range(len(times)), key=times.__getitem__)
    fastest = min(range(len(times)), key=times.__getitem__)
    return {
        "step_time_max_s": times[slowest],
        "slowest_rank": slowest,
        "step_time_min_s": times[fastest],
        "fastest_rank": fastest,
        "peak_memory_bytes": int(max(r[1] for r in rows)),
    }


def metrics_row(record: StepRecord) -> dict[str, Any]:
    """The metrics.jsonl row of a logged step, before MetricsLog.write adds `time` and `attempt`."""
    row: dict[str, Any] = {
        "step": record.step,
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "lr": record.lr,
        "step_time_s": record.step_time_s,
        "tokens_per_s": record.tokens_per_s,
        "consumed_samples": record.consumed_samples,
    }
    if record.mfu is not None:
        row["mfu"] = record.mfu
    if record.loss_scale is not None:
        row["loss_scale"] = record.loss_scale
    row.update(record.schedule)  # pipeline schedules: bubble_measured / bubble_planned
    if record.skipped is not None:
        row["skipped"] = record.skipped
    if record.eval_loss is not None:
        row["eval_loss"] = record.eval_loss
        row["eval_s"] = record.eval_s  # goodput's eval time (launcher/records/goodput.py)
    if record.compile_s is not None:
        row["compile_s"] = record.compile_s
    row.update(record.fields)
    return row


class StepSpread(StepObserver):
    """The loop's observer (observe/observer.py) of a logged step's job-wide step-time spread and peak memory."""

    def __init__(self, device: torch.device):
        self.device = device

    def after_step(self, step: int, record: StepRecord) -> None:
        if record.logged:  # a collective: every rank, the same steps
            record.fields.update(rank_figures(record.step_time_s, self.device))


class MetricsLog(StepObserver):
    """Rank 0's writer of metrics rows (other ranks get one that writes nothing); as the loop's observer
    (observe/observer.py) it writes the row of each logged step."""

    def __init__(self, cfg, run_dir: str, resumed_step: int, is_logger: bool):
        self.run_dir, self.enabled = run_dir, is_logger
        self.path = RunPaths(run_dir).metrics
        self.attempt = current_attempt()
        self.sinks: list[Any] = []
        if not is_logger:
            return
        purge_after(run_dir, resumed_step)
        if cfg.train.tensorboard:
            from training.observe.tensorboard import TensorBoardSink

            self.sinks.append(TensorBoardSink(run_dir, resumed_step))
        if cfg.train.wandb:
            self.sinks += _wandb(cfg, run_dir)

    def write(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append one row (with time and attempt) to metrics.jsonl and give it to every sink."""
        if not self.enabled:
            return row
        row = {**row, "time": time.time(), "attempt": self.attempt}
        from training.contract.rundir.files import (
            append_bytes,
        )  # never through a link (training/contract/rundir/files.py)

        append_bytes(self.path, (json.dumps(row) + "\n").encode())
        for sink in self.sinks:
            sink.write(row)
        return row

    def after_step(self, step: int, record: StepRecord) -> None:
        if self.enabled and record.logged:
            self.write(metrics_row(record))

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # a sink's failure at exit must not turn a finished run into a failed one
                print(f"warning: closing {type(sink).__name__}: {exc}", file=sys.stderr)
        self.sinks = []


def _wandb(cfg, run_dir: str) -> list[Any]:
    """[the W&B sink], or [] with a warning: W&B is never required, so a rank never fails for it."""
    from training.observe.wandb_sink import WandbSink, wandb_problem

    problem = wandb_problem()
    if problem:
        print(f"warning: {problem}; training goes on without W&B", file=sys.stderr)
        return []
    from training.contract.config import config_to_dict

    try:
        return [WandbSink(run_dir, cfg.train.wandb_project, config_to_dict(cfg))]
    except Exception as exc:  # no login, no network: the run matters more than the dashboard
        print(f"warning: W&B did not start ({type(exc).__name__}: {exc}); training goes on without it", file=sys.stderr)
        return []
