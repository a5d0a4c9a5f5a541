"""GPU health through NVML (nvidia-ml-py's `pynvml`), one node at a time.

Every check takes the NVML module as an argument so tests can pass a double that returns real
NVML constants and raises real `pynvml.NVMLError` subclasses. A query a GPU does not support
(NVMLError_NotSupported, e.g. row remapping before Ampere) is skipped, never a failure.
"""

from __future__ import annotations

import os
from typing import Any

from training.preflight.report import Check, fail, ok, warn

# Throttle (since driver 535: "clocks event") reasons that mean hardware trouble, by their NVML bit.
# Idle, application-clock and SW power-cap reasons are normal and not reported.
BAD_THROTTLE = (
    ("nvmlClocksThrottleReasonHwSlowdown", "HW slowdown"),
    ("nvmlClocksThrottleReasonHwThermalSlowdown", "HW thermal slowdown"),
    ("nvmlClocksThrottleReasonSwThermalSlowdown", "SW thermal slowdown"),
    ("nvmlClocksThrottleReasonHwPowerBrakeSlowdown", "HW power brake"),
)


def load_nvml():
    """The real pynvml module, or None with the reason when NVML cannot start (no driver, no GPU)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001 - pynvml's NVMLLibraryMismatchError is no NVMLError subclass
        return None, f"NVML unavailable ({type(exc).__name__}: {exc}): nvidia-ml-py and the driver disagree"
    return pynvml, ""


def job_gpu_indices(nvml, count: int, visible: str | None = None) -> list[int]:
    """NVML indices of the GPUs this job owns. NVML lists every GPU of the node, also those a scheduler gave
    to other jobs; CUDA_VISIBLE_DEVICES names the job's own, by UUID (GPU-...) or by index. Unset or empty
    entries: every GPU. MIG-... entries cannot be mapped to a whole GPU and leave the list as NVML gives it
    (the per-GPU MIG check refuses such GPUs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if not entries or any(e.startswith("MIG-") for e in entries):
        return list(range(count))
    if all(e.isdigit() for e in entries):
        wanted = sorted({int(e) for e in entries if int(e) < count})
        return wanted or list(range(count))
    uuids = {}
    for i in range(count):
        try:
            uuids[_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))] = i
        except nvml.NVMLError:
            continue
    return sorted(uuids[e] for e in entries if e in uuids) or list(range(count))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_query(nvml, fn, *args):
    """Call an NVML query; (value, None), or (None, reason) when the GPU or the driver does not support it.
    pynvml raises NVMLLibraryMismatchError, not an NVMLError, when an unversioned query (the process list) has
    no function in an older driver's library (before R510): a reason too, not a crash of the preflight."""
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    try:
        return getattr(nvml, fn)(*args), None
    except nvml.NVMLError as exc:
        if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return None, "not supported"
        raise
    except Exception as exc:
        if mismatch is not None and isinstance(exc, mismatch):
            return None, f"not supported by this driver's NVML library ({exc})"
        raise


def cuda_version_text(v: int) -> str:
    """NVML encodes the CUDA driver version as 1000*major + 10*minor (12040 -> 12.4)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _version_matches(found: str, expected: str) -> bool:
    return not expected or found == expected or found.startswith(expected + ".")


def pci_bus_to_sysfs(bus_id: str) -> str:
    """NVML's 8-digit-domain bus id (00000000:18:00.0) in sysfs form (0000:18:00.0)."""
    bus_id = _text(bus_id).lower()
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def check_gpus(
    nvml, pf, gpus_per_node: int, node: str, own_pids: set | None = None
) -> tuple[list[Check], dict[str, Any]]:
    """All NVML checks of this node. Returns the checks and facts (driver, gpu bus ids) for others."""
    own_pids = own_pids or {os.getpid()}
    checks: list[Check] = []
    facts: dict[str, Any] = {"gpus": []}

    def add(c: Check) -> None:
        c.node = node
        checks.append(c)

    total = nvml.nvmlDeviceGetCount()
    indices = job_gpu_indices(nvml, total)
    count = len(indices)
    facts["gpu_count"] = count
    if count != gpus_per_node:
        add(
            fail(
                "gpu.count",
                "device count differs from cluster.gpus_per_node (a GPU fell off the bus?)",
                found=count,
                expected=gpus_per_node,
            )
        )
    else:
        add(ok("gpu.count", found=count, expected=gpus_per_node))

    driver = _text(nvml.nvmlSystemGetDriverVersion())
    facts["driver"] = driver
    if _version_matches(driver, pf.driver_version):
        add(ok("gpu.driver", found=driver, expected=pf.driver_version or None))
    else:
        add(
            fail(
                "gpu.driver",
                "driver version differs from cluster.preflight.driver_version",
                found=driver,
                expected=pf.driver_version,
            )
        )
    cuda = cuda_version_text(nvml.nvmlSystemGetCudaDriverVersion())
    facts["cuda_driver"] = cuda
    if _version_matches(cuda, pf.cuda_driver_version):
        add(ok("gpu.cuda_driver", found=cuda, expected=pf.cuda_driver_version or None))
    else:
        add(
            fail(
                "gpu.cuda_driver",
                "CUDA driver version differs from cluster.preflight.cuda_driver_version",
                found=cuda,
                expected=pf.cuda_driver_version,
            )
        )

    for i in indices:
        gpu = f"gpu{i}"
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            bus = pci_bus_to_sysfs(nvml.nvmlDeviceGetPciInfo(h).busId)
            facts["gpus"].append({"index": i, "name": _text(nvml.nvmlDeviceGetName(h)), "bus_id": bus})
            gpu_checks = _check_one(nvml, pf, h, own_pids)
        except nvml.NVMLError as exc:
            # GPU is lost, reset required, corrupted infoROM ...: the GPU cannot be used.
            gpu_checks = [fail("gpu.nvml_error", f"NVML: {exc}", found=type(exc).__name__)]
        for c in gpu_checks:
            c.subject = gpu
            add(c)
    return checks, facts


def _check_one(nvml, pf, h, own_pids) -> list[Check]:
    """One GPU's checks, in table order; an NVMLError escapes (the caller fails the GPU)."""
    out = [*_ecc_checks(nvml, h), _row_remap_check(nvml, h), _retired_pages_check(nvml, h)]
    out.append(_temperature_check(nvml, pf, h))
    mig = _mig_check(nvml, h)
    if mig is not None:
        out.append(mig)
    out.append(_throttle_check(nvml, h))
    out.append(_pcie_check(nvml, h))
    out.append(_check_nvlink(nvml, pf, h))
    out.append(_foreign_memory_check(nvml, pf, h, own_pids))
    return out


def _ecc_checks(nvml, h) -> list[Check]:
    """Uncorrectable ECC: volatile (since the last driver load) and aggregate (lifetime)."""
    out: list[Check] = []
    for counter, label in ((nvml.NVML_VOLATILE_ECC, "volatile"), (nvml.NVML_AGGREGATE_ECC, "aggregate")):
        n, why = nvml_query(nvml, "nvmlDeviceGetTotalEccErrors", h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter)
        name = f"gpu.ecc_uncorrected_{label}"
        if why:
            out.append(ok(name, f"ECC {why}"))
        elif n:
            out.append(
                fail(
                    name, f"{n} uncorrectable ECC errors ({label}); drain the node, reset the GPU", found=n, expected=0
                )
            )
        else:
            out.append(ok(name, found=0, expected=0))
    return out


def _row_remap_check(nvml, h) -> Check:
    rows, why = nvml_query(nvml, "nvmlDeviceGetRemappedRows", h)
    if why:
        return ok("gpu.row_remap", f"row remapping {why}")
    corr, unc, pending, failed = rows
    found = {"correctable": corr, "uncorrectable": unc, "pending": bool(pending), "failure": bool(failed)}
    if failed:
        return fail("gpu.row_remap", "row remapping failed: the GPU needs replacing", found=found)
    if pending:
        return fail("gpu.row_remap", "row remap pending: reset the GPU before use", found=found)
    return ok("gpu.row_remap", found=found)


def _retired_pages_check(nvml, h) -> Check:
    pending, why = nvml_query(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", h)
    if why:
        return ok("gpu.retired_pages", f"page retirement {why} (row remapping replaces it since Ampere)")
    if pending == nvml.NVML_FEATURE_ENABLED:
        return fail(
            "gpu.retired_pages",
            "retired pages pending: reset the GPU before use",
            found="pending",
            expected="none pending",
        )
    return ok("gpu.retired_pages", found="none pending")


def _temperature_check(nvml, pf, h) -> Check:
    """Below cluster.preflight.max_gpu_temp_c, or else the GPU's own slowdown threshold, before any work."""
    temp = nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
    limit = pf.max_gpu_temp_c
    if not limit:
        limit, why = nvml_query(nvml, "nvmlDeviceGetTemperatureThreshold", h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    if limit and temp >= limit:
        return fail(
            "gpu.temperature",
            "at or above the slowdown threshold before any work: check cooling",
            found=temp,
            expected=f"< {limit}",
        )
    return ok("gpu.temperature", found=temp, expected=f"< {limit}" if limit else None)


def _throttle_check(nvml, h) -> Check:
    mask, why = None, "not supported"
    # "Clocks event reasons" since driver R535; older drivers answer FUNCTION_NOT_FOUND for that name (a new
    # nvidia-ml-py has both), so the older throttle-reasons call is asked next.
    for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if hasattr(nvml, fn):
            mask, why = nvml_query(nvml, fn, h)
            if why is None:
                break
    active = [label for const, label in BAD_THROTTLE if mask and mask & getattr(nvml, const)]
    if active:
        return fail("gpu.throttle", "clocks held down by " + ", ".join(active), found=active, expected=[])
    return ok("gpu.throttle", why or "", found=[] if not why else None)


def _pcie_check(nvml, h) -> Check:
    gen, _ = nvml_query(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", h)
    max_gen, _ = nvml_query(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h)
    width, _ = nvml_query(nvml, "nvmlDeviceGetCurrPcieLinkWidth", h)
    max_width, _ = nvml_query(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h)
    found, expected = f"gen{gen} x{width}", f"gen{max_gen} x{max_width}"
    if width is not None and max_width and width < max_width:
        return fail(
            "gpu.pcie",
            "PCIe link trained narrower than the slot: reseat the GPU / riser",
            found=found,
            expected=expected,
        )
    if gen is not None and max_gen and gen < max_gen:
        # GPUs drop the link generation while idle to save power, so this alone is not a fault.
        return warn(
            "gpu.pcie",
            "PCIe generation below maximum (normal when idle; recheck under load)",
            found=found,
            expected=expected,
        )
    return ok("gpu.pcie", found=found, expected=expected)


def _foreign_memory_check(nvml, pf, h, own_pids) -> Check:
    """GPU memory held by processes outside this job (a leftover job)."""
    procs, why = nvml_query(nvml, "nvmlDeviceGetComputeRunningProcesses", h)
    foreign = [p for p in (procs or []) if p.pid not in own_pids]
    used_mb = sum((p.usedGpuMemory or 0) for p in foreign) / 2**20
    if why:
        return warn(
            "gpu.foreign_memory",
            f"cannot list the GPU's processes: {why}",
            expected=f"<= {pf.max_used_gpu_memory_mb:g} MiB",
        )
    if foreign and used_mb > pf.max_used_gpu_memory_mb:
        return fail(
            "gpu.foreign_memory",
            f"{len(foreign)} other process(es) hold {used_mb:.0f} MiB "
            f"(pids {','.join(str(p.pid) for p in foreign)}): a leftover job?",
            found=round(used_mb),
            expected=f"<= {pf.max_used_gpu_memory_mb:g} MiB",
        )
    return ok("gpu.foreign_memory", found=round(used_mb), expected=f"<= {pf.max_used_gpu_memory_mb:g} MiB")


def _mig_check(nvml, h) -> Check | None:
    """MIG mode on: the GPU is split into instances that meshrun's one-rank-per-GPU layout does not address."""
    if not hasattr(nvml, "nvmlDeviceGetMigMode"):
        return None
    mode, why = nvml_query(nvml, "nvmlDeviceGetMigMode", h)
    if why or mode is None:
        return ok("gpu.mig", f"MIG {why or 'not reported'}")
    current = mode[0] if isinstance(mode, (list, tuple)) else mode
    if current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return fail(
            "gpu.mig",
            "MIG mode is on: meshrun needs whole GPUs (nvidia-smi -mig 0, then a GPU reset)",
            found="enabled",
            expected="disabled",
        )
    return ok("gpu.mig", found="disabled")


def _check_nvlink(nvml, pf, h) -> Check:
    active = down = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(h, link)
        except nvml.NVMLError as exc:
            # Links past the ones this GPU has answer NotSupported / InvalidArgument.
            if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        if state == nvml.NVML_FEATURE_ENABLED:
            active += 1
        else:
            down += 1
    found = {"active": active, "inactive": down}
    if pf.nvlinks_per_gpu:
        if active < pf.nvlinks_per_gpu:
            return fail(
                "gpu.nvlink",
                f"{active} NVLink links active, {pf.nvlinks_per_gpu} expected",
                found=found,
                expected=pf.nvlinks_per_gpu,
            )
        return ok("gpu.nvlink", found=found, expected=pf.nvlinks_per_gpu)
    if active and down:
        return warn(
            "gpu.nvlink", "some NVLink links are down (set cluster.preflight.nvlinks_per_gpu to gate)", found=found
        )
    return ok("gpu.nvlink", "" if active else "no NVLink", found=found)
