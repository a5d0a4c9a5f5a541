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
import hashlib, json, resource, sys, tempfile
import torch
from training.contract.config import Config
from training.parallel.mesh import ProcessMesh
from training.run import host_memory
from training.run.loop import Trainer

torch.set_num_threads(1)
cfg = Config()
m = cfg.model
m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 4
cfg.data.kind, cfg.train.progress, cfg.train.tensorboard = "synthetic", False, False
cfg.train.host_memory_keep = sys.argv[1] == "1"
trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single("cpu"), checkpointing=False)
losses = [trainer.train_step()[0] for _ in range(3)]
params = b"".join(p.detach().numpy().tobytes() for c in trainer.chunks for p in c.parameters())


def step_like_faults():
    # What a step does to the heap: 128 MiB of activations written, then all freed; page faults of the
    # last such round (the first may grow the heap either way).
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [torch.ones(1 << 18) for _ in range(128)]
        del held
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[-1]


print(json.dumps({"applied": host_memory._applied, "faults": step_like_faults(), "losses": losses,
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
    # 128 MiB written is 32,768 pages: without the setting glibc hands the freed memory back and faults it in again.
    assert off["faults"] > 16_000, off
    assert on["faults"] < 1_000, on
    assert on["losses"] == off["losses"]
    assert on["params"] == off["params"]
