"""DistributedOptimizer: ZeRO-1 == ZeRO-0 == torch AdamW, fp16 loss scaling, grad norm counting."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.dist import run_distributed

from training.contract.config import Config
from training.optim import DistributedOptimizer
from training.parallel.mesh import ProcessMesh

STEPS = 3


def _cfg(zero=0, precision="fp32", clip=0.05, dp=1) -> Config:
    cfg = Config()
    cfg.parallel.zero, cfg.parallel.dp = zero, dp
    # A tiny bucket so the bucketed reduce-scatter / all-gather loops run several buckets.
    cfg.parallel.bucket_mb = 64 / 2**20
    cfg.train.precision, cfg.train.grad_clip, cfg.train.weight_decay = precision, clip, 0.1
    cfg.train.loss_scale_window = 2
    return cfg


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # 3 x 5 + 5 ... an odd parameter count so the ZeRO padding is exercised.
    return torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Tanh(), torch.nn.Linear(13, 3)
    ).to(dtype)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)


def _reference(lrs, clip):
    """Single process, full batch, torch.optim.AdamW with no decay on 1-D params, clip_grad_norm_."""
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    nodecay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
        lr=1.0,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    norms = []
    for step, lr in enumerate(lrs):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


def _engine(zero, dp, dp_rank, mesh, lrs, clip, micro=2):
    model = _model()
    opt = DistributedOptimizer(model.named_parameters(), _cfg(zero, clip=clip, dp=dp), mesh)
    norms = []
    for step, lr in enumerate(lrs):
        x, y = _batch(step)
        per = 8 // dp
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        opt.zero_grad()
        for k in range(micro):  # gradient accumulation over micro-batches
            sl = slice(k * per // micro, (k + 1) * per // micro)
            opt.scale_loss(torch.nn.functional.mse_loss(model(x[sl]), y[sl]), micro).backward()
        res = opt.step(lr)
        assert not res.skipped
        norms.append(res.grad_norm)
    return [p.detach().clone() for p in model.parameters()], norms, opt


LRS = [1e-2, 3e-2, 2e-2]


def _dp_case(mesh, zero):
    """dp=2 at this zero stage: weights, grad norms and memory report of this rank (numpy for the result queue)."""
    got, norms, opt = _engine(zero, mesh.dp, mesh.dp_rank, mesh, LRS, clip=0.05)
    return {"weights": [p.numpy() for p in got], "norms": norms, "memory": opt.memory_report()}


def _two_ranks():
    """Every 2-rank case in one spawn: dp=2 at zero 0 and 1, then the grad-norm layouts tp2 and pp2 (each mesh's
    groups built beside the previous one's on the same default group)."""
    out = {}
    for zero in (0, 1):
        mesh = ProcessMesh.from_env(tp=1, pp=1, cp=1, dp=2, backend="gloo", timeout_s=60)
        out[f"dp2_zero{zero}"] = _dp_case(mesh, zero)
    for layout in ("tp2", "pp2"):
        mesh = _norm_case(layout, out)
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_ranks, 2, timeout_s=240)


def test_single_process_matches_torch_adamw():
    ref, ref_norms = _reference(LRS, clip=0.05)
    got, norms, _ = _engine(0, 1, 0, ProcessMesh.single(), LRS, clip=0.05)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8), (a - b).abs().max()


@pytest.mark.parametrize("zero", [0, 1])
def test_dp2_matches_single_process_reference(two_ranks, zero):
    world = 2
    ref, ref_norms = _reference(LRS, clip=0.05)
    assert any(n > 0.05 for n in ref_norms), "clipping must be active in this test"
    n = sum(p.numel() for p in _model().parameters())
    shard = -(-n // world) if zero == 1 else n
    for rank in range(world):
        res = two_ranks[rank][f"dp2_zero{zero}"]
        for a, b in zip(res["weights"], ref):
            a = torch.from_numpy(a)
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (rank, (a - b).abs().max())
        for a, b in zip(res["norms"], ref_norms):
            assert math.isclose(a, b, rel_tol=1e-5), (rank, a, b)
        assert res["memory"] == {
            "weights": 4 * n,
            "grads": 4 * (shard * world if zero == 1 else n),
            "optimizer": 8 * shard,
        }, rank


def test_fp16_overflow_skips_step_halves_scale_and_training_continues():
    model = _model(torch.float16)
    cfg = _cfg(0, "fp16", clip=1.0)
    opt = DistributedOptimizer(model.named_parameters(), cfg, ProcessMesh.single())
    assert opt.memory_report()["optimizer"] == 12 * opt.numel  # fp32 master, m, v

    def one_step(inject=False):
        x, y = _batch(0)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        opt.scale_loss(loss, 1).backward()
        if inject:
            opt.grads.buffer[3] = float("inf")
        return opt.step(1e-2)

    before = [p.detach().clone() for p in model.parameters()]
    r = one_step(inject=True)
    assert r.skipped and r.reason == "nonfinite_grad" and r.loss_scale == 32768.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    r = one_step()
    assert not r.skipped and math.isfinite(r.grad_norm)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    r = one_step()  # second clean step: the window (2) is full, the scale doubles
    assert r.loss_scale == 65536.0


def test_nonfinite_loss_skips_step():
    model = _model()
    opt = DistributedOptimizer(model.named_parameters(), _cfg(), ProcessMesh.single())
    before = [p.detach().clone() for p in model.parameters()]
    r = opt.step(1e-2, loss_finite=False)
    assert r.skipped and r.reason == "nonfinite_loss"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _norm_case(layout, out):
    """Full tensors W (6x4, split over tp on dim 0), b (4, replicated), E (tied embedding on both stages)."""
    g = torch.Generator().manual_seed(5)
    gW, gb, gE, gE2 = (
        torch.randn(6, 4, generator=g),
        torch.randn(4, generator=g),
        torch.randn(5, 4, generator=g),
        torch.randn(5, 4, generator=g),
    )
    if layout == "tp2":
        mesh = ProcessMesh.from_env(tp=2, pp=1, cp=1, dp=1, backend="gloo", timeout_s=60)
        rank = mesh.tp_rank
        W = torch.nn.Parameter(torch.zeros(3, 4))
        W.tp_shard_dim = 0
        b = torch.nn.Parameter(torch.zeros(4))
        b.tp_shard_dim = None
        params = [("layers.0.w", W), ("layers.0.b", b)]
        grads = [gW[3 * rank : 3 * rank + 3], gb]
        expect = torch.cat([gW.flatten(), gb]).norm()
    else:  # pp2 with a tied embedding held by the first and the last stage
        mesh = ProcessMesh.from_env(tp=1, pp=2, cp=1, dp=1, backend="gloo", timeout_s=60)
        rank = mesh.pp_rank
        E = torch.nn.Parameter(torch.zeros(5, 4))
        E.tp_shard_dim = 0
        b = torch.nn.Parameter(torch.zeros(4))
        b.tp_shard_dim = None
        params = [("embedding.word.weight", E), (f"layers.{rank}.b", b)]
        grads = [gE if rank == 0 else gE2, gb * (rank + 1)]
        expect = torch.cat([(gE + gE2).flatten(), gb, 2 * gb]).norm()
    cfg = _cfg(clip=0.0)
    cfg.parallel.tp, cfg.parallel.pp = mesh.tp, mesh.pp
    opt = DistributedOptimizer(params, cfg, mesh)
    for view, grad in zip(opt.grads.views, grads):
        view.copy_(grad)
    out[f"norm_{layout}"] = (opt.step(0.0).grad_norm, float(expect))
    return mesh


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_grad_norm_counts_every_param_once(two_ranks, layout):
    for rank, res in enumerate(two_ranks):
        got, expect = res[f"norm_{layout}"]
        assert math.isclose(got, expect, rel_tol=1e-6), (rank, got, expect)
