"""The optimizer's blocked update spread over threads (training/optim/threads.py run_blocks): every block once,
the caller's thread count restored, a worker's error raised to the caller, and the same bits as on one thread."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from training.optim.adamw import ShardedAdamW
from training.optim.threads import run_blocks


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_every_block_runs_once_and_the_count_is_restored(two_threads):
    seen, workers, lock = [], set(), threading.Lock()

    def fn(b: int, worker: int) -> None:
        assert torch.get_num_threads() == 1  # each block's operations on one intra-op thread: no barrier
        with lock:
            seen.append(b)
            workers.add(worker)

    run_blocks(torch.device("cpu"), 40, fn)
    assert sorted(seen) == list(range(40)) and workers <= {0, 1}
    assert torch.get_num_threads() == 2
    order: list = []
    run_blocks(torch.device("meta"), 5, lambda b, w: order.append((b, w)))  # not a CPU: in order, here
    assert order == [(b, 0) for b in range(5)]


def test_a_workers_error_reaches_the_caller(two_threads):
    def fn(b: int, worker: int) -> None:
        if b == 7:
            raise ValueError("block 7")

    with pytest.raises(ValueError, match="block 7"):
        run_blocks(torch.device("cpu"), 20, fn)
    assert torch.get_num_threads() == 2


def test_threaded_update_is_bit_identical_to_one_thread(monkeypatch):
    def run(threads: int):
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(0)
        n = 1000
        segments = [types.SimpleNamespace(decay=True, shard_start=0, shard_end=600)]
        layout = types.SimpleNamespace(params=[torch.empty(1)], shard_size=n, segments=segments)
        opt = ShardedAdamW(layout, 0.9, 0.95, 1e-8, 0.1)
        monkeypatch.setattr(opt, "block_elements", lambda device: 97)  # 11 blocks, one of them partly decayed
        w = torch.randn(n, generator=g)
        for step in (1, 2, 3):
            opt.update(w, torch.randn(n, generator=g), lr=1e-2, step=step, grad_coef=0.5)
        return w, opt.exp_avg, opt.exp_avg_sq

    before = torch.get_num_threads()
    try:
        one, two = run(1), run(2)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
