"""Pipeline bubble of 1f1b, interleaved_1f1b and zb_h1 side by side at pp = 4 (CPU + gloo processes).

Stage work is paced, independent of how busy the machine's cores are: every virtual stage sleeps t_f / v in
forward, t_b / v in its input-grad pass and t_w / v in its weight-grad pass (two custom autograd Functions: one
on the activation's path, one on the weight's, joined by an add), so 1f1b and interleaved run t_b + t_w in their
backward and zb_h1 runs B and W apart (training/schedules/pipeline.py's split backward finds the add as the
weight's start node). Real [s, b, h] activations and grads move between the ranks over gloo in the schedules'
batch_isend_irecv exchanges.
Measured: per rank, idle share = 1 - busy / wall of the step (busy = compute only), averaged over the pipeline
ranks, median over the timed steps; the three schedules run in turn step by step (the order rotated), after
one warm-up step each. Planned: training/schedules/pipeline.py planned_idle_share with the same pass times
(launcher/plan's bubble for equal passes).
Target: zb_h1's measured idle share below 1f1b's at every m.

Usage: python bench/bench_pipeline_bubble.py [--tf 0.04] [--tb 0.04] [--tw 0.04] [--steps 3]
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
from bench_pipeline import SleepPass  # the activation's path: forward t_f, input grad t_b

SHAPE = (16, 2, 32)  # [s, micro_batch, h] of every message
P = 4
KINDS = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))


class _SleepWeight(torch.autograd.Function):
    """The weight's path: backward (the weight grad) sleeps t_w."""

    @staticmethod
    def forward(ctx, w, t_w):
        ctx.t_w = t_w
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_w)
        return g * 1.0, None


class SleepStage(nn.Module):
    """One virtual stage of paced cost; the first takes [b, s] ids, the last returns a scalar loss."""

    def __init__(self, t_f: float, t_b: float, t_w: float, first: bool, last: bool):
        super().__init__()
        self.t_f, self.t_b, self.t_w, self.first, self.last = t_f, t_b, t_w, first, last
        self.weight = nn.Parameter(torch.zeros(SHAPE[-1]))

    def forward(self, x, targets=None):
        if self.first:
            x = torch.zeros(SHAPE) + x.float().mean()
        y = SleepPass.apply(x, self.t_f, self.t_b) + _SleepWeight.apply(self.weight, self.t_w)
        return y.mean() if self.last else y


def _worker(ms, t_f: float, t_b: float, t_w: float, steps: int):
    from training.parallel.mesh import ProcessMesh
    from training.schedules.pipeline import PipelineSchedule

    mesh = ProcessMesh.from_env(1, P, 1, 1, backend="gloo", timeout_s=120)
    out = []
    for m in ms:
        scheds = {}
        for kind, v in KINDS:
            chunks = [
                SleepStage(
                    t_f / v,
                    t_b / v,
                    t_w / v,
                    first=c == 0 and mesh.pp_rank == 0,
                    last=c == v - 1 and mesh.pp_rank == P - 1,
                )
                for c in range(v)
            ]
            scheds[kind] = PipelineSchedule(
                chunks,
                kind,
                P,
                mesh.pp_rank,
                mesh.group_ranks["pp"],
                mesh.pp_group,
                SHAPE,
                torch.float32,
                mesh.device,
                lambda loss, n: loss / n,
                measure_memory=False,
                overlap_p2p=True,
            )
        micro = [(torch.zeros(SHAPE[1], SHAPE[0], dtype=torch.long), None) for _ in range(m)]
        shares = {kind: [] for kind, _ in KINDS}
        walls = {kind: [] for kind, _ in KINDS}
        names = [kind for kind, _ in KINDS]
        for step in range(steps + 1):
            for kind in names[step % 3 :] + names[: step % 3]:  # rotated: no schedule always first
                torch.distributed.barrier(group=mesh.pp_group)
                scheds[kind].forward_backward(micro)
                if step > 0:  # the first step of each warms up gloo's connections
                    shares[kind].append(scheds[kind].stats.idle_share_mean)
                    walls[kind].append(scheds[kind].stats.wall_s)
        out.append((m, {k: (statistics.median(shares[k]), statistics.median(walls[k])) for k in names}))
    mesh.destroy()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf", type=float, default=0.04, help="forward seconds per micro-batch per rank")
    ap.add_argument("--tb", type=float, default=0.04, help="input-grad seconds per micro-batch per rank")
    ap.add_argument("--tw", type=float, default=0.04, help="weight-grad seconds per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per schedule (after one warm-up)")
    args = ap.parse_args(argv)
    from training.run.local_ranks import run_ranks
    from training.schedules.pipeline import planned_idle_share

    ms = (P, 2 * P)
    res = run_ranks(_worker, P, args=(ms, args.tf, args.tb, args.tw, args.steps), timeout_s=600)[0]
    print(
        f"pipeline bubble at pp={P}: paced stages (forward {args.tf * 1e3:.0f} ms, input grad {args.tb * 1e3:.0f} ms, "
        f"weight grad {args.tw * 1e3:.0f} ms per micro-batch per rank; messages {SHAPE} fp32), idle share of wall "
        f"clock, mean over stages, median of {args.steps} steps, schedules alternated"
    )
    print(f"{'m':>3} {'schedule':<17} {'v':>2} {'planned':>8} {'measured':>9} {'step s':>7} {'vs 1f1b':>8}")
    ok = True
    for m, by_kind in res:
        base = by_kind["1f1b"][0]
        for kind, v in KINDS:
            measured, wall = by_kind[kind]
            planned = planned_idle_share(P, m, v, kind, 0, args.tf, args.tb, args.tw)
            print(f"{m:>3} {kind:<17} {v:>2} {planned:>8.3f} {measured:>9.3f} {wall:>7.3f} {measured / base:>8.3f}")
        below = by_kind["zb_h1"][0] < base
        ok &= below
        print(f"    zb_h1 below 1f1b at m={m}: {'yes' if below else 'NO'}")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
