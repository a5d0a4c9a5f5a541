"""Expert parallelism: tokens/s of a tiny MoE at ep=2 against ep=1, both at dp=2, measured side by side.

Two gloo processes (CPU, one thread each). Each builds two trainers of the same MoE GPT at the same per-rank
batch: ep=1 (every rank holds all experts; expert grads all-reduced over dp) and ep=2 (each rank holds half
the experts; tokens go to their experts' rank and back by all-to-all, expert grads need no dp reduction).
The compute per rank is the same on both sides (each expert's tokens are processed once, by one rank), so
the ratio measures what the all-to-all exchanges cost against the expert-gradient all-reduce they replace.
After warm-up, every round runs a turn of each side (the order reversed every other round), the ranks aligned
by a barrier before each turn; per round the slower rank's time, the ratio taken within the round, then the
median over rounds. Printed: tokens/s of each side, ep2 / ep1 tokens/s, and model-state bytes per rank.
Targets (docs/PERFORMANCE.md says why): tokens/s ratio >= TARGET_SPEED; model-state bytes per rank at ep=2
<= TARGET_MEMORY x those at ep=1 (the experts' weights, grads and optimizer state are split over ep).
Usage: python bench/bench_moe.py [--rounds 10] [--warmup 2]
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

import torch

from training.contract.config import Config, config_from_dict, config_to_dict

TARGET_SPEED = 0.8
TARGET_MEMORY = 0.72
STEPS_PER_TURN = 2


def base_cfg() -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 128, 4, 64
    m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size, m.activation = 8, 2, 256, "swiglu"
    m.vocab_size = 512
    p = cfg.parallel
    p.dp, p.micro_batch, p.global_batch, p.zero = 2, 4, 8, 1
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 2, 1.0
    t = cfg.train
    t.progress, t.steps, t.tensorboard = False, 10**6, False
    cfg.data.kind = "synthetic"
    return cfg


def _worker(cfg_dict, warmup: int, rounds: int):
    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    torch.set_num_threads(1)  # two ranks on two cores
    sides, memory = {}, {}
    for ep in (1, 2):
        cfg = config_from_dict(cfg_dict)
        cfg.parallel.ep = ep
        mesh = ProcessMesh.from_env(1, 1, 1, 2, backend="gloo", timeout_s=300, ep=ep)
        trainer = Trainer(cfg, tempfile.mkdtemp(), mesh, checkpointing=False)
        micro = trainer.sampler.micro_batches(0)
        memory[ep] = sum(trainer.optimizer.memory_report().values())

        def turn(t=trainer, mb=micro):
            for _ in range(STEPS_PER_TURN):
                t.train_step(mb, defer_param_gather=True)
            t.optimizer.finish_param_gather()

        sides[ep] = turn
    for _ in range(warmup):
        for ep in sides:
            sides[ep]()
    times = {ep: [] for ep in sides}
    for r in range(rounds):
        for ep in (1, 2) if r % 2 == 0 else (2, 1):
            dist.barrier()
            t0 = time.perf_counter()
            sides[ep]()
            times[ep].append((time.perf_counter() - t0) / STEPS_PER_TURN)
    dist.barrier()
    return {"times": times, "memory": memory}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    from training.run.local_ranks import run_ranks

    cfg = base_cfg()
    results = run_ranks(_worker, 2, args=(config_to_dict(cfg), args.warmup, args.rounds), timeout_s=1200)
    per_round = {ep: [max(r["times"][ep][k] for r in results) for k in range(args.rounds)] for ep in (1, 2)}
    tokens = cfg.parallel.global_batch * cfg.model.seq_length
    tok_s = {ep: tokens / statistics.median(v) for ep, v in per_round.items()}
    speed = statistics.median(b / a for a, b in zip(per_round[2], per_round[1]))  # ep2 tokens/s / ep1 tokens/s
    mem = max(r["memory"][2] for r in results) / max(r["memory"][1] for r in results)
    m = cfg.model
    print(
        f"MoE: L={m.num_layers} h={m.hidden_size} s={m.seq_length}, {m.num_experts} swiglu experts of "
        f"{m.moe_ffn_hidden_size}, top-{m.moe_top_k}, micro-batch {cfg.parallel.micro_batch} per rank, dp=2 "
        f"zero=1, gloo, 2 ranks x 1 thread, {args.rounds} rounds of {STEPS_PER_TURN} steps"
    )
    print(f"ep=1 {tok_s[1]:,.0f} tokens/s   ep=2 {tok_s[2]:,.0f} tokens/s")
    ok_speed, ok_mem = speed >= TARGET_SPEED, mem <= TARGET_MEMORY
    print(f"tokens/s ratio ep2/ep1 {speed:.3f} (target >= {TARGET_SPEED}): {'yes' if ok_speed else 'NO'}")
    print(f"model-state bytes per rank ep2/ep1 {mem:.3f} (target <= {TARGET_MEMORY}): {'yes' if ok_mem else 'NO'}")
    ok = ok_speed and ok_mem
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
