"""One Slurm task = one rank: the callable submitit runs on every task of the job.

It maps SLURM_* to torch's variables, binds the rank to its NUMA node with numactl, runs
`python -m training.main RUN_DIR` as a child, and records how the rank ended in
run_dir/slurm/attempt_<A>/rank_<R>.json for the epilogue (launcher/slurm_driver.py). A failed rank
raises, so the task exits non-zero and `srun --kill-on-bad-exit=1` ends the step at once.
No torch import: the child imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List

from launcher.numa import choose_node, numactl_prefix
from training.config import load_config
from training.slurm_env import torch_env_from_slurm

TAIL_BYTES = 4096


class RankFailed(RuntimeError):
    """A rank ended with a failure exit code (the task must fail so srun stops the step)."""


def attempt_dir(run_dir: str, attempt: int) -> str:
    return os.path.join(run_dir, "slurm", f"attempt_{attempt}")


def _pump(src, dst, tail: List[bytes]) -> None:
    """Pass the child's stderr through and keep its last bytes (the exception line)."""
    for chunk in iter(lambda: src.read1(4096), b""):
        dst.write(chunk)
        dst.flush()
        tail.append(chunk)
        while sum(map(len, tail)) > TAIL_BYTES and len(tail) > 1:
            tail.pop(0)


def last_error_line(text: str) -> str:
    """The last non-empty line that looks like an error ("ValueError: ...", "error: ...")."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:500]
    return lines[-1][:500] if lines else ""


@dataclass
class RankTask:
    """The pickled callable of a meshrun Slurm job (the same object for every attempt)."""

    run_dir: str
    """The run directory (config.json, checkpoints, events)."""

    def child_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(torch_env_from_slurm(env))
        env["PYTHONUNBUFFERED"] = "1"
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(local_world, 1))))
        return env

    def __call__(self) -> int:
        # The preemption signal (USR2) and SIGTERM reach every process of the step: the engine (our
        # child) saves and exits 3; this wrapper must stay alive to record that, so it ignores them
        # (this also replaces submitit's own handler, which would requeue before the save).
        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT):
            signal.signal(sig, lambda *_: None)
        env = self.child_env()
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        attempt = int(env.get("MESHRUN_ATTEMPT", "0"))
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        cfg = load_config(os.path.join(self.run_dir, "config.json"))
        prefix: List[str] = []
        numa_node = choose_node(cfg.cluster.numa, cfg.cluster.numa_map, cfg.cluster.device, local_rank,
                                int(env.get("LOCAL_WORLD_SIZE", "1")), env.get("CUDA_VISIBLE_DEVICES"))
        if numa_node is not None:
            if shutil.which("numactl"):
                prefix = numactl_prefix(numa_node)
                env["MESHRUN_NUMA_NODE"] = str(numa_node)
            else:
                print(f"warning: numactl not found on {node}: rank {rank} is not NUMA-bound "
                      f"(install numactl or set cluster.numa=off)", file=sys.stderr)
        started = time.time()
        child = subprocess.Popen(prefix + [sys.executable, "-m", "training.main", self.run_dir],
                                 env=env, stderr=subprocess.PIPE)
        tail: List[bytes] = []
        pump = threading.Thread(target=_pump, args=(child.stderr, sys.stderr.buffer, tail), daemon=True)
        pump.start()
        code = child.wait()
        pump.join(timeout=5)
        record = {
            "rank": rank, "local_rank": local_rank, "node": node, "exit_code": code,
            "signal": -code if code < 0 else None, "numa_node": numa_node,
            "error": last_error_line(b"".join(tail).decode("utf-8", "replace")) if code not in (0, 3) else "",
            "started": started, "ended": time.time(),
        }
        out = attempt_dir(self.run_dir, attempt)
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, f".rank_{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(out, f"rank_{rank}.json"))
        if code in (0, 3):
            return code
        raise RankFailed(f"rank {rank} on {node} exited with {code}: {record['error']}")
