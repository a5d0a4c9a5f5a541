"""Rank processes the launcher starts (locally, and inside each Slurm task): their environment, the
threads copying their output, and stopping them. No torch here: the ranks import it themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from training.contract.config import Config
from training.contract.rundir.secret_env import is_secret, resolve

KILL_GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL when ranks are stopped."""
POLL_S = 0.1
"""How often the launcher looks at its ranks."""
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int, allotted: int = 0) -> int:
    """OpenMP/MKL threads of one rank: the usable cores shared by the ranks of this node, so that they
    do not oversubscribe them; at most `allotted` (a Slurm task's CPUs, when given). Slurm without CPU
    binding (TaskPlugin=task/none) leaves every task the whole node's affinity, so the affinity alone
    would let a node's ranks start more threads than their job was given."""
    threads = max(1, usable_cores() // max(local_ranks, 1))
    return min(threads, allotted) if allotted > 0 else threads


def engine_env(cfg: Config, run_dir: str | None = None, secrets: bool = True) -> dict[str, str]:
    """What the engine needs in every rank's environment (locally and in the Slurm batch script), then
    the cluster's own variables (cluster.env), which win. Secret values (cluster.secret_keys) come from
    run_dir/secrets.json or this process's environment when cfg holds their placeholder
    (training/contract/rundir/secret_env.py); secrets=False leaves them out (the batch script must not contain them)."""
    # A failed NCCL collective becomes an error (then exit, then requeue) instead of a hang.
    env: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if cfg.parallel.tp > 1:
        # One hardware queue keeps TP communication ordered ahead of compute (Megatron's requirement).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    cluster = {str(k): str(v) for k, v in sorted(cfg.cluster.env.items())}
    if str(cfg.cluster.device) == "cuda" and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(cluster):
        # The caching allocator grows segments in place instead of keeping many fixed-size ones: ZeRO-3's
        # per-unit resize_ and MoE's variable expert batches fragment it least this way (the plan keeps 3 %).
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    gloo = gloo_ifname(cluster.get("NCCL_SOCKET_IFNAME", ""))
    if gloo and "GLOO_SOCKET_IFNAME" not in cluster:
        # The gloo background group (checkpoints, object collectives) binds to the interface NCCL is told to
        # use; without it gloo takes the hostname's address, which is 127.0.1.1 on common /etc/hosts layouts.
        env["GLOO_SOCKET_IFNAME"] = gloo
    if not secrets:
        cluster = {k: v for k, v in cluster.items() if not is_secret(k, cfg.cluster.secret_keys)}
    env.update(resolve(cluster, run_dir))
    return env


def gloo_ifname(nccl_ifname: str) -> str:
    """GLOO_SOCKET_IFNAME for an NCCL_SOCKET_IFNAME, where the two mean the same: NCCL's exact form "=eth0" or
    "=eth0,eth1" is gloo's list of names. NCCL's prefix ("eth") and exclusion ("^docker") forms have no gloo
    equivalent, so nothing is derived from them (set GLOO_SOCKET_IFNAME in cluster.env then)."""
    value = nccl_ifname.strip()
    if not value.startswith("="):
        return ""
    names = [n.strip() for n in value[1:].split(",") if n.strip()]
    return ",".join(names)


def rank_process_env(
    dist: Mapping[str, str], cluster_env: Mapping[str, str], threads: int = 0, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of one rank process: base (default: this process's), cluster_env (engine_env), the
    torch.distributed variables (training/contract/slurm_env.py: dist_env, torch_env_from_slurm), OpenMP/MKL threads
    (threads, default threads_per_rank of the node's ranks; the cluster's variables win), unbuffered output
    and this checkout first on PYTHONPATH (the engine must import from it whatever the current directory)."""
    env = dict(os.environ if base is None else base)
    env.update({str(k): str(v) for k, v in cluster_env.items()})
    env.update(dist)
    count = str(threads or threads_per_rank(int(dist.get("LOCAL_WORLD_SIZE", "1"))))
    env.update({name: count for name in _THREAD_VARS if name not in cluster_env})
    env["PYTHONUNBUFFERED"] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([PROJECT_ROOT] + [p for p in paths if p != PROJECT_ROOT])
    return env


def pump(src: BinaryIO, sinks: Sequence[BinaryIO], tail: list[bytes] | None = None, tail_bytes: int = 4096) -> None:
    """Copy a child's output into every sink as it comes (flushed, so a log is current when the child
    dies); with tail, also keep its last tail_bytes (where the exception line is)."""
    read = src.read1 if hasattr(src, "read1") else src.read
    for chunk in iter(lambda: read(4096), b""):
        for sink in sinks:
            sink.write(chunk)
            sink.flush()
        if tail is not None:
            tail.append(chunk)
            while sum(map(len, tail)) > tail_bytes and len(tail) > 1:
                tail.pop(0)


class PlainLines:
    """A sink for a log file that turns a progress bar's in-place redraws (`\\r` + line) into plain lines: each
    redraw ends the line before it, so the log holds one line per redraw and no carriage returns."""

    def __init__(self, sink: BinaryIO):
        self.sink = sink

    def write(self, chunk: bytes) -> None:
        self.sink.write(chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))

    def flush(self) -> None:
        self.sink.flush()


def start_pump(src: BinaryIO, sinks: Sequence[BinaryIO], tail: list[bytes] | None = None) -> threading.Thread:
    """pump() in a daemon thread (a child that never closes its output must not keep the launcher alive)."""
    thread = threading.Thread(target=pump, args=(src, sinks, tail), daemon=True)
    thread.start()
    return thread


def stop_processes(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every live process, SIGKILL what is still alive after KILL_GRACE_S; then reap them all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + KILL_GRACE_S
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
