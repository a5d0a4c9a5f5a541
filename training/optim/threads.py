"""The optimizer's elementwise passes without a barrier per operation.

The update (moments, weights, the grad buffer's zero-fill, the write-back) is a chain of memory-bound
elementwise operations on the flat shard. With several OpenMP threads every one of them is a parallel
region that ends in a barrier: on a machine whose cores are shared (the usual case for a CPU run), a
thread that lost its core holds the whole region until the scheduler gives the core back, and the
update took many times longer at two threads than at one (docs/PERFORMANCE.md has the measured figures).
So each operation runs on one intra-op thread (`elementwise_threads`), and the blocked update spreads its
blocks over as many Python threads as the caller had intra-op threads (`run_blocks`): each takes the next
block when it is done with one, so a thread that lost its core holds up only its own block, and on an
idle machine the passes still use every core. Elementwise operations give the same bits whatever the
thread count (no reduction splits) and the blocks are the same, so neither changes a result; reductions
(the grad norm) keep the default thread count.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch


@contextmanager
def elementwise_threads(device: torch.device) -> Iterator[None]:
    """On a CPU device with more than one intra-op thread: one thread inside, the count restored after."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n <= 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
_pool_lock = threading.Lock()


def _workers(n: int) -> ThreadPoolExecutor:
    """The process's pool of block workers (grown to n; idle between updates)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(n, thread_name_prefix="meshrun-update"), n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run_blocks(device: torch.device, count: int, fn: Callable[[int, int], None]) -> None:
    """fn(block, worker) for every block in range(count), each block once, the blocks independent.

    On a CPU device with n > 1 intra-op threads: on min(n, count) threads (worker 0 is the caller), each at
    one intra-op thread, taking the blocks in order from a shared counter; the caller's count is restored
    after. Elsewhere: in order, on the calling thread, as worker 0."""
    n = min(torch.get_num_threads(), count)
    if device.type != "cpu" or n <= 1:
        for b in range(count):
            fn(b, 0)
        return
    blocks = itertools.count()  # next() is atomic under the GIL: each block goes to exactly one worker

    def work(worker: int) -> None:
        torch.set_num_threads(1)  # this thread's own intra-op count (OpenMP keeps one per thread)
        for b in blocks:
            if b >= count:
                return
            fn(b, worker)

    with elementwise_threads(device):
        pool = _workers(n - 1)
        futures = [pool.submit(work, k) for k in range(1, n)]
        try:
            work(0)
        finally:
            for f in futures:
                f.result()  # waits for every worker, re-raising a worker's error here
