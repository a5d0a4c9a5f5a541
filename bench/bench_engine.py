"""Engine benchmarks, measured side by side in one process (CPU + gloo, or one GPU with --gpu).

1. The engine at tp=1 against a plain nanoGPT-style PyTorch GPT of the same shape (fused QKV, SDPA, tied
   embeddings, F.cross_entropy, torch.optim.AdamW with decay on 2-D weights, clip_grad_norm_ 1.0), at three
   shapes. Both sides are measured the same way: the same number of warm-up steps, then `--rounds` rounds
   in which each side runs one step (the order alternates from round to round, so neither always follows
   the other); a step is forward + backward + clipping + AdamW + reading the loss, with the batch assembled
   before the timer on both sides; its rate is tokens / step time. Reported: the median of the per-round
   ratios engine / plain (robust to the machine's load swinging between rounds) and each side's median
   tokens/s. Target: ratio >= 1.0 at every shape.
2. The engine's hand-written TP against PyTorch DTensor TP (ColwiseParallel / RowwiseParallel) on the
   same model at tp=2 (2 gloo processes), both built with the engine's attention (8 heads of 32: 4 local
   heads per rank), interleaved the same way. Like for like, the engine runs without sequence
   parallelism (both all-reduce each block's two row-parallel outputs): target >= 1.0. The engine with
   SP (all-gather + reduce-scatter instead, activations split over the sequence) runs in the same rounds
   and is printed against the same DTensor steps, without a target (its gain is memory).
3. MFU of the engine against this machine's measured matmul rate (printed, no target).
4. The tp=1 comparison as users run it: each side in its own process at the machine's default thread count
   (torch's default, no set_num_threads). Both processes are started and warmed up (2 steps each), then
   stepped in lock-step over their stdin: `--proc-rounds` rounds of one step of each side, the order
   alternating from round to round, with only one side computing at a time. The two steps of a round are
   adjacent in time, so a swing in the machine's load hits both (whole runs one after another did not: on
   a shared machine the steps of one run spread over 0.4-1.1 s). `--pairs` fresh pairs of processes per
   shape, since allocation luck differs from process to process. Reported: the median, over all pairs, of
   the ratios plain time / engine time taken over two consecutive rounds (one of each order, so that each side
   has one step that follows its own and one that follows the other side's: `round_pair_ratios`), with each
   pair's median beside it. Target >= 1.0 at every shape.
   (The one-thread in-process figure of 1. stays as the second figure.)
Exits 1 when a target is missed. The last line is the figures as one JSON object.
Usage: python bench/bench_engine.py [--rounds N] [--warmup N] [--shapes a,b,tiny] [--no-tp] [--gpu]
                                   [--pairs N] [--proc-rounds N] [--no-procs] [--no-inproc]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.nn as nn
import torch.nn.functional as F

from launcher.plan.model_size import model_flops_per_step
from training.contract.config import Config, config_from_dict, config_to_dict

# name -> (layers, hidden, heads, seq, batch); vocab 256 (the byte vocabulary) everywhere.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "a": (4, 256, 8, 256, 8),  # the shape of the nanoGPT-style comparison (docs/PERFORMANCE.md)
    "b": (4, 512, 8, 512, 4),
    "tiny": (4, 64, 4, 64, 8),  # conf/model/tiny.yaml, global batch 8
}
ROUNDS = {"a": 15, "b": 7, "tiny": 31, "gpu": 15, "tp2": 15}
"""Default timed rounds per shape (a step of shape b takes seconds on a CPU; tiny's take milliseconds)."""


def bench_cfg(shape: str, gpu: bool = False) -> Config:
    cfg = Config()
    m = cfg.model
    if gpu:
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 24, 2048, 16, 2048, 50304
        batch = 4
        cfg.train.precision, cfg.cluster.device = "bf16", "cuda"
    else:
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, batch = SHAPES[shape]
    cfg.parallel.micro_batch = cfg.parallel.global_batch = batch
    cfg.data.kind, cfg.train.progress = "synthetic", False
    cfg.train.steps, cfg.train.grad_clip, cfg.train.weight_decay = 10**6, 1.0, 0.1
    return cfg


class PlainBlock(nn.Module):
    """nanoGPT's Block: fused c_attn (or separate q, k, v for DTensor's column split), SDPA, GELU MLP."""

    def __init__(self, h: int, a: int, fused: bool):
        super().__init__()
        self.d = h // a  # head dim: fixed, so a tp split keeps the engine's heads (a/tp local heads of h/a)
        self.fused = fused
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        if fused:
            self.c_attn = nn.Linear(h, 3 * h)
        else:
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.c_proj = nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln_1(x)
        if self.fused:
            q, k, v = self.c_attn(y).split(y.shape[-1], dim=2)
        else:
            q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.c_proj(att)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """nanoGPT-style reference of the engine's GPT (learned positions, tied embeddings, biases)."""

    def __init__(self, cfg: Config, fused: bool = True):
        super().__init__()
        m = cfg.model
        self.wte, self.wpe = nn.Embedding(m.vocab_size, m.hidden_size), nn.Embedding(m.seq_length, m.hidden_size)
        self.blocks = nn.ModuleList(
            PlainBlock(m.hidden_size, m.num_attention_heads, fused) for _ in range(m.num_layers)
        )
        self.ln_f = nn.LayerNorm(m.hidden_size)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def plain_stepper(cfg: Config, model: nn.Module, device, dtype=None, foreach=None, clip=True) -> Callable[[], None]:
    """One training step of the plain GPT per call (the batch is made once, before any timer)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    nodecay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": nodecay, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
        foreach=foreach,
    )
    b, s, V = cfg.parallel.global_batch, cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, V, (b, s + 1), generator=g).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=foreach)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the engine reads its loss every step too

    return step


def engine_stepper(cfg: Config, mesh=None):
    """(step function, trainer): one engine training step per call, its batch assembled before the timer."""
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mesh = mesh or ProcessMesh.single("cuda" if cfg.cluster.device == "cuda" else "cpu")
    trainer = Trainer(cfg, tempfile.mkdtemp(), mesh, checkpointing=False)
    micro = trainer.sampler.micro_batches(0)

    def step() -> None:
        trainer.train_step(micro)

    return step, trainer


def interleave(
    sides: list[Callable[[], None]], warmup: int, rounds: int, sync: Callable[[], None]
) -> list[list[float]]:
    """Seconds per step of each side: `warmup` untimed steps each, then `rounds` rounds of one step per side,
    the order reversed every other round."""
    for _ in range(warmup):
        for f in sides:
            f()
    times: list[list[float]] = [[] for _ in sides]
    for r in range(rounds):
        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            sync()
            t0 = time.perf_counter()
            sides[i]()
            sync()
            times[i].append(time.perf_counter() - t0)
    return times


def compare(times_engine: list[float], times_other: list[float], tokens: int) -> dict[str, float]:
    """Median tokens/s of each side and the median of the per-round ratios engine / other."""
    return {
        "engine": tokens / statistics.median(times_engine),
        "other": tokens / statistics.median(times_other),
        "ratio": statistics.median(o / e for e, o in zip(times_engine, times_other)),
    }


def _tp_worker(cfg_dict, warmup: int, rounds: int):
    """On 2 ranks: the engine at tp=2 without and with SP against DTensor TP of the plain GPT, interleaved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from training.parallel.mesh import ProcessMesh

    torch.set_num_threads(1)  # two ranks, one core each
    cfg = config_from_dict(cfg_dict)
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp = 2, 1, False
    mesh = ProcessMesh.from_env(2, 1, 1, 1)
    engine, _ = engine_stepper(cfg, mesh)
    cfg_sp = config_from_dict(cfg_dict)
    cfg_sp.parallel.tp, cfg_sp.parallel.dp, cfg_sp.parallel.sp = 2, 1, True
    engine_sp, _ = engine_stepper(cfg_sp, mesh)
    torch.manual_seed(0)
    model = PlainGPT(cfg, fused=False)
    dmesh = init_device_mesh("cpu", (2,))
    for blk in model.blocks:
        parallelize_module(
            blk,
            dmesh,
            {
                "q": ColwiseParallel(),
                "k": ColwiseParallel(),
                "v": ColwiseParallel(),
                "c_proj": RowwiseParallel(),
                "c_fc": ColwiseParallel(),
                "mlp_proj": RowwiseParallel(),
            },
        )
    # foreach kernels and clip_grad_norm_ cannot mix DTensor and plain params (docs/PLATFORM.md):
    # per-tensor AdamW and no clipping, which only favours DTensor.
    dtensor = plain_stepper(cfg, model, torch.device("cpu"), foreach=False, clip=False)
    barrier = torch.distributed.barrier  # both ranks start each timed step together
    times = interleave([engine, dtensor, engine_sp], warmup, rounds, barrier)
    mesh.destroy()
    return times


PROC_ROUNDS = {"a": 8, "b": 8, "tiny": 30}
"""Default lock-step rounds per pair of processes (each round: one step of each side)."""

PROC_WARMUP = 2
"""Untimed steps each side runs before it reports ready."""


def side_main(side: str, shape: str) -> int:
    """A section-4 child: one side alone in this process at the default thread count. Builds its model,
    runs PROC_WARMUP steps, prints "ready", then for each "step" line on stdin runs one step and prints
    its seconds; ends at end of input."""
    cfg = bench_cfg(shape)
    torch.manual_seed(0)
    if side == "plain":
        step = plain_stepper(cfg, PlainGPT(cfg), torch.device("cpu"))
    else:
        step, _ = engine_stepper(cfg)
    for _ in range(PROC_WARMUP):
        step()
    print(json.dumps({"ready": side, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            continue
        t0 = time.perf_counter()
        step()
        print(time.perf_counter() - t0, flush=True)
    return 0


class SideProcess:
    """A section-4 child process, stepped one step at a time over its stdin and stdout."""

    def __init__(self, side: str, shape: str):
        # The user's environment, without thread pins: torch picks its default thread count as users get it.
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        self.side = side
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--side", side, "--shapes", shape],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"the {self.side} side ended early:\n{err[-2000:]}")
        return line

    def ready(self) -> int:
        """Waits for the child's warm-up; returns its thread count."""
        return int(json.loads(self._line())["threads"])

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def lockstep_pair(shape: str, rounds: int) -> tuple[list[float], list[float], int]:
    """(engine step seconds, plain step seconds, threads): a fresh process per side, both warmed up, then
    `rounds` rounds of one step each, the order reversed every other round. Only one side computes at a
    time, and the two steps of a round are adjacent in time, so a change in the machine's load hits both."""
    sides = {"engine": SideProcess("engine", shape), "plain": SideProcess("plain", shape)}
    try:
        threads = {name: p.ready() for name, p in sides.items()}
        times: dict[str, list[float]] = {"engine": [], "plain": []}
        for r in range(rounds):
            for name in ("engine", "plain") if r % 2 == 0 else ("plain", "engine"):
                times[name].append(sides[name].step())
    finally:
        for p in sides.values():
            p.close()
    return times["engine"], times["plain"], threads["engine"]


def round_pair_ratios(engine: list[float], plain: list[float]) -> list[float]:
    """Plain time / engine time over each two consecutive rounds (orders engine-plain, then plain-engine).

    A step that follows its own side's step starts with that process's threads still awake; one that follows
    the other side's starts cold, with the other process's threads still spinning. In a single round one side's
    step has the first kind and the other side's the second, so the per-round ratios of a shape whose step is a
    few milliseconds split into two clusters, one per order, and their median fell on the edge between them.
    Over two consecutive rounds each side has one step of each kind."""
    return [(plain[k] + plain[k + 1]) / (engine[k] + engine[k + 1]) for k in range(0, len(engine) - 1, 2)]


def separate_processes(shapes: list[str], pairs: int, rounds: int, figures: dict[str, object]) -> bool:
    """Section 4: each side in its own process at the default thread count, stepped in lock-step rounds,
    `pairs` fresh pairs of processes per shape; True if every shape meets the target."""
    ok = True
    print(
        f"\nengine tp=1 vs plain GPT, each side in its own process at the default thread count, {pairs} pairs of "
        f"processes per shape, stepped in alternated lock-step rounds; median of the ratios plain time / "
        f"engine time over two consecutive rounds (one of each order)"
    )
    print(
        f"{'shape':<5} {'threads':>7} {'rounds':>6} {'engine s/step':>13} {'plain s/step':>12} "
        f"{'per pair':<24} {'ratio':>6}  target >= 1.0"
    )
    for name in shapes:
        n = rounds or PROC_ROUNDS[name]
        t_e: list[float] = []
        t_p: list[float] = []
        per_pair: list[float] = []
        threads = 0
        ratios: list[float] = []
        for _ in range(pairs):
            e, p, threads = lockstep_pair(name, n)
            t_e += e
            t_p += p
            pair_ratios = round_pair_ratios(e, p)
            ratios += pair_ratios
            per_pair.append(statistics.median(pair_ratios))
        r = statistics.median(ratios)
        # Each side's step time on the same footing: the median of its mean step over two consecutive rounds.
        step_e, step_p = (statistics.median((t[k] + t[k + 1]) / 2 for k in range(0, len(t) - 1, 2)) for t in (t_e, t_p))
        hit = r >= 1.0
        ok &= hit
        figures[f"procs_{name}"] = {
            "pairs": pairs,
            "rounds_per_pair": n,
            "threads": threads,
            "engine_step_s": round(step_e, 4),
            "plain_step_s": round(step_p, 4),
            "pair_ratios": [round(x, 3) for x in per_pair],
            "ratio": round(r, 4),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        print(
            f"{name:<5} {threads:>7} {len(t_e):>6} {step_e:>13.3f} {step_p:>12.3f} "
            f"{' '.join(f'{x:.3f}' for x in per_pair):<24} {r:>6.3f}  {'yes' if hit else 'NO'}"
            f"   (load average {os.getloadavg()[0]:.1f})"
        )
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="timed rounds (one step of each side per round); default per shape: " + str(ROUNDS),
    )
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first")
    ap.add_argument("--shapes", default="a,b,tiny", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--no-tp", action="store_true", help="skip the tp=2 comparison (2 processes)")
    ap.add_argument("--gpu", action="store_true", help="tp=1 bf16 GPT ~1.3B on one GPU against plain PyTorch")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per process (1: on a shared machine, spinning OpenMP threads that lose their "
        "core to another job make timings swing far more than one thread does)",
    )
    ap.add_argument("--pairs", type=int, default=3, help="fresh pairs of processes per shape (section 4)")
    ap.add_argument(
        "--proc-rounds",
        type=int,
        default=0,
        help="lock-step rounds per pair of processes, an even number (ratios are taken over two rounds); "
        "default per shape: " + str(PROC_ROUNDS),
    )
    ap.add_argument("--no-procs", action="store_true", help="skip the separate-process default-thread section")
    ap.add_argument("--no-inproc", action="store_true", help="skip the one-process sections (1. and 2.)")
    ap.add_argument("--side", choices=("engine", "plain"), help=argparse.SUPPRESS)  # a section-4 child run
    args = ap.parse_args(argv)
    if args.proc_rounds % 2 or args.proc_rounds < 0:
        ap.error(f"--proc-rounds must be an even number (ratios are taken over two rounds), not {args.proc_rounds}")
    if args.side:
        return side_main(args.side, args.shapes)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.gpu else "cpu")
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)
    shapes = ["gpu"] if args.gpu else args.shapes.split(",")
    ok = True
    figures: dict[str, object] = {
        "bench": "engine",
        "threads": torch.get_num_threads(),
        "warmup": args.warmup,
        "default_threads": default_threads,
    }
    if args.no_inproc:
        shapes = []
    if shapes:
        print(
            f"engine tp=1 vs plain nanoGPT-style PyTorch GPT, one process, {torch.get_num_threads()} threads, "
            f"{args.warmup} warm-up steps each, then interleaved rounds; medians"
        )
        print(
            f"{'shape':<5} {'L':>2} {'h':>5} {'a':>3} {'s':>5} {'b':>2} {'rounds':>6} {'engine tok/s':>13} "
            f"{'plain tok/s':>12} {'ratio':>6}  target >= 1.0   MFU"
        )
    for name in shapes:
        cfg = bench_cfg(name, args.gpu)
        torch.manual_seed(0)
        plain = plain_stepper(cfg, PlainGPT(cfg).to(device), device, torch.bfloat16 if args.gpu else None)
        engine, trainer = engine_stepper(cfg)
        t_engine, t_plain = interleave([engine, plain], args.warmup, args.rounds or ROUNDS[name], sync)
        m = cfg.model
        r = compare(t_engine, t_plain, cfg.parallel.global_batch * m.seq_length)
        # The planner's FLOPs (a launch's plan.json holds the same figure; this trainer's run dir has no plan).
        mfu = model_flops_per_step(cfg) / statistics.median(t_engine) / trainer.peak_flops
        hit = r["ratio"] >= 1.0
        ok &= hit
        figures[name] = {
            "rounds": len(t_engine),
            "engine_tok_s": round(r["engine"], 1),
            "plain_tok_s": round(r["other"], 1),
            "ratio": round(r["ratio"], 4),
            "mfu": round(mfu, 4),
        }
        print(
            f"{name:<5} {m.num_layers:>2} {m.hidden_size:>5} {m.num_attention_heads:>3} {m.seq_length:>5} "
            f"{cfg.parallel.global_batch:>2} {len(t_engine):>6} {r['engine']:>13,.0f} {r['other']:>12,.0f} {r['ratio']:>6.3f}  "
            f"{'yes' if hit else 'NO':<14} {100 * mfu:.1f}%"
        )
    if not args.gpu and not args.no_tp and not args.no_inproc:
        from training.run.local_ranks import run_ranks

        cfg = bench_cfg("a")
        rounds = args.rounds or ROUNDS["tp2"]
        (t_engine, t_dtensor, t_sp), _ = run_ranks(_tp_worker, 2, args=(config_to_dict(cfg), 2, rounds), timeout_s=900)
        tokens = cfg.parallel.global_batch * cfg.model.seq_length
        r, r_sp = compare(t_engine, t_dtensor, tokens), compare(t_sp, t_dtensor, tokens)
        hit = r["ratio"] >= 1.0
        ok &= hit
        figures["tp2"] = {
            "rounds": len(t_engine),
            "engine_tok_s": round(r["engine"], 1),
            "dtensor_tok_s": round(r["other"], 1),
            "ratio": round(r["ratio"], 4),
            "engine_sp_tok_s": round(r_sp["engine"], 1),
            "sp_ratio": round(r_sp["ratio"], 4),
        }
        print(
            f"tp=2 (shape a, 4 local heads of 32 on both, {len(t_engine)} rounds): engine TP {r['engine']:,.0f} "
            f"tok/s, DTensor TP {r['other']:,.0f} tok/s, ratio {r['ratio']:.3f} (target >= 1.0): "
            f"{'yes' if hit else 'NO'}"
        )
        print(
            f"  engine TP+SP {r_sp['engine']:,.0f} tok/s, ratio to the same DTensor TP steps {r_sp['ratio']:.3f} "
            f"(no target: SP trades an all-reduce for all-gather + reduce-scatter to split activations)"
        )
    if not args.gpu and not args.no_procs:
        ok &= separate_processes(args.shapes.split(","), args.pairs, args.proc_rounds, figures)
    print("RESULT:", "PASS" if ok else "FAIL")
    figures["pass"] = ok
    print(json.dumps(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
