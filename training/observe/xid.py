"""NVML Xid events while training: the driver's error reports per GPU, read by the node's health sampler.

The sampler (training/observe/health.py) registers every GPU for nvmlEventTypeXidCriticalError once and drains the
event set (wait with a 0 ms timeout) at each sample. Every Xid becomes a line in health.jsonl and an `xid` event;
the Xids in CRITICAL_XIDS (hardware: memory, bus, NVLink, GSP firmware) also make the node unhealthy: a `health`
event naming the GPU and the node, and with cluster.health.action=requeue the job leaves that node. Xids outside
the list (13 graphics engine exception, 31 memory page fault, 43 a stopped channel, ...) usually come from the
program itself and are reported only. On CPU, cluster.health.nvml_double's "xid" list stands in for the driver.
"""

from __future__ import annotations

CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
"""Xids that point at the GPU or its links rather than at the program: they make the node unhealthy."""


def describe(xid: int) -> str:
    return CRITICAL_XIDS.get(xid, "reported by the driver; usually the program's (not a hardware fault)")


class XidWatcher:
    """One NVML event set over the node's GPUs; poll() returns the Xids that arrived since the last poll."""

    def __init__(self, nvml, count: int, indices: list[int] | None = None):
        """Watch GPUs `indices` (default: all `count`)."""
        self.nvml, self.set, self.gpus, self.unsupported = nvml, None, [], []
        kind = getattr(nvml, "nvmlEventTypeXidCriticalError", None)
        if kind is None or not hasattr(nvml, "nvmlEventSetCreate"):
            return
        try:
            self.set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return
        for i in range(count) if indices is None else indices:
            try:
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(i), kind, self.set)
                self.gpus.append(i)
            except nvml.NVMLError:  # NotSupported (some GPUs, MIG): this GPU's Xids are not watched
                self.unsupported.append(i)

    def _index(self, device) -> int:
        try:
            return int(self.nvml.nvmlDeviceGetIndex(device))
        except Exception:  # noqa: BLE001 - a handle NVML no longer knows: the GPU is gone
            return -1

    def poll(self, limit: int = 1000) -> list[tuple[int, int]]:
        """(GPU index, Xid) of every event waiting now, without blocking."""
        out: list[tuple[int, int]] = []
        if self.set is None:
            return out
        wait = getattr(self.nvml, "nvmlEventSetWait_v2", None) or self.nvml.nvmlEventSetWait
        for _ in range(limit):
            try:
                data = wait(self.set, 0)
            except self.nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing (more) waiting
                break
            out.append((self._index(data.device), int(data.eventData)))
        return out

    def close(self) -> None:
        if self.set is not None and hasattr(self.nvml, "nvmlEventSetFree"):
            try:
                self.nvml.nvmlEventSetFree(self.set)
            except self.nvml.NVMLError:
                pass
            self.set = None
