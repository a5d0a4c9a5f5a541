"""One CPU thread for the optimizer's elementwise passes.

The update (moments, weights, the grad buffer's zero-fill, the write-back) is a chain of memory-bound
elementwise operations on the flat shard. With several OpenMP threads every one of them is a parallel
region that ends in a barrier: on a machine whose cores are shared (the usual case for a CPU run), a
thread that lost its core holds the whole region until the scheduler gives the core back, and the
update took many times longer at two threads than at one (docs/PERFORMANCE.md has the measured figures).
Elementwise operations give the same bits whatever the thread count (no reduction splits), so running
them on one thread changes no result; reductions (the grad norm) keep the default thread count.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

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
