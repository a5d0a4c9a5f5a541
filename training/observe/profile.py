"""train.profile_steps=[a,b]: a torch.profiler trace of steps a..b per rank; train.memory_snapshot_step=N: a CUDA
memory snapshot after step N. Both land in run.dir/profile/:

- trace_rank<R>.json: Chrome trace format (chrome://tracing, ui.perfetto.dev), CPU and, on GPU, CUDA activity,
  with record_shapes and memory; each step is a `ProfilerStep#<n>` range;
- memory_snapshot_rank<R>.pickle: torch.cuda.memory._snapshot() (drop it on pytorch.org/memory_viz); the
  allocator history is recorded from the start of the Trainer (before the model and the optimizer allocate:
  `start_memory_history`) when a snapshot is asked for, so the snapshot shows where each live block, weights and
  optimizer states included, was allocated. On CPU there is no CUDA allocator: rank 0 says so once.

Files are written under a temporary name and renamed.
"""

from __future__ import annotations

import os
import pickle
import sys

import torch

from training.contract.rundir.files import atomic_path, write_atomic
from training.contract.rundir.paths import RunPaths
from training.observe.observer import StepObserver, StepRecord


def profile_window(steps: list[int]) -> tuple | None:
    """(first, last) step of train.profile_steps, or None when profiling is off. A bad list is the user's to fix:
    LayoutError, which the rank turns into exit 2 (training/main.py)."""
    if not steps:
        return None
    if len(steps) != 2 or steps[0] < 1 or steps[1] < steps[0]:
        from training.contract.layout_rules import LayoutError

        raise LayoutError(
            f"train.profile_steps={list(steps)}: give [first, last] with 1 <= first <= last (steps count from 1)"
        )
    return int(steps[0]), int(steps[1])


_history_started = False


def start_memory_history(cfg, device) -> bool:
    """train.memory_snapshot_step > 0 on a CUDA rank: record the allocator's history from now on (once per process;
    the Trainer calls this before it builds the model). True when recording."""
    global _history_started
    if int(cfg.train.memory_snapshot_step) <= 0 or torch.device(device).type != "cuda":
        return False
    if not _history_started:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        _history_started = True
    return True


class StepProfiler(StepObserver):
    """One of the loop's observers (observe/observer.py): the trace window's ranges and the memory snapshot."""

    def __init__(self, cfg, run_dir: str, mesh):
        self.rank, self.device = mesh.rank, mesh.device
        self.paths = RunPaths(run_dir)
        self.dir = self.paths.profile
        self.window = profile_window(list(cfg.train.profile_steps))
        self.snapshot_step = int(cfg.train.memory_snapshot_step)
        self.prof = None
        if self.snapshot_step > 0:
            if self.device.type == "cuda":
                # Started by the Trainer before its allocations; here for a loop built another way.
                start_memory_history(cfg, self.device)
            elif self.rank == 0:
                print(
                    f"note: train.memory_snapshot_step={self.snapshot_step}: a CPU run has no CUDA memory "
                    "allocator to snapshot; no snapshot is written (peak memory per rank is in summary.json)",
                    file=sys.stderr,
                )
                self.snapshot_step = 0

    def before_step(self, step: int) -> None:
        if self.window and step == self.window[0] and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.prof.__enter__()
        if self.prof is not None:
            self._range = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._range.__enter__()

    def after_step(self, step: int, record: StepRecord | None = None) -> None:
        if self.prof is not None:
            self._range.__exit__(None, None, None)
            if step >= self.window[1]:
                self._write_trace()
        if self.snapshot_step and step == self.snapshot_step:
            self._write_snapshot()

    def _write_trace(self) -> None:
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        path = self.paths.profile_trace(self.rank)
        with atomic_path(path, suffix=".json") as tmp:
            prof.export_chrome_trace(tmp)
        if self.rank == 0:
            print(
                f"profile: steps {self.window[0]}-{self.window[1]} traced to {self.dir}/trace_rank<R>.json",
                file=sys.stderr,
            )

    def _write_snapshot(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        path = self.paths.memory_snapshot(self.rank)
        snapshot = torch.cuda.memory._snapshot()
        write_atomic(path, pickle.dumps(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
        global _history_started
        _history_started = False
        if self.rank == 0:
            print(f"profile: CUDA memory snapshot after step {self.snapshot_step} in {self.dir}", file=sys.stderr)

    def close(self) -> None:
        """A run that ends (or stops early) inside the window still gets its trace."""
        if self.prof is not None:
            self._write_trace()
