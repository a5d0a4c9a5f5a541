"""NVML checks against a test double that speaks real pynvml: its constants and its error classes."""

import types

import pynvml
import pytest
from helpers.doubles import H100_LINKS, fake_nvml, healthy_gpu

from training.contract.config import PreflightConfig
from training.preflight.gpu_nvml import check_gpus, cuda_version_text, pci_bus_to_sysfs
from training.preflight.report import FAIL, WARN


def run(gpus, pf=None, per_node=None, **kw):
    pf = pf or PreflightConfig(nvlinks_per_gpu=H100_LINKS)
    checks, facts = check_gpus(fake_nvml(gpus, **kw), pf, per_node or len(gpus), "node1", own_pids={1000})
    return checks, facts


def failing(checks, status=FAIL):
    return {(c.name, c.subject) for c in checks if c.status == status}


def test_healthy_node_passes_and_reports_facts():
    checks, facts = run([healthy_gpu(i) for i in range(8)])
    assert failing(checks) == set() and failing(checks, WARN) == set()
    assert facts["driver"] == "550.54.15" and facts["cuda_driver"] == "12.4"
    assert facts["gpus"][1]["bus_id"] == "0000:19:00.0"
    assert all(c.node == "node1" for c in checks)
    nv = [c for c in checks if c.name == "gpu.nvlink"]
    assert len(nv) == 8 and nv[0].found == {"active": 18, "inactive": 0}


def test_not_supported_queries_are_skipped_not_failed():
    g = healthy_gpu(0)
    g["unsupported"] = {"ecc", "remap", "retired_pending", "reasons"}
    checks, _ = run([g])
    assert failing(checks) == set()


@pytest.mark.parametrize(
    "mutate, check",
    [
        (lambda g: g["ecc"].__setitem__(pynvml.NVML_VOLATILE_ECC, 2), "gpu.ecc_uncorrected_volatile"),
        (lambda g: g["ecc"].__setitem__(pynvml.NVML_AGGREGATE_ECC, 5), "gpu.ecc_uncorrected_aggregate"),
        (lambda g: g.__setitem__("remap", (0, 1, 1, 0)), "gpu.row_remap"),
        (lambda g: g.__setitem__("remap", (0, 3, 0, 1)), "gpu.row_remap"),
        (lambda g: g.__setitem__("retired_pending", pynvml.NVML_FEATURE_ENABLED), "gpu.retired_pages"),
        (lambda g: g.__setitem__("temp", 90), "gpu.temperature"),
        (lambda g: g.__setitem__("reasons", pynvml.nvmlClocksEventReasonHwSlowdown), "gpu.throttle"),
        (
            lambda g: g.__setitem__(
                "reasons", pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonGpuIdle
            ),
            "gpu.throttle",
        ),
        (lambda g: g.__setitem__("reasons", pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown), "gpu.throttle"),
        (lambda g: g.__setitem__("pcie", (5, 5, 8, 16)), "gpu.pcie"),
        (lambda g: g["links"].__setitem__(7, pynvml.NVML_FEATURE_DISABLED), "gpu.nvlink"),
        (
            lambda g: g.__setitem__("procs", [types.SimpleNamespace(pid=4242, usedGpuMemory=30 * 2**30)]),
            "gpu.foreign_memory",
        ),
    ],
)
def test_each_failure_kind_fails_only_its_gpu(mutate, check):
    gpus = [healthy_gpu(i) for i in range(4)]
    mutate(gpus[2])
    checks, _ = run(gpus)
    assert failing(checks) == {(check, "gpu2")}


def test_power_cap_and_idle_reasons_are_normal():
    g = healthy_gpu(0)
    g["reasons"] = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonGpuIdle
    assert failing(run([g])[0]) == set()


def test_own_processes_do_not_count_as_foreign():
    g = healthy_gpu(0)
    g["procs"] = [
        types.SimpleNamespace(pid=1000, usedGpuMemory=60 * 2**30),
        types.SimpleNamespace(pid=7, usedGpuMemory=2**20),
    ]  # 1 MiB: below the limit
    assert failing(run([g])[0]) == set()


def test_idle_pcie_generation_drop_only_warns():
    g = healthy_gpu(0)
    g["pcie"] = (1, 5, 16, 16)
    checks, _ = run([g])
    assert failing(checks) == set() and failing(checks, WARN) == {("gpu.pcie", "gpu0")}


def test_nvlink_partly_down_warns_without_expected_count():
    g = healthy_gpu(0)
    g["links"][3] = pynvml.NVML_FEATURE_DISABLED
    checks, _ = run([g], pf=PreflightConfig())
    assert failing(checks) == set() and failing(checks, WARN) == {("gpu.nvlink", "gpu0")}


def test_count_mismatch_and_versions():
    checks, _ = run([healthy_gpu(i) for i in range(7)], per_node=8)
    assert failing(checks) == {("gpu.count", "")}
    pf = PreflightConfig(driver_version="550.54", cuda_driver_version="12.4")
    assert failing(run([healthy_gpu(0)], pf=pf)[0]) == set()
    pf = PreflightConfig(driver_version="535.104", cuda_driver_version="12.2")
    assert failing(run([healthy_gpu(0)], pf=pf)[0]) == {("gpu.driver", ""), ("gpu.cuda_driver", "")}


def test_explicit_temperature_limit_overrides_threshold():
    g = healthy_gpu(0)
    g["temp"] = 80
    assert failing(run([g], pf=PreflightConfig(max_gpu_temp_c=75))[0]) == {("gpu.temperature", "gpu0")}


def test_gpu_lost_fails_that_gpu():
    gpus = [healthy_gpu(i) for i in range(2)]
    m = fake_nvml(gpus)
    good = m.nvmlDeviceGetRemappedRows

    def remap(h):
        if h is gpus[1]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return good(h)

    m.nvmlDeviceGetRemappedRows = remap
    checks, _ = check_gpus(m, PreflightConfig(), 2, "n", own_pids=set())
    assert failing(checks) == {("gpu.nvml_error", "gpu1")}
    assert [c.found for c in checks if c.name == "gpu.nvml_error"] == ["NVMLError_GpuIsLost"]


def test_helpers():
    assert cuda_version_text(12040) == "12.4" and cuda_version_text(11080) == "11.8"
    assert pci_bus_to_sysfs(b"00000000:9A:00.0") == "0000:9a:00.0"
