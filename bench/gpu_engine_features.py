"""Single-GPU checks of engine features one device can show: zero=3 and offload memory during training steps
against plan.json's figures, and the context-parallel ring kernels' numerics against plain attention.

One rank (world size 1: NCCL on a GPU, gloo with --dry on CPU):
  1. zero3: the real Trainer at parallel.zero=3 runs 2 steps; the most parameter bytes its hooks held gathered
     at once (Zero3Params.peak_gathered_bytes) is > 0 and <= the plan's zero3_gathered; on the GPU also the
     allocator's peak during the second step is <= the plan's total per-rank bytes x PEAK_MARGIN.
  2. offload_cpu: zero=2 with parallel.offload=cpu runs 2 steps; the optimizer's memory_report (host_offload
     included) equals the plan's bytes after them; on the GPU the device holds no optimizer state: the bytes
     allocated after the steps minus weights and grads are <= OFFLOAD_SLACK.
  3. cp_ring_numerics: the ring schedule of training/parallel/context.py (ring_blocks, its block kernels and
     the online-softmax merge, forward and backward) for cp = 2 and 4 simulated on this one device (every cp
     rank's blocks computed here, no exchange) against causal attention in float64 on the whole sequence:
     output, dq, dk and dv, max abs error relative to the reference's largest value <= CP_TOLERANCE, in fp32
     (GPU: the math path; --dry: torch's fused CPU kernel) and, as cp_ring_numerics_bf16, in bf16 (GPU: the
     CUDA flash kernel per block, what a bf16 run takes; --dry: the CPU kernel) within CP_TOLERANCE_BF16.
Prints one JSON object (the last line); exit 0 when every check passed, 1 otherwise.
Usage: python bench/gpu_engine_features.py [--dry] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PEAK_MARGIN = 1.10
"""The allocator's peak may exceed the plan's per-rank total by the planner's activation tolerance (10 %)."""
OFFLOAD_SLACK = 64 * 2**20
"""Device bytes beyond weights and grads allowed under offload=cpu: block buffers of the update and rounding."""
CP_TOLERANCE = 1e-4
"""Max abs error / max |reference| of the ring's fp32 result against the float64 whole-sequence attention."""
CP_TOLERANCE_BF16 = 3e-2
"""The same for bf16 inputs (8 mantissa bits: rounding of q, k, v, dout and of each block's output)."""


def _cfg(dry: bool, **lever):
    from training.contract.config import Config

    cfg = Config()
    m = cfg.model
    if dry:
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 64, 4, 32
    else:
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 8, 1024, 16, 512
    cfg.cluster.device = "cpu" if dry else "cuda"
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    cfg.train.precision = "fp32" if dry else "bf16"
    cfg.train.progress, cfg.data.kind = False, "synthetic"
    p = cfg.parallel
    p.micro_batch, p.global_batch, p.dp = 1, 2, 1
    for k, v in lever.items():
        setattr(p, k, v)
    return cfg


def memory_checks(dry: bool, out: str, mesh) -> dict[str, dict]:
    import torch

    from launcher.plan.estimate import make_plan
    from training.run.loop import Trainer

    cuda = not dry
    checks: dict[str, dict] = {}
    cfg = _cfg(dry, zero=3)
    plan = make_plan(cfg).memory_bytes
    trainer = Trainer(cfg, os.path.join(out, "zero3"), mesh, checkpointing=False)
    trainer.train_step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train_step()
    gathered = trainer.optimizer.zero3.peak_gathered_bytes
    found = {"peak_gathered_bytes": gathered, "plan_zero3_gathered": plan["zero3_gathered"]}
    ok = 0 < gathered <= plan["zero3_gathered"]
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        found.update(allocator_peak=peak, plan_total=plan["total"], margin=PEAK_MARGIN)
        ok = ok and peak <= plan["total"] * PEAK_MARGIN
    checks["zero3"] = {"ok": ok, **found}
    del trainer
    if cuda:
        torch.cuda.empty_cache()

    cfg = _cfg(dry, zero=2, offload="cpu", offload_dir=os.path.join(out, "nvme"))
    plan = make_plan(cfg).memory_bytes
    trainer = Trainer(cfg, os.path.join(out, "offload"), mesh, checkpointing=False)
    for _ in range(2):
        trainer.train_step()
    report = trainer.optimizer.memory_report()
    keys = [k for k in ("weights", "grads", "optimizer", "host_offload", "nvme_offload") if k in report]
    want = {k: plan[k] for k in keys}
    found = {"measured": report, "plan": want}
    ok = report == want and report.get("host_offload", 0) > 0
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.memory_allocated() - report["weights"] - report["grads"]
        found.update(device_beyond_weights_grads=extra, slack=OFFLOAD_SLACK)
        ok = ok and extra <= OFFLOAD_SLACK
    checks["offload_cpu"] = {"ok": ok, **found}
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return checks


def ring_simulated(q, k, v, dout, cp: int):
    """(out, dq, dk, dv) of causal attention over the whole sequence computed as cp ranks of the ring would,
    every rank's blocks on this device. q [b, g, r, s, d], k v [b, g, 1, s, d] (fp32, or 16-bit: the blocks run in
    that dtype, as training/parallel/context.py's block_dtype picks for a 16-bit run); dout like q. Results fp32."""
    import torch

    from training.parallel.context import _block_backward, _block_forward, _merge, _part, chunk_ids, ring_blocks

    s, d = q.shape[-2], q.shape[-1]
    c = s // (2 * cp)
    scale = 1.0 / math.sqrt(d)

    def local(x, rank):  # this rank's two chunks, in order
        i, j = chunk_ids(cp, rank)
        return torch.cat([x[..., i * c : (i + 1) * c, :], x[..., j * c : (j + 1) * c, :]], dim=-2)

    def place(dst, x, rank):
        i, j = chunk_ids(cp, rank)
        dst[..., i * c : (i + 1) * c, :] += x[..., :c, :]
        dst[..., j * c : (j + 1) * c, :] += x[..., c:, :]

    out_full, dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, q, k, v))
    for me in range(cp):
        qf, dof = local(q, me), local(dout, me)
        acc = {"a": None, "b": None}
        for step in range(cp):
            src = (me - step) % cp
            kk, vv = local(k, src), local(v, src)
            for qp, kp, causal in ring_blocks(step, src, me):
                o, lse = _block_forward(_part(qf, qp, c), _part(kk, kp, c), _part(vv, kp, c), scale, causal)
                if qp == "ab":
                    acc["a"] = _merge(acc["a"], o[..., :c, :], lse[..., :c])
                    acc["b"] = _merge(acc["b"], o[..., c:, :], lse[..., c:])
                else:
                    acc[qp] = _merge(acc[qp], o, lse)
        out = torch.cat([acc["a"][0], acc["b"][0]], dim=-2)
        lse = torch.cat([acc["a"][1], acc["b"][1]], dim=-1)
        place(out_full, out, me)
        out = out.to(q.dtype)  # saved in the run's dtype, as RingAttention saves it
        g_q = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            src = (me - step) % cp
            kk, vv = local(k, src), local(v, src)
            g_k, g_v = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (kk, vv))
            for qp, kp, causal in ring_blocks(step, src, me):
                rows = slice(None) if qp == "ab" else (slice(0, c) if qp == "a" else slice(c, 2 * c))
                cols = slice(None) if kp == "ab" else (slice(0, c) if kp == "a" else slice(c, 2 * c))
                a, b_, e = _block_backward(
                    qf[..., rows, :],
                    kk[..., cols, :],
                    vv[..., cols, :],
                    out[..., rows, :],
                    dof[..., rows, :],
                    lse[..., rows],
                    scale,
                    causal,
                )
                g_q[..., rows, :] += a
                g_k[..., cols, :] += b_
                g_v[..., cols, :] += e
            place(dk, g_k, src)
            place(dv, g_v, src)
        place(dq, g_q, me)
    return out_full, dq, dk, dv


def reference(q, k, v, dout):
    """Causal attention on the whole sequence in float64 with autograd: (out, dq, dk, dv)."""
    import torch

    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s, d = q.shape[-2], q.shape[-1]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)  # k broadcasts over the r query heads
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    out = torch.matmul(probs, v)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def cp_checks(dry: bool) -> dict[str, dict]:
    import torch

    device = "cpu" if dry else "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    b, groups, r, d, s = (1, 2, 2, 32, 128) if dry else (2, 4, 4, 64, 2048)
    q = torch.randn(b, groups, r, s, d, device=device, generator=g)
    k, v = (torch.randn(b, groups, 1, s, d, device=device, generator=g) for _ in range(2))
    dout = torch.randn(b, groups, r, s, d, device=device, generator=g)
    want = reference(q, k, v, dout)
    from training.parallel.context import _kernel

    out = {}
    for name, dtype, tolerance in (
        ("cp_ring_numerics", torch.float32, CP_TOLERANCE),
        ("cp_ring_numerics_bf16", torch.bfloat16, CP_TOLERANCE_BF16),
    ):
        found = {}
        ok = True
        inputs = [t.to(dtype) for t in (q, k, v, dout)]
        kernel = _kernel(inputs[0])
        for cp in (2, 4):
            got = ring_simulated(*inputs, cp)
            errs = {
                part: float((a.double() - w).abs().max() / w.abs().max())
                for part, a, w in zip(("out", "dq", "dk", "dv"), got, want)
            }
            found[f"cp{cp}"] = errs
            ok = ok and all(e <= tolerance for e in errs.values())
        out[name] = {
            "ok": ok,
            "tolerance": tolerance,
            "seq": s,
            "kernel": kernel.name if kernel is not None else "math",
            "relative_max_errors": found,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="CPU (gloo): the same checks without allocator figures")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="engine_features-"))
    args = ap.parse_args()
    from training.parallel.mesh import ProcessMesh

    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29533"),
        }
    )
    mesh = ProcessMesh.from_env(1, 1, 1, 1, backend="gloo" if args.dry else "nccl")
    checks = memory_checks(args.dry, args.out, mesh)
    checks.update(cp_checks(args.dry))
    mesh.destroy()
    summary = {"mode": "dry" if args.dry else "gpu", "ok": all(c["ok"] for c in checks.values()), "checks": checks}
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
