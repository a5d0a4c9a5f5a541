"""Pipeline bubble, measured against the planner's formula (CPU + gloo processes).

Stage work is made uniform and independent of how busy the machine's cores are: every virtual stage is
a module whose forward sleeps t_f / v and whose backward sleeps t_b / v (a custom autograd Function),
so each rank's compute per micro-batch is exactly t_f + t_b whatever v. The real schedules of
training/schedules/pipeline.py move real [s, b, h] activations and gradients between the ranks over gloo,
in the batch_isend_irecv exchanges (tag 0) that the schedules also use on NCCL.
Measured: per rank, idle share = 1 - busy / wall of the step (busy = compute only), averaged over the
pipeline ranks, median over the timed steps. Planned: (p - 1) / (v m + p - 1).
Every case runs both exchange paths of training/schedules/pipeline.py, step by step in turn: "wait" (each exchange
waited for whole, the previous behaviour) and "overlap" (parallel.overlap_p2p: sends in the background,
receives posted one exchange early); the step time is the wall clock of forward_backward on the slowest
rank, median over the timed steps.
Targets: the measured idle share (overlap path) within 20 % relative of the formula for pp = 2, 4 at
m = pp and m = 4 pp; interleaved (v = 2) lower than 1f1b at the same m; and the total step time of the
overlap path below the waiting path's.

Usage: python bench/bench_pipeline.py [--tf 0.1] [--tb 0.2] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.nn as nn

SHAPE = (16, 2, 32)  # [s, micro_batch, h] of every message (--hidden changes h)


class SleepPass(torch.autograd.Function):
    """A stage's paced passes: forward sleeps t_f, backward (the input grad) t_b (bench/bench_pipeline_bubble.py
    uses it too)."""

    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.t_b = t_b
        time.sleep(t_f)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_b)
        return g * 1.0, None, None


class SleepStage(nn.Module):
    """One virtual stage of uniform cost; the first takes [b, s] ids, the last returns a scalar loss."""

    def __init__(self, t_f: float, t_b: float, first: bool, last: bool, shape):
        super().__init__()
        self.t_f, self.t_b, self.first, self.last, self.shape = t_f, t_b, first, last, tuple(shape)
        self.weight = nn.Parameter(torch.ones(self.shape[-1]))

    def forward(self, x, targets=None):
        if self.first:
            x = torch.zeros(self.shape) + x.float().mean()
        y = SleepPass.apply(x * self.weight, self.t_f, self.t_b)
        return y.mean() if self.last else y


def _worker(p: int, cases, t_f: float, t_b: float, steps: int, shape):
    from training.parallel.mesh import ProcessMesh
    from training.schedules.pipeline import PipelineSchedule

    mesh = ProcessMesh.from_env(1, p, 1, 1, backend="gloo", timeout_s=120)
    out = []
    for kind, v, m in cases:
        chunks = [
            SleepStage(
                t_f / v,
                t_b / v,
                first=c == 0 and mesh.pp_rank == 0,
                last=c == v - 1 and mesh.pp_rank == p - 1,
                shape=shape,
            )
            for c in range(v)
        ]
        scheds = {
            overlap: PipelineSchedule(
                chunks,
                kind,
                p,
                mesh.pp_rank,
                mesh.group_ranks["pp"],
                mesh.pp_group,
                shape,
                torch.float32,
                mesh.device,
                lambda loss, n: loss / n,
                measure_memory=False,
                overlap_p2p=overlap,
            )
            for overlap in (False, True)
        }
        micro = [(torch.zeros(shape[1], shape[0], dtype=torch.long), None) for _ in range(m)]
        shares, walls = {False: [], True: []}, {False: [], True: []}
        for step in range(steps + 1):
            for overlap in (False, True) if step % 2 == 0 else (True, False):
                torch.distributed.barrier(group=mesh.pp_group)
                t0 = time.perf_counter()
                scheds[overlap].forward_backward(micro)
                wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                torch.distributed.all_reduce(wall, group=mesh.pp_group, op=torch.distributed.ReduceOp.MAX)
                if step > 0:  # the first step warms up gloo's connections
                    shares[overlap].append(scheds[overlap].stats.idle_share_mean)
                    walls[overlap].append(float(wall.item()))
        out.append(
            (
                kind,
                v,
                m,
                statistics.median(shares[True]),
                statistics.median(walls[False]),
                statistics.median(walls[True]),
                statistics.median(shares[False]),
            )
        )
    mesh.destroy()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf", type=float, default=0.1, help="forward seconds per micro-batch per rank")
    ap.add_argument("--tb", type=float, default=0.2, help="backward seconds per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    ap.add_argument("--hidden", type=int, default=SHAPE[2], help="h of the [s, b, h] fp32 messages")
    args = ap.parse_args(argv)
    shape = (SHAPE[0], SHAPE[1], args.hidden)
    from training.run.local_ranks import run_ranks
    from training.schedules.pipeline import planned_idle_share

    rows, ok = [], True
    for p in (2, 4):
        cases = [(kind, v, m) for m in (p, 4 * p) for kind, v in (("1f1b", 1), ("interleaved_1f1b", 2))]
        res = run_ranks(_worker, p, args=(p, cases, args.tf, args.tb, args.steps, shape), timeout_s=600)[0]
        by_m = {}
        for kind, v, m, measured, wall_wait, wall_overlap, measured_wait in res:
            planned = planned_idle_share(p, m, v)
            rel = abs(measured - planned) / planned
            within = rel <= 0.2
            by_m.setdefault(m, {})[kind] = measured
            rows.append((p, m, kind, v, planned, measured, rel, within, measured_wait, wall_wait, wall_overlap))
            ok &= within
        for d in by_m.values():
            ok &= d["interleaved_1f1b"] < d["1f1b"]
    print(
        f"pipeline bubble: uniform stages (forward {args.tf * 1e3:.0f} ms + backward {args.tb * 1e3:.0f} ms "
        f"per micro-batch per rank, messages {shape} fp32 = {4 * shape[0] * shape[1] * shape[2] / 2**10:.0f} KiB), idle share of wall clock, mean over stages, median of {args.steps} steps"
    )
    print(
        f"{'pp':>3} {'m':>3} {'schedule':<17} {'v':>2} {'planned':>8} {'measured':>9} {'rel err':>8}  within 20%"
        f"  {'idle (wait)':>11} {'step wait s':>11} {'overlap s':>9} {'ratio':>6}"
    )
    for p, m, kind, v, planned, measured, rel, within, measured_wait, wall_wait, wall_overlap in rows:
        print(
            f"{p:>3} {m:>3} {kind:<17} {v:>2} {planned:>8.3f} {measured:>9.3f} {100 * rel:>7.1f}%  "
            f"{'yes' if within else 'NO':<10}  {measured_wait:>11.3f} {wall_wait:>11.3f} {wall_overlap:>9.3f} "
            f"{wall_overlap / wall_wait:>6.3f}"
        )
    total_wait, total_overlap = sum(r[9] for r in rows), sum(r[10] for r in rows)
    falls = total_overlap < total_wait
    ok &= falls
    print(
        f"total step time of all cases: waiting exchanges {total_wait:.3f} s, overlapped {total_overlap:.3f} s, "
        f"ratio {total_overlap / total_wait:.3f} (target < 1): {'yes' if falls else 'NO'}"
    )
    inter = all(
        r[5] < next(q[5] for q in rows if q[:2] == r[:2] and q[2] == "1f1b") for r in rows if r[2] == "interleaved_1f1b"
    )
    print(f"interleaved lower than 1f1b at every (pp, m): {'yes' if inter else 'NO'}")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
