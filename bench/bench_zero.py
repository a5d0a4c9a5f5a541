"""ZeRO-3 step time against ZeRO-1 at dp=2, and resident memory with offload=nvme against none.

1. Two gloo processes (CPU) build, at the same layout (dp=2, one GPT), a zero=1 and a zero=3 trainer. After
   warm-up, every round runs a turn of each (the order reversed every other round), the two ranks aligned by a
   barrier before each turn: STEPS_PER_TURN steps, the deferred gathers waited for inside the timer. Printed:
   the median step time of each and the overhead zero3 / zero1 (the median of the per-round ratios).
   Target: overhead <= ZERO3_TARGET (zero=3 gathers every unit twice per micro-batch: 1.5x the traffic).
2. Two single-rank processes, side by side, build the same larger GPT (fp32) and train STEPS_RSS steps: one with
   offload=none, one with offload=nvme (state files in a temporary directory). Printed: each one's resident
   memory growth (from before the Trainer to after the steps), the optimizer state bytes, and the fraction of
   the state that nvme took out of resident memory. Target: >= RSS_TARGET of the state.
Exit 1 when a target is missed.
Usage: python bench/bench_zero.py [--rounds 8] [--hidden 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from training.contract.config import Config, config_from_dict, config_to_dict

ZERO3_TARGET = 2.0
RSS_TARGET = 0.8
STEPS_PER_TURN = 3
STEPS_RSS = 3


def base_cfg(hidden: int) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, hidden, 8, 128
    cfg.parallel.micro_batch, cfg.parallel.global_batch, cfg.parallel.bucket_mb = 2, 8, 1.0
    cfg.cluster.peak_tflops = 1.0
    cfg.data.kind, cfg.train.progress, cfg.train.steps = "synthetic", False, 10**6
    return cfg


def _timing_worker(cfg_dict, warmup: int, rounds: int):
    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mesh = ProcessMesh.from_env(1, 1, 1, 2, timeout_s=300)
    trainers = {}
    for zero in (1, 3):
        cfg = config_from_dict(cfg_dict)
        cfg.parallel.dp, cfg.parallel.zero = 2, zero
        trainers[zero] = Trainer(cfg, tempfile.mkdtemp(), mesh, checkpointing=False)
    micro = trainers[1].sampler.micro_batches(0)

    def turn(zero):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(STEPS_PER_TURN):
            trainers[zero].train_step(micro, defer_param_gather=True)
        trainers[zero].optimizer.finish_param_gather()
        return (time.perf_counter() - t) / STEPS_PER_TURN

    for _ in range(warmup):
        turn(1), turn(3)
    times = {1: [], 3: []}
    for r in range(rounds):
        for zero in (1, 3) if r % 2 == 0 else (3, 1):
            times[zero].append(turn(zero))
    mesh.destroy()
    return times


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_worker(cfg_dict, offload_dir: str):
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    cfg = config_from_dict(cfg_dict)
    cfg.parallel.offload = "none" if os.environ["RANK"] == "0" else "nvme"
    cfg.parallel.offload_dir = offload_dir
    cfg.parallel.global_batch = cfg.parallel.micro_batch = 1
    before = _rss()
    trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single(), checkpointing=False)
    micro = trainer.sampler.micro_batches(0)
    for _ in range(STEPS_RSS):
        trainer.train_step(micro)
    return {
        "offload": str(cfg.parallel.offload),
        "growth": _rss() - before,
        "memory": trainer.optimizer.memory_report(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    from training.run.local_ranks import run_ranks

    cfg = config_to_dict(base_cfg(args.hidden))
    ranks = run_ranks(_timing_worker, 2, args=(cfg, args.warmup, args.rounds), timeout_s=3600)
    t1, t3 = ranks[0][1], ranks[0][3]
    overhead = statistics.median(b / a for a, b in zip(t1, t3))
    print(
        f"dp=2 step time: zero=1 {statistics.median(t1) * 1e3:.1f} ms, zero=3 {statistics.median(t3) * 1e3:.1f} ms"
        f" -> zero=3 overhead x{overhead:.2f} (target <= {ZERO3_TARGET})"
    )
    big = base_cfg(args.hidden * 2)
    with tempfile.TemporaryDirectory() as nvme:
        none, off = run_ranks(_rss_worker, 2, args=(config_to_dict(big), nvme), timeout_s=1800)
    state = none["memory"]["optimizer"]
    fraction = (none["growth"] - off["growth"]) / (state - off["memory"]["host_offload"])
    print(
        f"resident memory growth: offload=none {none['growth'] / 2**20:.1f} MiB, offload=nvme "
        f"{off['growth'] / 2**20:.1f} MiB; optimizer state {state / 2**20:.1f} MiB (nvme files "
        f"{off['memory']['nvme_offload'] / 2**20:.1f} MiB, block buffers {off['memory']['host_offload'] / 2**20:.1f}"
        f" MiB) -> {fraction:.2f} of the state out of resident memory (target >= {RSS_TARGET})"
    )
    ok = overhead <= ZERO3_TARGET and fraction >= RSS_TARGET
    print("OK" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
