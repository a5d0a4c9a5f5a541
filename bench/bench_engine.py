"""Engine benchmarks, measured side by side in one run (CPU + gloo, or one GPU with --gpu):

1. engine at tp=1 vs a plain single-process PyTorch GPT of the same shape (target >= 0.95 of its tokens/s);
2. hand-written TP vs PyTorch DTensor TP on the same model at tp=2 (2 gloo processes; target: faster);
3. MFU of the engine against this machine's measured matmul rate.
Usage: python bench/bench_engine.py [--steps N] [--gpu]   (--gpu: tp=1 bf16 GPT ~1.3B on one GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.config import Config, config_from_dict, config_to_dict


def bench_cfg(gpu: bool, steps: int) -> Config:
    cfg = Config()
    m = cfg.model
    if gpu:
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 24, 2048, 16, 2048, 50304
        cfg.parallel.micro_batch, cfg.parallel.global_batch = 4, 4
        cfg.train.precision, cfg.cluster.device = "bf16", "cuda"
    else:
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 256, 8, 128
        cfg.parallel.micro_batch, cfg.parallel.global_batch = 8, 8
    cfg.data.kind, cfg.train.steps, cfg.train.progress = "synthetic", steps, False
    return cfg


class PlainBlock(nn.Module):
    def __init__(self, h, a):
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (t(y).view(b, s, -1, y.shape[-1] // self.a).transpose(1, 2) for t in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    """nanoGPT-style reference: same shape as the engine's GPT (learned positions, tied embeddings)."""

    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.wte, self.wpe = nn.Embedding(m.vocab_size, m.hidden_size), nn.Embedding(m.seq_length, m.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(m.hidden_size, m.num_attention_heads) for _ in range(m.num_layers))
        self.ln = nn.LayerNorm(m.hidden_size)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def time_plain(cfg: Config, model: nn.Module, device, dtype=None, foreach=None, clip=True) -> float:
    """tokens/s of fwd+bwd+AdamW (clip 1.0) over train.steps steps after 2 warm-up steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=foreach)
    b, s, V = cfg.parallel.global_batch, cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, V, (b, s + 1), generator=g).to(device)
    times = []
    for i in range(cfg.train.steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return b * s / (sum(times) / len(times))


def time_engine(cfg: Config, mesh=None):
    from training.loop import Trainer
    from training.mesh import ProcessMesh

    mesh = mesh or ProcessMesh.single("cuda" if cfg.cluster.device == "cuda" else "cpu")
    trainer = Trainer(cfg, tempfile.mkdtemp(), mesh, checkpointing=False)
    trainer.run()
    return trainer.summary.tokens_per_s, trainer.summary.mfu


def _tp_worker(cfg_dict):
    """On 2 ranks: engine tp=2 (hand-written TP+SP) tokens/s and DTensor TP of the plain GPT tokens/s."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from training.mesh import ProcessMesh

    cfg = config_from_dict(cfg_dict)
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp = 2, 1, True
    mesh = ProcessMesh.from_env(2, 1, 1, 1)
    engine, _ = time_engine(cfg, mesh)
    torch.manual_seed(0)
    model = PlainGPT(cfg)
    dmesh = init_device_mesh("cpu", (2,))
    for blk in model.blocks:
        blk.a //= 2  # local heads after the column split
        parallelize_module(blk, dmesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                        "proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()})
    # foreach kernels and clip_grad_norm_ cannot mix DTensor and plain params (docs/PLATFORM.md):
    # per-tensor AdamW and no clipping, which only favours DTensor.
    dtensor = time_plain(cfg, model, torch.device("cpu"), foreach=False, clip=False)
    mesh.destroy()
    return engine, dtensor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    cfg = bench_cfg(args.gpu, args.steps)
    device = torch.device("cuda" if args.gpu else "cpu")
    dtype = torch.bfloat16 if args.gpu else None
    torch.manual_seed(0)
    plain = time_plain(cfg, PlainGPT(cfg).to(device), device, dtype)
    engine, mfu = time_engine(cfg)
    m = cfg.model
    print(f"model: L={m.num_layers} h={m.hidden_size} a={m.num_attention_heads} s={m.seq_length} "
          f"V={m.vocab_size} batch={cfg.parallel.global_batch} {cfg.train.precision} on {device}")
    print(f"engine tp=1: {engine:,.0f} tok/s   plain PyTorch GPT: {plain:,.0f} tok/s   ratio {engine / plain:.3f} "
          f"(target >= 0.95)")
    print(f"engine MFU vs measured matmul peak: {100 * (mfu or 0):.1f}%")
    if not args.gpu:
        from dist_harness import run_distributed

        cfg.train.steps = max(4, args.steps // 2)
        (tp_engine, tp_dtensor), _ = run_distributed(_tp_worker, 2, args=(config_to_dict(cfg),), timeout_s=600)
        print(f"tp=2: hand-written TP+SP {tp_engine:,.0f} tok/s   DTensor TP {tp_dtensor:,.0f} tok/s   "
              f"ratio {tp_engine / tp_dtensor:.3f} (target > 1)")


if __name__ == "__main__":
    main()
