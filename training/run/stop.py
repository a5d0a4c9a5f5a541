"""Whether this attempt stops at a step boundary, and whether that boundary saves: one answer for every rank.

A run stops early on train.exit_interval, on train.exit_after_min, or on a stop signal (signals.py: Slurm's
SIGUSR2 before the time limit, SIGTERM on preemption). Signals and clocks differ between ranks, so the answer
is agreed with one all-reduce (MAX) per boundary: every rank saves the same step and stops together, even when
the signal reached only some of them. The save cadence is the checkpoint manager's (step_due, time_due); its
clock part rides in the same all-reduce.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

from training.contract.config import Config
from training.contract.exit_codes import EXIT_STOPPED
from training.contract.rundir.events import append_event
from training.parallel import collectives as comm
from training.run import signals

if TYPE_CHECKING:
    from training.checkpoint import CheckpointManager

STOP_CODES = {0: None, 1: "exit_interval", 2: "exit_after_min", 3: "SIGTERM", 4: "SIGUSR2"}
"""Stop reasons by code; the all-reduce keeps the largest, so a signal wins over a configured stop."""


def install_signals() -> None:
    """Route the stop signals to the flag the boundaries read (main thread only, as Python requires)."""
    if threading.current_thread() is threading.main_thread():
        signals.install()


def _signal_code() -> int:
    name = signals.received()
    if not name:
        return 0
    return 4 if name == "SIGUSR2" else 3


class StopRule:
    """The boundary's decision, built with the trainer (train.exit_after_min counts from then)."""

    def __init__(self, cfg: Config, run_dir: str, mesh, checkpointer: CheckpointManager | None):
        self.cfg, self.run_dir, self.mesh, self.checkpointer = cfg, run_dir, mesh, checkpointer
        self.distributed = comm.is_initialized()
        self.rank = comm.rank() if self.distributed else 0
        self._start = time.monotonic()
        self._decided: tuple[int, bool, str | None] | None = None

    def decide(self, step: int, now: float | None = None) -> tuple[bool, str | None]:
        """(save due, stop reason or None) for the boundary after `step`, the same on every rank.

        Step-based rules are the same on every rank; clocks and signals are not, hence the MAX."""
        if self.checkpointer is None:
            return False, self._signal_only(step)
        if self._decided and self._decided[0] == step:
            return self._decided[1], self._decided[2]
        t, ck = self.cfg.train, self.checkpointer
        now = time.monotonic() if now is None else now
        time_due = ck.time_due(now)
        stop = 0
        # Not at the last step: that one completes the run (a stop there would only cost the job another attempt).
        if t.exit_interval > 0 and 0 < step < t.steps and step % t.exit_interval == 0:
            stop = 1
        if t.exit_after_min > 0 and (now - self._start) >= 60 * t.exit_after_min:
            stop = 2
        stop = _signal_code() or stop
        if self.distributed:
            # On the mesh's device: NCCL reduces only CUDA tensors.
            flags = torch.tensor([int(time_due), stop], dtype=torch.int64, device=self.mesh.device)
            comm.all_reduce_op(flags, op=comm.ReduceOp.MAX)
            time_due, stop = bool(comm.value(flags[0], on_meta=0)), int(comm.value(flags[1], on_meta=0))
        reason = STOP_CODES[stop]
        self._decided = (step, ck.step_due(step) or time_due, reason)
        if reason in ("SIGTERM", "SIGUSR2") and self.rank == 0:
            append_event(self.run_dir, "signal", name=reason, step=step)
            ck.log(f"{reason} received: saving step {step} and stopping (exit {EXIT_STOPPED})")
        return self._decided[1], reason

    def _signal_only(self, step: int) -> str | None:
        """train.checkpointing=false: the stop signal's name when any rank got one, else None. The run then ends
        at this boundary with EXIT_STOPPED and no checkpoint: exit_interval and exit_after_min are refused with
        checkpointing off (launcher/plan/validate.py), so only a signal (cancel, Ctrl-C, preemption) stops it."""
        code = _signal_code()
        if comm.is_initialized() and comm.world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int64, device=self.mesh.device)
            comm.all_reduce_op(flag, op=comm.ReduceOp.MAX)
            code = int(comm.value(flag, on_meta=0))
        reason = STOP_CODES[code]
        if reason and self.mesh.rank == 0:
            append_event(self.run_dir, "signal", name=reason, step=step, checkpoint=False)
            print(
                f"\n{reason} received: stopping after step {step} without a checkpoint "
                f"(train.checkpointing=false; exit {EXIT_STOPPED})",
                file=sys.stderr,
            )
        return reason
