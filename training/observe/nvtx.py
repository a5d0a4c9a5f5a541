"""train.nvtx: NVTX ranges over layers, forward, backward, the optimizer step and collectives; train.nsys: the
capture range that `nsys profile --capture-range=cudaProfilerApi` records (train.profile_steps).

The ranges are put on from outside the model: forward pre/post hooks on each model chunk ("forward") and each
transformer layer ("layer<i>.forward"), full backward pre/post hooks on each layer ("layer<i>.backward"), a range
around the optimizer step ("optimizer") and around each step ("step <n>"), and the engine's collectives wrapped
where it calls them (torch.distributed.<name>, "coll.<name>": the range covers the call, an asynchronous op's
launch). On GPUs the ranges go to NVTX (torch.cuda.nvtx), where Nsight Systems shows them on the timeline; a CPU
build of torch has no NVTX, so there the ranges are counted instead and written to
run.dir/profile/nvtx_rank<R>.json at the end (the same names, so the CPU test checks the wiring).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable

import torch

from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths
from training.observe.observer import StepObserver, StepRecord

COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "broadcast",
    "all_to_all_single",
    "batch_isend_irecv",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
)
"""torch.distributed functions the engine calls that get a range."""


class Ranges:
    """push/pop to NVTX on GPUs, else counted per name (CPU). NVTX ranges nest per thread (backward may run on
    autograd's device thread), so each thread keeps its own stack of open names."""

    def __init__(self, device_type: str):
        self.nvtx = device_type == "cuda"
        self.counts: dict[str, int] = {}
        self.local = threading.local()
        self.max_depth = 0

    def stack(self) -> list[str]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def push(self, name: str) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
        self.counts[name] = self.counts.get(name, 0) + 1
        st = self.stack()
        st.append(name)
        self.max_depth = max(self.max_depth, len(st))

    def pop(self) -> None:
        st = self.stack()
        if st:
            st.pop()
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def push_once(self, name: str) -> None:
        """A backward range: not opened twice (a recomputed layer's graph fires the pre-hook again)."""
        st = self.stack()
        if not st or st[-1] != name:
            self.push(name)

    def pop_to(self, name: str) -> None:
        """Close `name` and whatever is still open inside it; nothing when it is not open on this thread."""
        st = self.stack()
        if name in st:
            while st and st[-1] != name:
                self.pop()
            self.pop()


class NvtxRanges(StepObserver):
    """Installs the ranges (train.nvtx) and drives the nsys capture range (train.nsys); one of the loop's
    observers (observe/observer.py)."""

    def __init__(self, cfg, run_dir: str, mesh, chunks: list[torch.nn.Module], optimizer=None):
        self.run_dir, self.rank = run_dir, mesh.rank
        self.enabled = bool(cfg.train.nvtx)
        self.ranges = Ranges(mesh.device.type)
        self.handles: list = []
        self.restore: list[tuple] = []
        steps = list(cfg.train.profile_steps)
        self.capture = (int(steps[0]), int(steps[1])) if cfg.train.nsys and len(steps) == 2 else None
        self.capturing = False
        self.cuda = mesh.device.type == "cuda"
        if not self.enabled:
            return
        for chunk in chunks:
            self._wrap_module(chunk, "forward", backward=False)
            for name, layer in getattr(chunk, "layers", {}).items():
                self._wrap_module(layer, f"layer{name}", backward=True)
        if optimizer is not None:
            self._wrap_call(optimizer, "step", "optimizer")
        import torch.distributed as dist

        for fn in COLLECTIVES:
            if hasattr(dist, fn):
                self._wrap_call(dist, fn, f"coll.{fn}")

    def _wrap_module(self, module: torch.nn.Module, name: str, backward: bool) -> None:
        r = self.ranges
        fwd = name if not backward else f"{name}.forward"
        self.handles.append(module.register_forward_pre_hook(lambda *_: r.push(fwd)))
        self.handles.append(module.register_forward_hook(lambda *_: r.pop()))
        if backward:
            bwd = f"{name}.backward"
            self.handles.append(module.register_full_backward_pre_hook(lambda *_: r.push_once(bwd)))
            self.handles.append(module.register_full_backward_hook(lambda *_: r.pop_to(bwd)))

    def _wrap_call(self, owner, attr: str, name: str) -> None:
        real: Callable = getattr(owner, attr)
        r = self.ranges

        @functools.wraps(real)
        def wrapped(*args, **kwargs):
            r.push(name)
            try:
                return real(*args, **kwargs)
            finally:
                r.pop()

        setattr(owner, attr, wrapped)
        self.restore.append((owner, attr, real))

    def before_step(self, step: int) -> None:
        if self.capture and step == self.capture[0] and self.cuda and not self.capturing:
            torch.cuda.profiler.start()  # cudaProfilerStart: nsys --capture-range=cudaProfilerApi begins here
            self.capturing = True
        if self.enabled:
            self.ranges.push(f"step {step}")

    def after_step(self, step: int, record: StepRecord | None = None) -> None:
        if self.enabled:
            self.ranges.pop_to(f"step {step}")  # the step's range closes whatever a hook left open in it
        if self.capturing and step >= self.capture[1]:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            self.capturing = False

    def close(self) -> None:
        """Remove the hooks and wrappers; on CPU write the range counts (profile/nvtx_rank<R>.json)."""
        for h in self.handles:
            h.remove()
        for owner, attr, real in reversed(self.restore):
            setattr(owner, attr, real)
        self.handles, self.restore = [], []
        if self.capturing:
            torch.cuda.profiler.stop()
            self.capturing = False
        if not self.enabled or self.ranges.nvtx:
            return
        path = RunPaths(self.run_dir).nvtx_counts(self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(
            path,
            json.dumps(
                {"counts": self.ranges.counts, "balanced": not self.ranges.stack(), "max_depth": self.ranges.max_depth},
                indent=1,
                sort_keys=True,
            ),
        )
