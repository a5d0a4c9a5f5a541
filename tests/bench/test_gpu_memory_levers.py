"""bench/gpu_memory_levers.py's allocator comparison (gpu_check step 5) on a stand-in torch.cuda: it judges the
bytes the build requested (torch.cuda.memory_stats' requested_bytes, before the caching allocator's 2 MiB block
rounding), not memory_allocated, and collects the dropped Trainer's reference cycles before empty_cache."""

from __future__ import annotations

import gc
import os
import sys
import types
import weakref

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_memory_levers as levers  # noqa: E402

MIB2 = 2 * 2**20


class FakeCuda:
    """The caching allocator as the review describes it: a request of 10 MiB or more gets its own block rounded up
    to 2 MiB; memory_stats reports both the requested bytes and the (rounded) allocated ones."""

    def __init__(self):
        self.requested = self.allocated = self.peak = 0
        self.calls = []
        self.on_empty_cache = None

    def malloc(self, n):
        self.requested += n
        self.allocated += -(-n // MIB2) * MIB2 if n >= 10 * 2**20 else n
        self.peak = max(self.peak, self.requested)

    def free(self, n):
        self.requested -= n
        self.allocated -= -(-n // MIB2) * MIB2 if n >= 10 * 2**20 else n

    def synchronize(self):
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self):
        self.peak = self.requested

    def memory_stats(self):
        return {
            "requested_bytes.all.current": self.requested,
            "requested_bytes.all.peak": self.peak,
            "allocated_bytes.all.current": self.allocated,
        }

    def memory_allocated(self):
        return self.allocated

    def empty_cache(self):
        self.calls.append("empty_cache")
        if self.on_empty_cache:
            self.on_empty_cache()


def _torch(cuda):
    return types.SimpleNamespace(cuda=cuda)


def test_requested_bytes_pass_where_the_rounded_blocks_would_fail():
    """The script's model (101,558,272 parameters): bf16 weights and fp32 grads and Adam states, each a tensor
    the allocator rounds up (+300 KiB, +600 KiB each). The requested bytes equal the states exactly (plus a few
    scalars); the allocated bytes are about 2.7 MB over, far past ALLOCATOR_SLACK."""
    n = 101_558_272
    report = {"weights": 2 * n, "grads": 4 * n, "optimizer": 3 * 4 * n}  # fp32 master, exp_avg, exp_avg_sq
    cuda = FakeCuda()
    cuda.malloc(5 * 2**20)  # something already there before the build
    torch = _torch(cuda)

    def build():
        for part in (2 * n, 4 * n, 4 * n, 4 * n, 4 * n):
            cuda.malloc(part)
        cuda.malloc(8)  # a step counter
        cuda.malloc(64 * 2**20)  # transient scratch, freed before the build returns: only the peak sees it
        cuda.free(64 * 2**20)
        return "trainer"

    allocated_before = cuda.memory_allocated()
    built, gained, peak = levers.allocator_gain(torch, build)
    assert built == "trainer" and "synchronize" in cuda.calls
    ok, found = levers.device_check(report, gained, peak)
    assert ok and found["allocator_gained"] - found["device_states"] == 8, found
    assert found["build_peak_over_states"] == 64 * 2**20 + 8
    over = cuda.memory_allocated() - allocated_before - found["device_states"]
    assert over > 2_500_000 and over > levers.ALLOCATOR_SLACK  # what memory_allocated would have judged
    assert not levers.device_check(report, gained - 16, peak)[0]  # less than the states: a failure too


def test_release_collects_the_trainers_cycles_before_emptying_the_cache():
    """A Trainer held only by a reference cycle (its hooks) frees its tensors when the collector runs: release()
    collects before empty_cache, so the next build starts from a quiet allocator."""
    cuda = FakeCuda()
    torch = _torch(cuda)

    class Trainer:
        def __init__(self):
            self.hook = lambda: self  # a cycle through the hook's closure
            cuda.malloc(40 * 2**20)

        def __del__(self):
            cuda.free(40 * 2**20)

    t = Trainer()
    alive = weakref.ref(t)
    seen = {}
    cuda.on_empty_cache = lambda: seen.update(collected=alive() is None, requested=cuda.requested)
    gc.disable()  # no automatic collection: only release() may free the cycle
    try:
        del t
        assert alive() is not None  # the cycle keeps it until a collection
        levers.release(torch, cuda=True)
    finally:
        gc.enable()
    assert seen == {"collected": True, "requested": 0}, seen
    assert cuda.calls == ["empty_cache"]
    cuda.calls.clear()
    levers.release(torch, cuda=False)  # --dry: nothing to hand back
    assert cuda.calls == []
