"""GPU health while training: one NVML sampler thread per node (its local rank 0), every few seconds.

Each sample reads, per GPU, utilisation, memory used, temperature, power, clock-throttle reasons and the
uncorrectable ECC / row-remap / retired-page counters (through the same NVML module and NotSupported handling as
the preflight, training/preflight/gpu_nvml.py) and appends one line per GPU to run.dir/health.jsonl. The node is
unhealthy when, since the attempt's first sample,
- uncorrectable ECC errors, uncorrectable remapped rows or retired pages grew, or a row remap is pending;
- a hardware throttle reason (HW/thermal slowdown, power brake) held for cluster.health.throttle_samples samples.
The sampler's rank then appends a `health` event naming the node; the loop learns of it at the next log interval
through training/observe/straggler.py's one gather, where every node's tokens/s share is also checked against its
own baseline (`health` event, kind throughput). With cluster.health.action=requeue the loop checkpoints and the
unhealthy node's ranks exit EXIT_NODE_BAD, so the Slurm epilogue (launcher/slurm/requeue.py) resubmits the job
without that node; the other ranks exit EXIT_STOPPED.

On CPU there is no NVML: cluster.health.nvml_double names a JSON file that training/preflight/nvml_double.py turns
into a pynvml-shaped double, so the whole path runs in tests.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from training.contract.rundir.events import append_event
from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths
from training.preflight.gpu_nvml import BAD_THROTTLE, nvml_query

ECC = 1
"""Flag bit: an error counter grew (ECC, remapped rows, retired pages) or a remap is pending."""
THROTTLE = 2
"""Flag bit: a hardware throttle reason persisted."""
THROUGHPUT = 4
"""Flag bit: the node's tokens/s share fell below its baseline (set by the loop's gather, not the sampler)."""
XID = 8
"""Flag bit: a critical NVML Xid event (training/observe/xid.py)."""
KIND_NAMES = {ECC: "ecc", THROTTLE: "throttle", THROUGHPUT: "throughput", XID: "xid"}


def kinds(flag: int) -> list[str]:
    return [name for bit, name in KIND_NAMES.items() if flag & bit]


def load_health_nvml(cfg, node: str):
    """(nvml module, "") for this node, or (None, why not): the double when cluster.health.nvml_double is set,
    the real NVML on cuda, nothing on CPU."""
    h = cfg.cluster.health
    if h.nvml_double:
        from training.preflight.nvml_double import make_nvml_double

        return make_nvml_double(h.nvml_double, node), ""
    if cfg.cluster.device != "cuda":
        return None, "CPU run: no GPUs to sample (cluster.health.nvml_double gives tests a double)"
    from training.preflight.gpu_nvml import load_nvml

    return load_nvml()


def _try(nvml, fn, *args):
    """gpu_nvml's query (NotSupported -> (None, why)); a function this pynvml (or a double) lacks is skipped too."""
    if not hasattr(nvml, fn):
        return None, "not in this NVML binding"
    return nvml_query(nvml, fn, *args)


def read_gpu(nvml, h) -> dict[str, Any]:
    """One GPU's sample; a query the GPU does not support is left out."""
    out: dict[str, Any] = {}
    util, _ = _try(nvml, "nvmlDeviceGetUtilizationRates", h)
    if util is not None:
        out["utilization_pct"] = float(util.gpu)
    mem, _ = _try(nvml, "nvmlDeviceGetMemoryInfo", h)
    if mem is not None:
        out["memory_used_bytes"], out["memory_total_bytes"] = int(mem.used), int(mem.total)
    temp, _ = _try(nvml, "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
    if temp is not None:
        out["temperature_c"] = float(temp)
    power, _ = _try(nvml, "nvmlDeviceGetPowerUsage", h)
    if power is not None:
        out["power_w"] = power / 1000.0
    fn = (
        "nvmlDeviceGetCurrentClocksEventReasons"
        if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
        else "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    mask, _ = _try(nvml, fn, h)
    if mask is not None:
        out["throttle"] = [label for const, label in BAD_THROTTLE if mask & getattr(nvml, const)]
    ecc, _ = _try(
        nvml, "nvmlDeviceGetTotalEccErrors", h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
    )
    if ecc is not None:
        out["ecc_uncorrected"] = int(ecc)
    rows, _ = _try(nvml, "nvmlDeviceGetRemappedRows", h)
    if rows is not None:
        out["remapped_uncorrectable"], out["remap_pending"] = int(rows[1]), bool(rows[2])
    pages, _ = _try(nvml, "nvmlDeviceGetRetiredPages", h, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    if pages is not None:
        out["retired_pages"] = len(pages)
    return out


_COUNTERS = ("ecc_uncorrected", "remapped_uncorrectable", "retired_pages")


class HealthSampler:
    """The node's sampler: a daemon thread that samples every interval_s; the loop reads `flag` and `summary`."""

    def __init__(
        self, nvml, node: str, run_dir: str, interval_s: float, throttle_samples: int, min_utilization_pct: float = 0.0
    ):
        self.nvml, self.node, self.run_dir = nvml, node, run_dir
        self.min_utilization_pct, self.low_util = min_utilization_pct, -1  # -1: the pre-training sample is skipped
        from training.observe.xid import XidWatcher
        from training.preflight.gpu_nvml import job_gpu_indices

        # This job's GPUs only: on a shared node another job's Xid, ECC or throttling must not mark this node
        # unhealthy (and with action=requeue stop the job). SLURM_JOB_GPUS lists the job's GPUs on the node even
        # when each task sees only its own (per-task binding); else CUDA_VISIBLE_DEVICES; unset: every GPU.
        visible = os.environ.get("SLURM_JOB_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES")
        self.gpus = job_gpu_indices(nvml, nvml.nvmlDeviceGetCount(), visible)
        self.xid = XidWatcher(nvml, nvml.nvmlDeviceGetCount(), self.gpus)
        self.interval_s, self.throttle_samples = max(0.01, interval_s), max(1, throttle_samples)
        self.path = RunPaths(run_dir).health
        self.baseline: dict[int, dict[str, int]] = {}
        self.throttled: dict[int, int] = {}
        self.flag = 0
        self.reasons: list[str] = []
        self.summary: dict[str, float] = {}
        self.samples = 0
        self.last_time = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HealthSampler:
        self.sample()  # the attempt's baseline, before the first step
        self._thread = threading.Thread(target=self._run, name="meshrun-health", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # NVML gone mid-run is worth one line, not a dead training run
                print(
                    f"warning: health sampler on {self.node}: {type(exc).__name__}: {exc}; sampling stops",
                    file=sys.stderr,
                )
                return

    def sample(self) -> int:
        """Read every GPU of the job once, write the lines, update the verdict; returns the flag."""
        with self._lock:
            nvml, now = self.nvml, time.time()
            lines, found = [], []
            temps, utils, powers, used = [], [], [], []
            for i in self.gpus:
                try:
                    gpu = read_gpu(nvml, nvml.nvmlDeviceGetHandleByIndex(i))
                except nvml.NVMLError as exc:  # GPU lost, reset required: the node is unhealthy
                    gpu = {"error": f"NVML: {exc}"}
                    found.append((ECC, f"gpu{i}: {exc}"))
                lines.append(json.dumps({"time": now, "node": self.node, "gpu": i, **gpu}) + "\n")
                found += self._judge(i, gpu)
                temps += [gpu["temperature_c"]] if "temperature_c" in gpu else []
                utils += [gpu["utilization_pct"]] if "utilization_pct" in gpu else []
                powers += [gpu["power_w"]] if "power_w" in gpu else []
                used += [gpu["memory_used_bytes"]] if "memory_used_bytes" in gpu else []
            found += self._xids(now, lines)
            self._utilization(utils)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                os.write(fd, "".join(lines).encode())  # one write: nodes appending at once never interleave
            finally:
                os.close(fd)
            self.samples += 1
            self.last_time = time.monotonic()
            self.summary = {
                k: v
                for k, v in (
                    ("gpu_temperature_max_c", max(temps, default=None)),
                    ("gpu_utilization_mean_pct", sum(utils) / len(utils) if utils else None),
                    ("gpu_power_w", sum(powers) if powers else None),
                    ("gpu_mem_used_max_gib", max(used) / 2**30 if used else None),
                )
                if v is not None
            }
            new = 0
            for bit, why in found:
                new |= bit & ~self.flag
                if why not in self.reasons:
                    self.reasons.append(why)
            if new:
                self.flag |= new
                append_event(
                    self.run_dir,
                    "health",
                    node=self.node,
                    kind=",".join(kinds(new)),
                    reasons=[why for bit, why in found if bit & new],
                )
                print(
                    f"health: node {self.node}: " + "; ".join(why for bit, why in found if bit & new), file=sys.stderr
                )
            return self.flag

    def _xids(self, now: float, lines: list[str]) -> list:
        """Xid events since the last sample: a health.jsonl line and an `xid` event each; critical ones flag the node."""
        from training.observe.xid import CRITICAL_XIDS, describe

        out = []
        for gpu, xid in self.xid.poll():
            critical = xid in CRITICAL_XIDS
            lines.append(
                json.dumps({"time": now, "node": self.node, "gpu": gpu, "xid": xid, "critical": critical}) + "\n"
            )
            append_event(
                self.run_dir, "xid", node=self.node, gpu=gpu, xid=xid, critical=critical, meaning=describe(xid)
            )
            if critical:
                out.append((XID, f"gpu{gpu}: Xid {xid} ({describe(xid)})"))
            else:
                print(f"health: node {self.node} gpu{gpu}: Xid {xid} ({describe(xid)})", file=sys.stderr)
        return out

    def _utilization(self, utils: list[float]) -> None:
        """The seed's utilisation target: a node whose mean GPU utilisation stays below min_utilization_pct for
        throttle_samples samples gets one `low_utilization` event per streak (a warning: the input pipeline,
        communication or small kernels leave the GPUs waiting; not a hardware fault)."""
        if self.min_utilization_pct <= 0 or not utils:
            return
        if self.low_util < 0:  # the sample taken before the first step: GPUs idle by design
            self.low_util = 0
            return
        mean = sum(utils) / len(utils)
        if mean >= self.min_utilization_pct:
            self.low_util = 0
            return
        self.low_util += 1
        if self.low_util == self.throttle_samples:
            append_event(
                self.run_dir,
                "low_utilization",
                node=self.node,
                utilization_mean_pct=round(mean, 1),
                target_pct=self.min_utilization_pct,
                samples=self.low_util,
            )
            print(
                f"warning: node {self.node}: mean GPU utilisation {mean:.0f} % below the "
                f"{self.min_utilization_pct:g} % target for {self.low_util} samples (input pipeline, communication "
                "or small kernels leave the GPUs waiting; a torch.profiler or nsys trace shows which)",
                file=sys.stderr,
            )

    def _judge(self, i: int, gpu: dict[str, Any]) -> list:
        out = []
        base = self.baseline.setdefault(i, {k: gpu[k] for k in _COUNTERS if k in gpu})
        for key in _COUNTERS:
            if key in gpu and key in base and gpu[key] > base[key]:
                out.append((ECC, f"gpu{i}: {key} grew from {base[key]} to {gpu[key]}"))
        if gpu.get("remap_pending"):
            out.append((ECC, f"gpu{i}: row remap pending"))
        if gpu.get("throttle"):
            self.throttled[i] = self.throttled.get(i, 0) + 1
            if self.throttled[i] >= self.throttle_samples:
                out.append(
                    (
                        THROTTLE,
                        f"gpu{i}: clocks held down by {', '.join(gpu['throttle'])} for {self.throttled[i]} samples",
                    )
                )
        else:
            self.throttled[i] = 0
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.xid.close()


def start_sampler(cfg, run_dir: str, mesh, node: str) -> HealthSampler | None:
    """The node's sampler on its local rank 0 (one thread per node), or None (said once, on rank 0)."""
    h = cfg.cluster.health
    if not h.enabled or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    nvml, why = load_health_nvml(cfg, node)
    if nvml is None:
        if mesh.rank == 0 and cfg.cluster.device == "cuda":
            print(f"note: no GPU health sampling: {why}", file=sys.stderr)
        return None
    return HealthSampler(nvml, node, run_dir, h.interval_s, h.throttle_samples, h.min_utilization_pct).start()


class ThroughputShare:
    """A node's share of the job's tokens/s against its own baseline share (the median of its first intervals)."""

    def __init__(self, fraction: float, baseline_intervals: int, persist: int):
        self.fraction, self.n, self.persist = fraction, max(1, baseline_intervals), max(1, persist)
        self.history: dict[str, list[float]] = {}
        self.low: dict[str, int] = {}

    def update(self, node_time: dict[str, float], node_ranks: dict[str, int]) -> dict[str, str]:
        """node -> why, for nodes whose share stayed low for `persist` intervals (reported once per streak)."""
        if self.fraction <= 0 or len(node_time) < 2:
            return {}
        rates = {n: node_ranks[n] / t for n, t in node_time.items() if t > 0}
        total = sum(rates.values())
        out = {}
        for node, rate in rates.items():
            share = rate / total
            hist = self.history.setdefault(node, [])
            if len(hist) < self.n:
                hist.append(share)
                continue
            base = sorted(hist)[len(hist) // 2]
            if share < self.fraction * base:
                self.low[node] = self.low.get(node, 0) + 1
                if self.low[node] == self.persist:
                    out[node] = (
                        f"tokens/s share {share:.3f} below {self.fraction:g} x its baseline {base:.3f} "
                        f"for {self.persist} log intervals"
                    )
            else:
                self.low[node] = 0
        return out


def record_cause(message: str) -> None:
    """The health stop's cause for the Slurm epilogue (MESHRUN_CAUSE_FILE, as training/main.py writes failures)."""
    path = os.environ.get("MESHRUN_CAUSE_FILE")
    if not path:
        return
    try:
        write_atomic(path, json.dumps({"cause": "health", "error": message}))
    except OSError:
        pass
