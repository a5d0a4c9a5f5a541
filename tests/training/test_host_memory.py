"""train.host_memory_keep (training/run/host_memory.py): a CPU run's freed heap memory stays mapped for the next
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
import hashlib, json, os, sys, tempfile
import torch
from training.contract.config import Config
from training.parallel.mesh import ProcessMesh
from training.run import host_memory
from training.run.loop import Trainer


def step_like_returned_mib():
    # What a step does to the heap: 128 MiB of activations written, then all freed. The resident memory that
    # the free handed back to the system, in the last of three rounds (the first may grow the heap either way).
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
cfg.train.host_memory_keep = sys.argv[1] == "1"
fresh = step_like_returned_mib()
trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single("cpu"), checkpointing=False)
built = step_like_returned_mib()
losses = [trainer.train_step()[0] for _ in range(3)]
params = b"".join(p.detach().numpy().tobytes() for c in trainer.chunks for p in c.parameters())
trained = step_like_returned_mib()
print(json.dumps({"applied": host_memory._applied, "returned_mib": [fresh, built, trained], "losses": losses,
                  "params": hashlib.sha256(params).hexdigest()}))
"""


def _side(keep: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SIDE, "1" if keep else "0"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_freed_heap_memory_stays_mapped_and_results_are_the_same_bits():
    off, on = _side(False), _side(True)
    assert off["applied"] is False and on["applied"] is True
    # Without the setting glibc hands the 128 MiB freed back to the system (to be faulted in again, page by
    # page) whenever they lie at the top of its heap: in these runs at least once of the three rounds (where
    # they lie depends on what the process allocated before). With it, the memory stays mapped once the
    # trainer exists, before and after training.
    _, built_on, trained_on = on["returned_mib"]
    assert max(off["returned_mib"]) > 100, off
    assert built_on < 8 and trained_on < 8, on
    assert on["losses"] == off["losses"]
    assert on["params"] == off["params"]
