"""The Trainer's keep_host_memory (training/run/host_memory.py; on in every run, not a user key): a CPU run's freed heap memory stays mapped for the next
step, and the results are the same bits with the setting on and off.

Each side runs in a fresh interpreter: the allocator's settings are per process, and glibc's adaptive
thresholds depend on everything the process freed before.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SIDE = r"""
import ctypes, hashlib, json, os, sys, tempfile
import torch
from training.contract.config import Config
from training.parallel.mesh import ProcessMesh
from training.run import host_memory
from training.run.loop import Trainer


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2


def mmapped_mib(nbytes):
    # MiB of a tensor of nbytes that glibc served with its own mmap (unmapped again when it is freed).
    before = libc.mallinfo2().hblkhd
    t = torch.ones(nbytes // 4)
    grown = (libc.mallinfo2().hblkhd - before) / 2**20
    del t
    return grown


def step_like_returned_mib():
    # What a step does to the heap: 128 MiB of activations written, then all freed. The resident memory that
    # the free handed back to the system, in the last of three rounds.
    page = os.sysconf("SC_PAGE_SIZE")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
    for _ in range(3):
        held = [torch.ones(1 << 18) for _ in range(128)]
        before = rss()
        del held
        returned = (before - rss()) / 2**20
    return returned


torch.set_num_threads(1)
cfg = Config()
m = cfg.model
m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 4
cfg.data.kind, cfg.train.progress, cfg.train.tensorboard = "synthetic", False, False
keep = sys.argv[1] == "1"
fresh = mmapped_mib(30 << 20)  # glibc's default: the first block this large gets its own mmap
trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single("cpu"), checkpointing=False, keep_host_memory=keep)
losses = [trainer.train_step()[0] for _ in range(3)]
params = b"".join(p.detach().numpy().tobytes() for c in trainer.chunks for p in c.parameters())
# Larger than any block freed so far: adaptive glibc maps it again; with the setting it comes from the heap.
trained = mmapped_mib(31 << 20)
print(json.dumps({"applied": host_memory._applied, "mmapped_mib": [fresh, trained],
                  "returned_mib": step_like_returned_mib(), "losses": losses,
                  "params": hashlib.sha256(params).hexdigest()}))
"""


def _side(keep: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SIDE, "1" if keep else "0"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's (Linux)")
def test_freed_heap_memory_stays_mapped_and_results_are_the_same_bits():
    off, on = _side(False), _side(True)
    assert off["applied"] is False and on["applied"] is True
    # A fresh process maps its first 30 MiB block, and, without the setting, maps again a block larger than any
    # it freed before; with it (applied when the trainer is built), 31 MiB come from the heap, and 128 MiB of
    # freed blocks stay mapped for the next step instead of going back to the system.
    assert off["mmapped_mib"][0] > 29 and on["mmapped_mib"][0] > 29, (off, on)
    assert off["mmapped_mib"][1] > 30, off
    assert on["mmapped_mib"][1] == 0 and on["returned_mib"] < 8, on
    assert on["losses"] == off["losses"]
    assert on["params"] == off["params"]
