"""Compute time of this rank's own work, measured on the device that does it.

On CPU a span is perf_counter around the work (the ops run synchronously). On CUDA the ops are only queued
when the Python call returns: a span is a pair of CUDA events recorded on the compute stream, and the time
between them is read once, after the last event has completed. No device-wide synchronize: it would stall the
CPU after every forward and backward (the next kernels are not queued meanwhile) and count the NCCL streams'
time as this rank's compute.
"""

from __future__ import annotations

import time

import torch


class BusyTimer:
    """Sum of spans (start ... stop) of work on `device`; `seconds()` waits for the last span's end only."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._spans: list[tuple[object, object]] = []
        self._cpu_s = 0.0
        self._open: object | None = None

    def start(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self._open = ev
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("BusyTimer.stop without start")
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self._spans.append((self._open, ev))
        else:
            self._cpu_s += time.perf_counter() - self._open
        self._open = None

    def seconds(self) -> float:
        """Total seconds of the spans so far (CUDA: waits for the last recorded event, not for the device)."""
        if not self.cuda:
            return self._cpu_s
        if self._spans:
            self._spans[-1][1].synchronize()
        total = self._cpu_s + sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
        self._cpu_s, self._spans = total, []
        return total
