"""Checkpoint throughput against this machine's raw sequential write rate, measured in the same run.

    .venv/bin/python bench/bench_checkpoint.py [--mb 64] [--dir /tmp]

One process: a state of --mb MiB of fp32 (split in 16 "parameters" plus Adam-like states) is saved and
loaded through CheckpointManager's storage path (DCP + manifest + atomic commit), sync and async. Printed:
raw write MB/s (one big file, fsync), save MB/s, load MB/s, their ratios, and the blocked time of an async
save against a sync one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from training.checkpoint import CheckpointManager, storage  # noqa: E402
from training.config import Config  # noqa: E402
from training.mesh import ProcessMesh  # noqa: E402
from training.optim import DistributedOptimizer  # noqa: E402


class _Model(torch.nn.Module):
    def __init__(self, numel: int, n: int = 16):
        super().__init__()
        side = int((numel // n) ** 0.5)
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(side, side)) for _ in range(n))

    def named_parameters(self, *a, **k):
        return [(f"layers.{i}.weight", p) for i, p in enumerate(self.w)]


def raw_write_rate(directory: str, nbytes: int) -> float:
    path = os.path.join(directory, "raw.bin")
    buf = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return nbytes / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="model weights in MiB (the checkpoint is ~3x: m and v)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = tempfile.mkdtemp(dir=args.dir)
    try:
        model = _Model(args.mb * 2**20 // 4)
        mesh = ProcessMesh.single()
        cfg = Config()
        cfg.parallel.dp = 1
        opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)  # fp32, zero=0: m and v, no master
        opt.exp_avg.normal_()
        opt.exp_avg_sq.uniform_()
        total = sum(p.numel() for p in model.parameters()) * 4 * 3
        raw = raw_write_rate(base, total)
        rows = {}
        for mode in ("sync", "async"):
            cfg = Config()
            cfg.train.async_save = mode == "async"
            run = os.path.join(base, mode)
            ck = CheckpointManager(run, mesh, cfg, log=lambda m: None)
            t0 = time.perf_counter()
            stats = ck.save(1, [model], opt, {"consumed_samples": 0})
            blocked = time.perf_counter() - t0
            ck.wait()
            total_s = time.perf_counter() - t0
            rows[mode] = (blocked, total_s, stats.bytes or storage.dir_size(storage.step_dir(run, 1)))
        cfg = Config()
        ck = CheckpointManager(os.path.join(base, "sync"), mesh, cfg, log=lambda m: None)
        t0 = time.perf_counter()
        ck.maybe_resume([model], opt, {})
        load_s = time.perf_counter() - t0
        size = rows["sync"][2]
        print(f"checkpoint size            {size / 2**20:8.1f} MiB")
        print(f"raw sequential write       {raw / 2**20:8.1f} MiB/s")
        print(f"sync save                  {size / rows['sync'][1] / 2**20:8.1f} MiB/s  "
              f"({size / rows['sync'][1] / raw:.2f} x raw, {rows['sync'][1]:.3f} s)")
        print(f"load                       {size / load_s / 2**20:8.1f} MiB/s  ({load_s:.3f} s)")
        print(f"async save blocked         {rows['async'][0]:8.3f} s  vs sync {rows['sync'][0]:.3f} s "
              f"({rows['async'][0] / rows['sync'][0]:.2f} x); async total {rows['async'][1]:.3f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
