"""train.compile on CPU: step time of the engine with every layer compiled (torch.compile, inductor) against the
eager engine, measured side by side in one process (one rank, gloo).

Both sides are the real Trainer on the same model, data and seed. Warm-up: the compiled side's first step
compiles (its compile time is printed on its own, the `compile_s` the engine reports), then each side runs
`--warmup` more steps; then `--rounds` rounds in which each side runs one step, the order alternating from
round to round. Reported: the median of the per-round ratios compiled / eager step time and each side's median
step time. Target: ratio <= --target (default 1.0: compiling must not make steps slower). Exits 1 on a miss.
The inductor cache goes to a temporary directory (nothing cached outside it) unless TORCHINDUCTOR_CACHE_DIR is
set. The last line is the figures as one JSON object.
Usage: python bench/bench_compile.py [--rounds N] [--warmup N] [--layers L --hidden H --heads A --seq S --batch B]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _cfg(args, compile: bool):
    from training.contract.config import Config

    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = args.layers, args.hidden, args.heads, args.seq
    p = cfg.parallel
    p.tp = p.pp = p.dp = 1
    p.micro_batch, p.global_batch = args.batch, args.batch
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    t = cfg.train
    t.steps, t.progress, t.tensorboard, t.compile = 10**6, False, False, compile
    cfg.data.kind = "synthetic"
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--target", type=float, default=1.0)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_compile_")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "inductor"))
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    from training.run.local_ranks import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import torch

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mesh = ProcessMesh.from_env(1, 1, 1, 1, timeout_s=600)
    sides = {
        name: Trainer(_cfg(args, name == "compiled"), os.path.join(tmp, name), mesh, checkpointing=False)
        for name in ("eager", "compiled")
    }

    def step(name: str) -> float:
        t0 = time.perf_counter()
        sides[name].train_step()
        return time.perf_counter() - t0

    first = step("compiled")
    compile_s = sides["compiled"].compile_clock.seconds
    for _ in range(args.warmup):
        step("eager")
        step("compiled")
    times = {"eager": [], "compiled": []}
    ratios = []
    for r in range(args.rounds):
        order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
        got = {name: step(name) for name in order}
        for name, dt in got.items():
            times[name].append(dt)
        ratios.append(got["compiled"] / got["eager"])
    mesh.destroy()
    ratio = statistics.median(ratios)
    figures = {
        "shape": [args.layers, args.hidden, args.heads, args.seq, args.batch],
        "threads": torch.get_num_threads(),
        "compile_s": round(compile_s, 2),
        "first_step_s": round(first, 2),
        "eager_step_s": round(statistics.median(times["eager"]), 4),
        "compiled_step_s": round(statistics.median(times["compiled"]), 4),
        "ratio_compiled_over_eager": round(ratio, 3),
        "target": args.target,
        "rounds": args.rounds,
    }
    print(
        f"compile: {sides['compiled'].compiled_layers} layers compiled in {compile_s:.1f} s (first step {first:.1f} s)"
    )
    print(
        f"step time, median of {args.rounds} alternated rounds: eager {figures['eager_step_s'] * 1e3:.1f} ms, "
        f"compiled {figures['compiled_step_s'] * 1e3:.1f} ms; compiled / eager {ratio:.3f} "
        f"(target <= {args.target}) {'ok' if ratio <= args.target else 'MISSED'}"
    )
    print(json.dumps(figures))
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
