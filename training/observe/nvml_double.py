"""A pynvml-shaped NVML double for machines without GPUs (tests, demos): cluster.health.nvml_double=FILE.

It answers the queries training/observe/health.py makes with real pynvml constants and real pynvml.NVMLError
classes (like tests/test_preflight_nvml.py's double of the preflight), from a JSON file that it reads again
whenever it changes, so a test can make a counter grow while the run reads it:

    {"gpus": 2,
     "nodes": {"*":  {"temperature": 45},
               "n2": {"ecc_uncorrected": 3, "throttle": ["HwSlowdown"]}}}

A node's values: "*" first, then its own entry. Keys (defaults in DEFAULTS): utilization (%), memory_used,
memory_total (bytes), temperature (C), power_w, throttle (names of nvmlClocksThrottleReason* bits, or the mask),
ecc_uncorrected (volatile uncorrectable ECC errors), remapped_uncorrectable, remap_pending, retired_pages, and
xid: [[gpu, xid], ...], Xid events delivered once each through the NVML event-set calls (training/observe/xid.py).
"""

from __future__ import annotations

import json
import os
import types
from typing import Any, Dict

DEFAULTS: Dict[str, Any] = {
    "utilization": 90, "memory_used": 40 * 2**30, "memory_total": 80 * 2**30, "temperature": 45, "power_w": 400.0,
    "throttle": 0, "ecc_uncorrected": 0, "remapped_uncorrectable": 0, "remap_pending": 0, "retired_pages": 0,
}


class _Spec:
    """The file's values for one node, re-read when its modification time or size changes."""

    def __init__(self, path: str, node: str):
        self.path, self.node = path, node
        self.stamp = None
        self.data: Dict[str, Any] = {}

    def get(self) -> Dict[str, Any]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self.stamp:
                with open(self.path) as f:
                    self.data = json.load(f)
                self.stamp = stamp
        except (OSError, ValueError):
            pass  # mid-rewrite or gone: keep the last values read
        return self.data

    def node_values(self) -> Dict[str, Any]:
        data = self.get()
        nodes = data.get("nodes") or {}
        return {**DEFAULTS, **(nodes.get("*") or {}), **(nodes.get(self.node) or {})}


def _mask(pynvml, value) -> int:
    if isinstance(value, int):
        return value
    return sum(int(getattr(pynvml, f"nvmlClocksThrottleReason{name}")) for name in value)


def make_nvml_double(path: str, node: str):
    """The double for `node` (its name as training/preflight/runner.py's node_name() gives it)."""
    import pynvml

    spec = _Spec(path, node)
    m = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "nvmlClocks"))})
    m.NVMLError = pynvml.NVMLError
    m.is_double = True

    def values() -> Dict[str, Any]:
        return spec.node_values()

    def handle(i: int):
        if i >= int(spec.get().get("gpus", 1)):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return i

    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: int(spec.get().get("gpus", 1))
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=values()["utilization"], memory=0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=values()["memory_used"], total=values()["memory_total"],
        free=values()["memory_total"] - values()["memory_used"])

    def temperature(h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return values()["temperature"]

    m.nvmlDeviceGetTemperature = temperature
    m.nvmlDeviceGetPowerUsage = lambda h: int(values()["power_w"] * 1000)  # NVML answers milliwatts
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: _mask(pynvml, values()["throttle"])

    def ecc(h, etype, counter):
        assert etype == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counter == pynvml.NVML_VOLATILE_ECC
        return values()["ecc_uncorrected"]

    m.nvmlDeviceGetTotalEccErrors = ecc
    m.nvmlDeviceGetRemappedRows = lambda h: (0, values()["remapped_uncorrectable"], values()["remap_pending"], 0)
    m.nvmlDeviceGetRetiredPages = lambda h, cause: [0] * int(values()["retired_pages"])
    # Xid events (training/observe/xid.py): the node's "xid" list, [[gpu, xid], ...]; each entry is delivered once,
    # in order, so a test appends to the file while the run reads it.
    delivered = [0]
    m.nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    m.nvmlEventSetCreate = lambda: "xid-event-set"
    m.nvmlDeviceRegisterEvents = lambda h, kinds, event_set: None
    m.nvmlEventSetFree = lambda event_set: None
    m.nvmlDeviceGetIndex = lambda h: int(h)

    def event_wait(event_set, timeout_ms):
        events = values().get("xid") or []
        if delivered[0] >= len(events):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = events[delivered[0]]
        delivered[0] += 1
        return types.SimpleNamespace(device=int(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError,
                                     eventData=int(xid))

    m.nvmlEventSetWait_v2 = event_wait
    m.nvmlEventSetWait = event_wait
    return m
