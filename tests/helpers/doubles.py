"""Test doubles of what a CPU machine lacks, written as the real thing speaks: an NVML module with real pynvml's
constants and error classes (the preflight's GPU checks and the health sampler), and InfiniBand port files in
sysfs as the kernel writes them."""

from __future__ import annotations

import os
import types

import pynvml

from training.preflight.ib_sysfs import ERROR_COUNTERS

H100_LINKS = 18


def healthy_gpu(i):
    return {
        "bus": f"00000000:{0x18 + i:02X}:00.0".encode(),  # NVML returns bytes in the C struct
        "ecc": {pynvml.NVML_VOLATILE_ECC: 0, pynvml.NVML_AGGREGATE_ECC: 0},
        "remap": (0, 0, 0, 0),
        "retired_pending": pynvml.NVML_FEATURE_DISABLED,
        "temp": 34,
        "slowdown": 87,
        "reasons": pynvml.nvmlClocksEventReasonGpuIdle,
        "pcie": (5, 5, 16, 16),
        "links": [pynvml.NVML_FEATURE_ENABLED] * H100_LINKS,
        "procs": [],
        "unsupported": set(),
    }


def fake_nvml(gpus, driver="550.54.15", cuda=12040):
    """A module-shaped object exposing exactly the pynvml calls the checks make."""
    m = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "nvmlClocks"))})
    m.NVMLError = pynvml.NVMLError

    def err(code):
        raise pynvml.NVMLError(code)  # pynvml maps the code to its subclass, e.g. NVMLError_NotSupported

    def q(name):
        def call(h, *args):
            if name in h["unsupported"]:
                err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return h[name] if not args else h[name][args[-1]]

        return call

    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlSystemGetDriverVersion = lambda: driver
    m.nvmlSystemGetCudaDriverVersion = lambda: cuda
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i] if i < len(gpus) else err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h["bus"])

    def ecc(h, etype, counter):
        assert etype == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return q("ecc")(h, counter)

    m.nvmlDeviceGetTotalEccErrors = ecc
    m.nvmlDeviceGetRemappedRows = q("remap")
    m.nvmlDeviceGetRetiredPagesPendingStatus = q("retired_pending")

    def temp(h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return h["temp"]

    def threshold(h, kind):
        assert kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return h["slowdown"]

    m.nvmlDeviceGetTemperature = temp
    m.nvmlDeviceGetTemperatureThreshold = threshold
    m.nvmlDeviceGetCurrentClocksEventReasons = q("reasons")
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: h["pcie"][0]
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: h["pcie"][1]
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: h["pcie"][2]
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: h["pcie"][3]

    def link(h, n):
        if n >= len(h["links"]):
            err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return h["links"][n]

    m.nvmlDeviceGetNvLinkState = link
    m.nvmlDeviceGetComputeRunningProcesses = q("procs")
    return m


def write_port(
    root,
    hca,
    port=1,
    state="4: ACTIVE",
    phys="5: LinkUp",
    rate="400 Gb/sec (4X NDR)",
    link_layer="InfiniBand",
    counters=None,
):
    d = os.path.join(root, hca, "ports", str(port))
    os.makedirs(os.path.join(d, "counters"), exist_ok=True)
    for name, text in (("state", state), ("phys_state", phys), ("rate", rate), ("link_layer", link_layer)):
        with open(os.path.join(d, name), "w") as f:
            f.write(text + "\n")
    for name in ERROR_COUNTERS:
        with open(os.path.join(d, "counters", name), "w") as f:
            f.write(f"{(counters or {}).get(name, 0)}\n")
