"""Context parallelism on gloo: cp=2 step time against cp=1 at seq 2048, and the share of the ring's
communication hidden behind attention compute, measured side by side (CPU processes).

Two ranks, one thread each. Every round, in turn:
- cp=1: rank 0 runs one training step of the real Trainer on the whole sequence (one process; rank 1 waits);
- cp=2: both ranks run the same step with the sequence split over the cp group (ring attention).
Step time: median over the timed rounds of each side's wall clock (the slowest rank for cp=2), and of its CPU
time (the process's, gloo's threads included; for cp=2 the busier rank): the work a rank does, which other
jobs on the cores do not change, where the wall clock of two ranks depends on getting two cores.
Ring overlap, from the ring attention alone (forward + backward of one layer's attention, both ranks), alternated:
- overlap: the next block's K/V exchange in flight while this block computes (the engine's path);
- serial: each exchange waited for before computing (CPContext.overlap=False);
- comm: the exchanges alone (the same messages, no compute).
Hidden share = (serial - overlap) / comm, clipped to [0, 1]: how much of the communication time the overlap
took off the critical path.
Targets: cp=2 step CPU time below 0.8 x cp=1 (two ranks split the work: 0.5 is the ideal); the wall-clock
ratio is held to the same 0.8 only when the machine had two idle cores for the ranks (a 1-minute load average
below cores - 1.5 when the bench starts), else printed unjudged: two ranks sharing one core take cp=1's time.
The hidden share is judged (at least 0.5) only when the communication time exceeds the spread of the
attention timings; on one machine an exchange is a loopback copy of tens of ms, below that noise, and the
bench says so (docs/PERFORMANCE.md).

Usage: python bench/bench_context_parallel.py [--seq 2048] [--rounds 3]
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

import torch  # noqa: E402


def _cfg(seq: int, cp: int):
    from training.contract.config import Config

    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups = 2, 64, 4, 2
    m.ffn_hidden_size, m.seq_length, m.dropout = 128, seq, 0.0
    m.norm, m.activation, m.position, m.tie_embeddings, m.bias = "rmsnorm", "swiglu", "rope", False, False
    p = cfg.parallel
    p.cp, p.micro_batch, p.global_batch = cp, 1, 1
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = cp, 1.0
    cfg.train.steps, cfg.train.progress, cfg.train.precision = 1000, False, "fp32"
    cfg.data.kind = "synthetic"
    return cfg


def _ring_times(seq: int, mesh, rounds: int):
    """(overlap, serial, comm) seconds of one layer's ring attention forward + backward, medians."""
    import torch.distributed as dist

    from training.parallel.context import CPContext, _Ring, context_parallel_attention

    b, heads, groups, d = 1, 8, 4, 64
    s = seq // mesh.cp
    g = torch.Generator().manual_seed(mesh.cp_rank)
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = torch.randn(b, groups, s, d, generator=g), torch.randn(b, groups, s, d, generator=g)
    ctx = {
        ov: CPContext(mesh.cp, mesh.cp_rank, mesh.cp_group, mesh.group_ranks["cp"], "ring", ov) for ov in (True, False)
    }

    def attention(overlap: bool) -> float:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        dist.barrier(group=mesh.cp_group)
        t0 = time.perf_counter()
        context_parallel_attention(qq, kk, vv, ctx[overlap]).sum().backward()
        return time.perf_counter() - t0

    def comm() -> float:
        kv = torch.stack([k, v]).contiguous()
        ring = _Ring(ctx[True])
        dist.barrier(group=mesh.cp_group)
        t0 = time.perf_counter()
        for step in range(mesh.cp - 1):  # forward: K/V; backward: K/V and their grads, as the attention sends
            _Ring.finish(ring.start(kv, step)[1])
        for step in range(mesh.cp - 1):
            _Ring.finish(ring.start(kv, 2 * step)[1])
        for step in range(mesh.cp):
            _Ring.finish(ring.start(kv, 2 * step + 1)[1])
        return time.perf_counter() - t0

    attention(True), attention(False), comm()  # warm-up
    times = {"overlap": [], "serial": [], "comm": []}
    for _ in range(rounds):
        times["overlap"].append(attention(True))
        times["serial"].append(attention(False))
        times["comm"].append(comm())
    out = {k: statistics.median(v) for k, v in times.items()}
    # The timings' own noise: half the range of each attention variant's rounds, the larger.
    out["noise"] = max((max(v) - min(v)) / 2 for v in (times["overlap"], times["serial"]))
    return out


def _worker(seq: int, rounds: int):
    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mesh = ProcessMesh.from_env(1, 1, 2, 1, timeout_s=600)
    single = (
        Trainer(_cfg(seq, 1), tempfile.mkdtemp(), ProcessMesh.single(), checkpointing=False) if mesh.rank == 0 else None
    )
    split = Trainer(_cfg(seq, 2), tempfile.mkdtemp(), mesh, checkpointing=False)

    def one(trainer):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if trainer is not None:
            trainer.train_step()
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's step, the busier rank's CPU time
        return float(dt[0]), float(dt[1])

    one(single), one(split)  # warm-up
    cp1, cp2 = [], []
    for _ in range(rounds):
        cp1.append(one(single))
        cp2.append(one(split))
    ring = _ring_times(seq, mesh, rounds)
    mesh.destroy()
    return {
        "cp1": statistics.median(t for t, _ in cp1),
        "cp2": statistics.median(t for t, _ in cp2),
        "cp1_cpu": statistics.median(c for _, c in cp1),
        "cp2_cpu": statistics.median(c for _, c in cp2),
        **ring,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from training.run.local_ranks import run_ranks

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]  # before the ranks start: other jobs only
    r = run_ranks(_worker, 2, args=(args.seq, args.rounds), timeout_s=1800)[0]
    ratio, cpu_ratio = r["cp2"] / r["cp1"], r["cp2_cpu"] / r["cp1_cpu"]
    hidden = min(1.0, max(0.0, (r["serial"] - r["overlap"]) / r["comm"])) if r["comm"] > 0 else 0.0
    idle = load < cores - 1.5
    measurable = r["comm"] > r["noise"]
    print(
        f"seq {args.seq}, gloo, 2 ranks x 1 thread, median of {args.rounds} alternated rounds; "
        f"load average {load:.1f} on {cores} cores"
    )
    print(
        f"  step CPU time   cp=1 {r['cp1_cpu']:.3f} s   cp=2 {r['cp2_cpu']:.3f} s   ratio cp2/cp1 {cpu_ratio:.3f} "
        f"(target < 0.8)"
    )
    print(
        f"  step wall time  cp=1 {r['cp1']:.3f} s   cp=2 {r['cp2']:.3f} s   ratio cp2/cp1 {ratio:.3f} "
        + ("(target < 0.8)" if idle else "(not judged: fewer than 2 idle cores for the 2 ranks)")
    )
    print(
        f"  ring attention (one layer, fwd+bwd): overlap {r['overlap'] * 1e3:.1f} ms, serial "
        f"{r['serial'] * 1e3:.1f} ms, communication alone {r['comm'] * 1e3:.1f} ms, "
        f"timing noise +-{r['noise'] * 1e3:.1f} ms"
    )
    print(
        f"  communication hidden behind compute: {100 * hidden:.0f} % "
        + ("(target >= 50 %)" if measurable else "(not judged: the communication is below the timing noise)")
    )
    ok = cpu_ratio < 0.8 and (ratio < 0.8 or not idle) and (hidden >= 0.5 or not measurable)
    print("PASS" if ok else "MISS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
