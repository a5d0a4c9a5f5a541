"""Measure this machine's rates for the cost model (launcher/plan/cost_model.py): run as a subprocess by
`meshrun action=recommend` on CPU clusters, so the launcher itself never imports torch.

    python -m training.observe.cost_probe --ranks N --threads T --hidden H --heads A --ffn F --seq S --tp 1,2 --micro 1,4

N processes (gloo on loopback), each with T threads, run at the same time, as the job's ranks would:
- a GPT layer forward + backward (norms, QKV, causal attention, output projection, MLP) at each (micro-batch, tp)
  shape, its weights sharded as tensor parallelism shards them; seconds = overhead + FLOPs / rate, fitted over
  the shapes by least squares (rate: "flops", overhead: "overhead_s" per layer pass);
- all-reduce over the N ranks at three sizes, fitted as latency + bytes x 2(N-1)/N / busbw;
- an AdamW step on a 1M-parameter tensor: seconds per parameter;
- the same layer pass on rank 0 alone and on every rank at once, in five back-to-back pairs: "cores",
  how many ranks compute at full speed at once (N x alone / together, between 1 and N). Fewer than N when the
  ranks outnumber the cores, or when other work on the machine holds them (Linux shares the cores between
  sessions first, so a job's N ranks may together get one core's worth); then a rank that computes while the
  others wait (a pipeline bubble) runs faster than one whose peers compute too (launcher/plan/cost_model.py).
Prints one JSON object on stdout (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

SIZES_BYTES = (16 * 1024, 512 * 1024, 4 * 1024 * 1024)
"""All-reduce message sizes: one latency-bound, two bandwidth-bound."""


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x, intercept clamped at 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else my / mx
    a = my - b * mx
    if a < 0:  # no negative fixed cost: through the origin instead
        a, b = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return a, b


def layer_flops(micro: int, tp: int, hidden: int, heads: int, ffn: int, seq: int) -> float:
    """Forward + backward FLOPs of one layer on one tp rank (3 x forward: weight GEMMs and the s x s attention),
    counted as launcher/plan/cost_model.py counts them."""
    tokens = micro * seq
    weights = 2 * tokens * (3 * hidden * hidden + hidden * hidden + 2 * ffn * hidden) / tp
    attention = 4 * tokens * seq * hidden / tp
    return 3.0 * (weights + attention)


def time_layer(micro: int, tp: int, hidden: int, heads: int, ffn: int, seq: int, dtype, reps: int = 4) -> float:
    """Best-of-three mean seconds of one layer forward + backward at this shape."""
    import torch
    import torch.nn.functional as F

    h, a = hidden, heads // tp
    w = [
        torch.randn(h, 3 * h // tp, dtype=dtype) * 0.02,
        torch.randn(h // tp, h, dtype=dtype) * 0.02,
        torch.randn(h, ffn // tp, dtype=dtype) * 0.02,
        torch.randn(ffn // tp, h, dtype=dtype) * 0.02,
    ]
    for t in w:
        t.requires_grad_(True)
    x = torch.randn(micro, seq, h, dtype=dtype, requires_grad=True)

    def once():
        y = F.layer_norm(x, (h,))
        q, k, v = (y @ w[0]).view(micro, seq, 3, a, h // heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(micro, seq, -1) @ w[1]
        z = x + o
        out = z + F.gelu(F.layer_norm(z, (h,)) @ w[2]) @ w[3]
        out.sum().backward()

    once()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def time_all_reduce(world: int) -> list[tuple[int, float]]:
    """(bytes, seconds) of an all-reduce over every rank at each size; the slowest rank's time."""
    import torch

    from training.parallel import collectives as comm

    out = []
    for nbytes in SIZES_BYTES:
        x = torch.ones(nbytes // 4)
        for _ in range(2):
            comm.all_reduce_op(x)
        reps = 10 if nbytes < 2**20 else 4
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            comm.all_reduce_op(x)
        dt = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
        comm.all_reduce_op(dt, op=comm.ReduceOp.MAX)
        out.append((nbytes, dt.item()))
    return out


def time_optimizer(n: int = 1 << 20) -> float:
    """Seconds per parameter of one AdamW step (fp32 states)."""
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    return (time.perf_counter() - t0) / 3 / n


def time_cores(rank: int, world: int, micro: int, args: argparse.Namespace, dtype, rounds: int = 5) -> float:
    """Ranks that compute at full speed at once: world / the median over `rounds` of (every rank's layer pass at
    once) / (rank 0's alone, measured just before), clamped to [1, world] (rank 0's figure). Each pair is measured
    back to back, so outside load that comes and goes meets both halves of a pair alike; the median is the
    typical sharing, not the quietest moment's."""
    import statistics

    from training.parallel import collectives as comm

    ratios = []
    shape = (micro, 1, args.hidden, args.heads, args.ffn, args.seq, dtype)
    for _ in range(rounds):
        comm.barrier()
        alone = time_layer(*shape, reps=2) if rank == 0 else 0.0  # the others wait at the barrier, off the cores
        comm.barrier()
        together = time_layer(*shape, reps=2)
        if rank == 0:
            ratios.append(together / alone)
    return max(1.0, min(float(world), world / statistics.median(ratios))) if rank == 0 else 0.0


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    import torch

    from training.parallel import collectives as comm

    torch.set_num_threads(max(1, args.threads))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.ranks > 1:
        from training.parallel.rendezvous import wait_for_store

        wait_for_store(120.0, "127.0.0.1", port, rank)
        comm.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    shapes: dict[str, float] = {}
    points = []
    for tp in args.tp:
        for micro in args.micro:
            if args.heads % tp or args.ffn % tp:
                continue
            if args.ranks > 1:
                comm.barrier()  # every rank computes at once: the contention of a real job
            dt = time_layer(micro, tp, args.hidden, args.heads, args.ffn, args.seq, dtype)
            shapes[f"micro{micro}_tp{tp}"] = dt
            points.append((layer_flops(micro, tp, args.hidden, args.heads, args.ffn, args.seq), dt))
    overhead, seconds_per_flop = _fit(points)
    out = {
        "flops": 1.0 / seconds_per_flop,
        "overhead_s": overhead,
        "layer_s": shapes,
        "ranks": args.ranks,
        "threads": args.threads,
        "optimizer_s_per_param": time_optimizer(),
    }
    if args.ranks > 1:
        ar = time_all_reduce(args.ranks)
        factor = 2.0 * (args.ranks - 1) / args.ranks
        latency, seconds_per_byte = _fit([(b * factor, t) for b, t in ar])
        out.update(latency_s=latency, busbw=1.0 / seconds_per_byte, all_reduce_s={str(b): t for b, t in ar})
        out["cores"] = time_cores(rank, args.ranks, max(args.micro), args, dtype)
        comm.destroy_process_group()
    if rank == 0:
        results.put(out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--ffn", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--tp", type=_ints, default=[1])
    ap.add_argument("--micro", type=_ints, default=[1, 4])
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    out = results.get(timeout=600)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print(f"cost_probe: a rank exited with {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
