"""A pynvml-shaped NVML double for machines without GPUs (tests, demos): cluster.health.nvml_double=FILE.

It answers the queries training/observe/health.py makes with real pynvml constants and real pynvml.NVMLError
classes (like tests/launcher/launch/test_preflight_nvml.py's double of the preflight), from a JSON file that it reads again
whenever it changes, so a test can make a counter grow while the run reads it:

    {"gpus": 2,
     "nodes": {"*":  {"temperature": 45},
               "n2": {"ecc_uncorrected": 3, "throttle": ["HwSlowdown"]}}}

A node's values: "*" first, then its own entry. Keys (defaults in DEFAULTS): utilization (%), memory_used,
memory_total (bytes), temperature (C), power_w, throttle (names of nvmlClocksThrottleReason* bits, or the mask),
ecc_uncorrected (volatile uncorrectable ECC errors), remapped_uncorrectable, remap_pending, retired_pages, and
xid: [[gpu, xid], ...], Xid events delivered once each through the NVML event-set calls (training/observe/xid.py).
The preflight's queries (training/preflight/gpu_nvml.py, bench/gpu_preflight.sh --dry) read more keys: driver,
cuda_driver (NVML's 1000*major + 10*minor), name, slowdown_c, pcie ([gen, max gen, width, max width]),
nvlinks (active links), processes ([{"pid", "used"}] on every GPU), mig (1: MIG mode on).
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

DEFAULTS: dict[str, Any] = {
    "utilization": 90,
    "memory_used": 40 * 2**30,
    "memory_total": 80 * 2**30,
    "temperature": 45,
    "power_w": 400.0,
    "throttle": 0,
    "ecc_uncorrected": 0,
    "remapped_uncorrectable": 0,
    "remap_pending": 0,
    "retired_pages": 0,
    "driver": "550.54.15",
    "cuda_driver": 12040,
    "name": "NVML double",
    "slowdown_c": 87,
    "pcie": [5, 5, 16, 16],
    "nvlinks": 0,
    "processes": [],
    "mig": 0,
}


class _Spec:
    """The file's values for one node, re-read when its modification time or size changes."""

    def __init__(self, path: str, node: str):
        self.path, self.node = path, node
        self.stamp = None
        self.data: dict[str, Any] = {}

    def get(self) -> dict[str, Any]:
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

    def node_values(self) -> dict[str, Any]:
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

    def values() -> dict[str, Any]:
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
        used=values()["memory_used"],
        total=values()["memory_total"],
        free=values()["memory_total"] - values()["memory_used"],
    )

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
        return types.SimpleNamespace(
            device=int(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=int(xid)
        )

    m.nvmlEventSetWait_v2 = event_wait
    m.nvmlEventSetWait = event_wait
    _add_preflight_queries(m, pynvml, values)
    return m


def _add_preflight_queries(m, pynvml, values) -> None:
    """The queries of the preflight's GPU checks (training/preflight/gpu_nvml.py), from the same values."""

    def err(code):
        raise pynvml.NVMLError(code)

    m.nvmlSystemGetDriverVersion = lambda: values()["driver"]
    m.nvmlSystemGetCudaDriverVersion = lambda: int(values()["cuda_driver"])
    m.nvmlDeviceGetName = lambda h: values()["name"]
    m.nvmlDeviceGetUUID = lambda h: f"GPU-00000000-0000-0000-0000-{h:012d}"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())

    def ecc(h, etype, counter):
        assert etype == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return values()["ecc_uncorrected"]

    m.nvmlDeviceGetTotalEccErrors = ecc
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: (
        pynvml.NVML_FEATURE_ENABLED if values()["retired_pages"] else pynvml.NVML_FEATURE_DISABLED
    )
    m.nvmlDeviceGetTemperatureThreshold = lambda h, kind: values()["slowdown_c"]
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: values()["pcie"][0]
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: values()["pcie"][1]
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: values()["pcie"][2]
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: values()["pcie"][3]
    m.nvmlDeviceGetNvLinkState = lambda h, link: (
        pynvml.NVML_FEATURE_ENABLED if link < int(values()["nvlinks"]) else err(pynvml.NVML_ERROR_NOT_SUPPORTED)
    )
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=int(p["pid"]), usedGpuMemory=int(p["used"])) for p in values()["processes"]
    ]
    m.nvmlDeviceGetMigMode = lambda h: [int(values()["mig"]), int(values()["mig"])]
