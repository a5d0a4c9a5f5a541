"""Checkpoint throughput against this machine's raw sequential write rate, measured in the same run.

    .venv/bin/python bench/bench_checkpoint.py [--mb 64] [--dir /tmp] [--reps 3] [--step-tokens 256]

One process: a state of --mb MiB of fp32 (split in 16 "parameters" plus Adam-like states) is saved and
loaded through CheckpointManager's storage path (DCP + CRC while writing + manifest + atomic commit), sync
and async, one CheckpointManager per mode for all repetitions (as in a run: one manager, many saves).
Each repetition measures, one after the other: the raw write rates (one big file, write-back started
early as the checkpoint writer starts it, fsync), the stand-in step below on its own, a sync save, an
async save; medians are printed (the machine is shared). Load is
measured from a warm page cache and, as root, from a cold one (`sync; echo 3 > /proc/sys/vm/drop_caches`
before the load; otherwise the cold figure is skipped and says why).

Both modes are measured the way the training loop (training/run/loop.py) uses a save:
    [optimizer step] save(); the next step's forward and backward; wait_staged(); [optimizer step]
and "blocked" is the time the loop spends inside save() plus the time it waits in wait_staged(), the
barrier before the optimizer changes the state. A sync save is complete when save() returns (its barrier
returns at once); an async save copies the state to host memory in the background during the forward and
backward, and writes it after. The stand-in for forward and backward is real work of a real step's size:
a forward and backward pass (3 matmuls per layer, 6 x parameters x tokens flops) through a stack of linear
layers made of the model's own 16 weight matrices, over --step-tokens rows (256: one short sequence, a
small step for a model of this size, so little time to hide the copy behind). It reads the weights and
writes none of the saved state. The same work runs in both modes; the table also shows how long it takes
alone and while an async save copies and writes beside it (the part of a save the loop does not wait for,
but shares the CPU with).
Targets: sync save >= 0.5 x raw (bytes / blocked); async save blocks the loop < 0.1 x a sync save. Exit 1
when one is missed. The last line is the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from training.checkpoint import CheckpointManager, storage  # noqa: E402
from training.checkpoint.crc_writer import start_writeback  # noqa: E402
from training.contract.config import Config  # noqa: E402
from training.optim import DistributedOptimizer  # noqa: E402
from training.parallel.mesh import ProcessMesh  # noqa: E402


class _Model(torch.nn.Module):
    def __init__(self, numel: int, n: int = 16):
        super().__init__()
        side = int((numel // n) ** 0.5)
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(side, side)) for _ in range(n))

    def named_parameters(self, *a, **k):
        return [(f"layers.{i}.weight", p) for i, p in enumerate(self.w)]


def state_write_rate(directory: str, tensors) -> float:
    """The raw rate for the state's own bytes: each tensor's memory written as is into one file, fsync.
    Unlike raw_write_rate's cache-hot 1 MiB buffer, the source is read from main memory, as a save reads it.
    Write-back starts after each tensor, as the checkpoint writer starts it after each large write
    (training/checkpoint/crc_writer.py): a baseline without it would let the save beat "raw" by that alone."""
    path = os.path.join(directory, "state.bin")
    t0 = time.perf_counter()
    nbytes = 0
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            nbytes += f.write(t.detach().reshape(-1).view(torch.uint8).numpy())
            start_writeback(f.fileno())
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return nbytes / dt


def raw_write_rate(directory: str, nbytes: int) -> float:
    """The disk's sequential rate: a cache-hot 1 MiB buffer written nbytes over, write-back started every
    16 MiB (as the checkpoint writer does), fsync."""
    path = os.path.join(directory, "raw.bin")
    buf = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for i in range(nbytes >> 20):
            f.write(buf)
            if i % 16 == 15:
                start_writeback(f.fileno())
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return nbytes / dt


def step_work(weights, tokens: int) -> float:
    """Forward and backward through a stack of linear layers made of `weights` (side x side each), over
    `tokens` rows; seconds taken. Reads the weights, writes only its own activations and gradients."""
    side = weights[0].shape[1]
    scale = side**-0.5  # keeps activations and gradients near unit size: no overflow
    x = torch.randn(tokens, side)
    t0 = time.perf_counter()
    with torch.no_grad():
        acts = []
        for w in weights:
            acts.append(x)
            x = (x @ w.t()) * scale
        grad, weight_grads = torch.ones_like(x), []
        for w, a in zip(reversed(weights), reversed(acts)):
            weight_grads.append(grad.t() @ a)
            grad = (grad @ w) * scale
    return time.perf_counter() - t0


SYNC_VS_RAW = 0.5
"""Target: a sync save writes at least half the raw sequential rate."""
ASYNC_BLOCKED_VS_SYNC = 0.1
"""Target: an async save holds the training loop for less than a tenth of a sync save."""


def drop_caches() -> str:
    """ "" once the page cache is dropped (root only), else why it could not be."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return ""
    except OSError as exc:
        return f"cannot drop the page cache ({exc.strerror}; needs root)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="model weights in MiB (the checkpoint is ~3x: m and v)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are printed)")
    ap.add_argument(
        "--step-tokens",
        type=int,
        default=256,
        help="rows of the stand-in forward and backward that runs between save() and wait_staged()",
    )
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
        weights = list(model.parameters())
        raws, state_raws, alone = [], [], []
        blocked = {"sync": [], "async": []}
        beside = {"sync": [], "async": []}
        async_total = []
        tensors = weights + [opt.exp_avg, opt.exp_avg_sq]
        managers = {}
        for mode in ("sync", "async"):
            cfg = Config()
            cfg.train.async_save = mode == "async"
            cfg.train.keep_last = args.reps  # nothing is deleted inside a timed save: see below
            managers[mode] = CheckpointManager(os.path.join(base, mode), mesh, cfg, log=lambda m: None)
        size = 0
        for rep in range(args.reps):
            raws.append(raw_write_rate(base, total))
            state_raws.append(state_write_rate(base, tensors))
            alone.append(step_work(weights, args.step_tokens))
            for mode, ck in managers.items():
                # The barrier of the step just "taken" (the loop calls it before every optimizer step, so it
                # has been called before any save): it returns at once, nothing is pending.
                ck.wait_staged()
                t0 = time.perf_counter()
                stats = ck.save(rep + 1, [model], opt, {"consumed_samples": rep})
                held = time.perf_counter() - t0
                beside[mode].append(step_work(weights, args.step_tokens))
                t1 = time.perf_counter()
                ck.wait_staged()
                held += time.perf_counter() - t1
                ck.wait()
                blocked[mode].append(held)
                if mode == "sync":
                    size = stats.bytes
                else:
                    async_total.append(time.perf_counter() - t0)
                # Untimed, the previous repetition's checkpoint goes, as the raw rates' files do: each write
                # then reuses freed page-cache memory (in a VM, memory touched for the first time costs a
                # fault to the hypervisor per page, which would make every later repetition slower).
                storage.prune(ck.run_dir, 1)
        sync_dir = os.path.join(base, "sync")

        def load() -> float:
            ck = CheckpointManager(sync_dir, mesh, Config(), log=lambda m: None)
            t0 = time.perf_counter()
            ck.maybe_resume([model], opt, {})
            return time.perf_counter() - t0

        warm = statistics.median(load() for _ in range(args.reps))
        cold_s, why = [], ""
        for _ in range(args.reps):
            why = drop_caches()
            if why:
                break
            cold_s.append(load())
        cold = statistics.median(cold_s) if cold_s else None
        raw, sync_s = statistics.median(raws), statistics.median(blocked["sync"])
        state_raw = statistics.median(state_raws)
        held_s, async_s = statistics.median(blocked["async"]), statistics.median(async_total)
        step_alone = statistics.median(alone)
        step_sync, step_async = statistics.median(beside["sync"]), statistics.median(beside["async"])
        mib = 2**20
        sync_ratio, block_ratio = size / sync_s / raw, held_s / sync_s
        print(f"medians of {args.reps} repetitions; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(f"checkpoint size            {size / mib:8.1f} MiB")
        print(
            f"raw sequential write       {raw / mib:8.1f} MiB/s  (a cache-hot 1 MiB buffer, repeated; write-back every 16 MiB; fsync)"
        )
        print(
            f"raw write of the state     {state_raw / mib:8.1f} MiB/s  (the tensors' own memory, as is; fsync): "
            f"sync save {size / sync_s / state_raw:.2f} x this"
        )
        print(
            f"sync save                  {size / sync_s / mib:8.1f} MiB/s  ({sync_ratio:.2f} x raw, {sync_s:.3f} s; "
            f"target >= {SYNC_VS_RAW})"
        )
        print(f"load, warm page cache      {size / warm / mib:8.1f} MiB/s  ({warm:.3f} s)")
        if cold is not None:
            print(f"load, cold page cache      {size / cold / mib:8.1f} MiB/s  ({cold:.3f} s)")
        else:
            print(f"load, cold page cache      skipped: {why}")
        print(
            f"async save blocked         {held_s:8.3f} s  vs sync {sync_s:.3f} s ({block_ratio:.3f} x; target < "
            f"{ASYNC_BLOCKED_VS_SYNC}); async save() to commit {async_s:.3f} s"
        )
        print(
            f"stand-in fwd+bwd           {step_alone:8.3f} s  alone ({args.step_tokens} tokens); "
            f"{step_sync:.3f} s after a sync save, {step_async:.3f} s beside an async save"
        )
        print(
            json.dumps(
                {
                    "bench": "checkpoint",
                    "size_mib": round(size / mib, 1),
                    "raw_mib_s": round(raw / mib, 1),
                    "state_raw_mib_s": round(state_raw / mib, 1),
                    "sync_save_vs_state_raw": round(size / sync_s / state_raw, 3),
                    "sync_save_vs_raw": round(sync_ratio, 3),
                    "async_blocked_vs_sync": round(block_ratio, 4),
                    "sync_blocked_s": round(sync_s, 4),
                    "async_blocked_s": round(held_s, 4),
                    "step_alone_s": round(step_alone, 4),
                    "step_beside_async_s": round(step_async, 4),
                    "load_warm_mib_s": round(size / warm / mib, 1),
                    "load_cold_mib_s": round(size / cold / mib, 1) if cold else None,
                }
            )
        )
        return 0 if sync_ratio >= SYNC_VS_RAW and block_ratio < ASYNC_BLOCKED_VS_SYNC else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
