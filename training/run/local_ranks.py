"""Run a function on N local gloo processes and collect what each rank returns.

    results = run_ranks(fn, world_size=4, args=(...,), timeout_s=120)

The multi-process tests (through tests/helpers/dist.py) and the benchmarks in bench/ start their ranks here.
`fn` must be importable (a module-level function). Each process gets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT in its environment, `threads` torch threads (the machine's
cores are shared), then calls fn(*args) and sends back the result. It does NOT create a process group: fn does
that (usually through ProcessMesh.from_env) and should call mesh.destroy(). A rank's exception is re-raised here
with its traceback; a run longer than timeout_s kills every rank and raises TimeoutError, so a deadlocked
collective fails its caller instead of hanging it.

Ranks are forked from a forkserver (one per calling process) that has imported torch and the engine once
(PRELOAD), with the caller's current environment and working directory: a rank starts in milliseconds instead of
paying an interpreter start and torch's import. fresh=True starts fresh interpreters instead.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, threads, env) -> None:
    # The caller's environment as it is now (a forkserver's children would otherwise see the one it started with).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
        }
    )
    import torch

    torch.set_num_threads(threads)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - sent to the parent, which re-raises
        results.put((rank, False, traceback.format_exc()))


# Modules every rank imports: a forkserver that has imported them once per calling process forks each rank with
# them loaded, so a start no longer pays an interpreter start and torch's import per rank (most of a small
# test's time). The checkpoint's save and load path (distributed checkpoint, the DTensor and sharded-tensor code
# it pulls in, the CRC writer) is the warm agent's list too (training/run/warm_agent.py): a rank that saves or
# resumes would otherwise import it again. The forkserver itself has started no thread and no
# process group, so forking it is safe.
PRELOAD = [
    "torch",
    "torch.distributed",
    "training.run.loop",
    "training.parallel.mesh",
    "training.checkpoint.safe_read",
    "training.checkpoint.crc_writer",
    "torch.distributed._shard.sharded_tensor",
    "training.run.local_ranks",
]


def _context(fresh: bool = False):
    """The multiprocessing context ranks start from: fresh interpreters (spawn), or forks of the preloaded forkserver."""
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _collect(fn: Callable[..., Any], procs: list, results, world_size: int, timeout_s: float) -> dict[int, Any]:
    """Every rank's result by rank; raises a rank's failure, a rank that died without a result, or the timeout."""
    out: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    while len(out) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{world_size}-rank run of {fn.__name__} exceeded {timeout_s} s; finished ranks: {sorted(out)}"
            )
        try:
            rank, ok, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
            if dead and not errors:
                raise RuntimeError(
                    f"rank(s) {dead} died without a result (exit codes {[procs[i].exitcode for i in dead]})"
                ) from None
            continue
        if ok:
            out[rank] = value
        else:
            errors.append((rank, value))
            break  # the other ranks may now block on a collective: do not wait for them
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    return out


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    threads: int = 1,
    fresh: bool = False,
) -> list[Any]:
    """fn(*args) on world_size local ranks; returns the ranks' results in rank order. fresh: ranks in new
    interpreters that have imported nothing yet (a test of what the engine itself imports, and when)."""
    ctx = _context(fresh)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(fn, r, world_size, port, tuple(args), results, threads, dict(os.environ)), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        out = _collect(fn, procs, results, world_size, timeout_s)
        for p in procs:
            p.join(timeout=30)
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
