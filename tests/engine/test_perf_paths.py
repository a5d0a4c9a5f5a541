"""The engine's fast paths keep its results: overlapped dp reduction, direct grads, fused AdamW, qkv split.

- dp=2 with parallel.overlap_grad_reduce on and off: bit-identical parameters (zero=0 and zero=1), and with
  it on, buckets really start during backward;
- dp=1: autograd accumulates straight into the flat main-grad buffer (no hooks), the grads equal autograd's;
- train.fused_adamw: within the tolerance docs/PERFORMANCE.md states of the bit-exact update; unset, fused on
  cuda and the bit-exact update on cpu;
- the qkv split (one split, not three slices): values and gradients equal those picked out by hand.
"""

from __future__ import annotations

import torch
from helpers.dist import run_distributed

from training.contract.config import Config
from training.optim import DistributedOptimizer
from training.parallel.mesh import ProcessMesh


def _cfg(zero=0, dp=1, overlap=True, fused=False) -> Config:
    cfg = Config()
    cfg.parallel.zero, cfg.parallel.dp, cfg.parallel.overlap_grad_reduce = zero, dp, overlap
    cfg.parallel.bucket_mb = 64 / 2**20  # 16 fp32 elements: many buckets
    cfg.train.grad_clip, cfg.train.weight_decay, cfg.train.fused_adamw = 0.05, 0.1, fused
    return cfg


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)


def _train(cfg: Config, mesh, dp_rank=0, steps=3, micro=2):
    model = _model()
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    per = 8 // cfg.parallel.dp
    for step in range(steps):
        x, y = _batch(step)
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        opt.zero_grad(micro)  # the loop's call: announces the micro-batches, so buckets may start early
        for k in range(micro):
            sl = slice(k * per // micro, (k + 1) * per // micro)
            opt.scale_loss(torch.nn.functional.mse_loss(model(x[sl]), y[sl]), micro).backward()
        assert not opt.step(1e-2).skipped
    return [p.detach().clone() for p in model.parameters()], opt


def _overlap_worker():
    mesh = ProcessMesh.from_env(tp=1, pp=1, cp=1, dp=2, backend="gloo", timeout_s=60)
    out = {}
    for zero in (0, 1):
        off, _ = _train(_cfg(zero, 2, overlap=False), mesh, mesh.dp_rank)
        on, opt = _train(_cfg(zero, 2, overlap=True), mesh, mesh.dp_rank)
        out[zero] = {
            "equal": all(torch.equal(a, b) for a, b in zip(on, off)),
            "early": opt.grads.launched_in_backward,
            "params": [p.numpy() for p in on],
        }
    mesh.destroy()
    return out


def test_dp_overlap_is_bit_identical_and_starts_buckets_during_backward():
    results = run_distributed(_overlap_worker, 2, timeout_s=180)
    for zero in (0, 1):
        for res in results:
            assert res[zero]["equal"], f"zero={zero}: overlap changed the parameters"
            assert res[zero]["early"] > 0, f"zero={zero}: no bucket started before backward ended"
        for a, b in zip(results[0][zero]["params"], results[1][zero]["params"]):
            assert (a == b).all(), "the dp replicas diverged"


def test_direct_grads_fill_the_flat_buffer_without_hooks():
    model = _model()
    ref = _model()
    opt = DistributedOptimizer(model.named_parameters(), _cfg(), ProcessMesh.single())
    assert not opt.grads._hooks, "fp32 at dp=1 needs no grad hook"
    x, y = _batch(0)
    opt.zero_grad(1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for p, view, q in zip(opt.params, opt.grads.views, ref.parameters()):
        assert p.grad.data_ptr() == view.data_ptr() and torch.equal(view, q.grad)
    # The parameters live in one flat buffer too: the fp32 update is in place.
    buf = opt.layout.param_buffer
    assert all(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in opt.params)


def test_fused_adamw_stays_within_the_documented_tolerance():
    exact, _ = _train(_cfg(), ProcessMesh.single(), steps=5)
    fused, _ = _train(_cfg(fused=True), ProcessMesh.single(), steps=5)
    worst = max(float(((a - b).abs() / b.abs().clamp_min(1e-3)).max()) for a, b in zip(fused, exact))
    assert worst < 1e-5, worst  # docs/PERFORMANCE.md: measured about 1e-7
    assert any(not torch.equal(a, b) for a, b in zip(fused, exact)), "fused must be the other kernel"


def test_fused_adamw_unset_is_fused_on_cuda_and_unfused_on_cpu():
    """train.fused_adamw unset (null) resolves with the device, where precision=auto does: the fused kernel on
    cuda (docs/PERFORMANCE.md), on cpu the unfused update, bit-identical to the explicit false; an explicit
    value is kept on either device. The optimizer resolves an unset value by its mesh's device too."""
    from training.contract.config import config_from_dict, resolve_fused_adamw

    assert Config().train.fused_adamw is False
    assert config_from_dict({"cluster": {"device": "cuda"}}).train.fused_adamw is True
    assert config_from_dict({"cluster": {"device": "cuda"}, "train": {"fused_adamw": False}}).train.fused_adamw is False
    assert config_from_dict({"train": {"fused_adamw": True}}).train.fused_adamw is True
    assert [resolve_fused_adamw(None, d) for d in ("cuda", "cpu", "meta")] == [True, False, False]

    cfg = _cfg()
    cfg.train.fused_adamw = None  # as if set after construction: the optimizer resolves it by its device
    unset, opt = _train(cfg, ProcessMesh.single(), steps=3)
    assert opt.adamw.fused is False
    exact, _ = _train(_cfg(fused=False), ProcessMesh.single(), steps=3)
    assert all(torch.equal(a, b) for a, b in zip(unset, exact)), "CPU's default must stay bit-identical"
    cuda_cfg = config_from_dict({"cluster": {"device": "cuda"}})
    cuda_cfg.cluster.device = "cpu"  # the resolved value is kept: a stand-in CPU mesh runs the CUDA default
    cuda_cfg.parallel, cuda_cfg.train.grad_clip, cuda_cfg.train.weight_decay = cfg.parallel, 0.05, 0.1
    cuda_cfg.train.precision = "fp32"  # cuda resolved precision=auto to bf16; compare like with like
    fused, opt = _train(cuda_cfg, ProcessMesh.single(), steps=3)
    assert opt.adamw.fused is True
    worst = max(float(((a - b).abs() / b.abs().clamp_min(1e-3)).max()) for a, b in zip(fused, exact))
    assert worst < 1e-5, worst  # the tolerance of test_fused_adamw_stays_within_the_documented_tolerance


def _split_by_hand(qkv: torch.Tensor, groups: int, q_per_group: int, d: int, batch_first: bool):
    """q, k, v with explicit indices from the documented layout: per token, groups of (q_per_group query
    heads, one key head, one value head), each d wide; head h is query j = h % q_per_group of group
    h // q_per_group. Out: q [b, heads, s, d], k and v [b, groups, s, d]."""
    if not batch_first:
        qkv = qkv.transpose(0, 1)  # [s, b, ...] -> [b, s, ...]
    width = (q_per_group + 2) * d

    def head(start):
        return qkv[:, :, start : start + d]  # [b, s, d]

    q = torch.stack(
        [head((h // q_per_group) * width + (h % q_per_group) * d) for h in range(groups * q_per_group)], dim=1
    )
    k = torch.stack([head(g * width + q_per_group * d) for g in range(groups)], dim=1)
    v = torch.stack([head(g * width + (q_per_group + 1) * d) for g in range(groups)], dim=1)
    return q, k, v


def test_qkv_split_values_and_gradients_match_the_layout_by_hand():
    """GQA (8 heads in 2 groups): split_qkv's q, k, v and their gradient back to qkv equal the ones
    picked out index by index from the documented layout, in both token orders."""
    from training.model.gpt import Attention

    cfg = Config()
    cfg.model.num_attention_heads, cfg.model.num_query_groups, cfg.model.hidden_size = 8, 2, 64
    for batch_first in (True, False):
        attn = Attention(cfg.model, None, not batch_first, torch.float32, "cpu")
        attn.batch_first = batch_first
        width = attn.local_groups * (attn.q_per_group + 2) * attn.d
        qkv = torch.randn(5, 3, width, requires_grad=True)
        mine = attn.split_qkv(qkv, batch_first)
        by_hand = _split_by_hand(qkv, attn.local_groups, attn.q_per_group, attn.d, batch_first)
        upstream = [torch.randn_like(t) for t in by_hand]
        for a, b in zip(mine, by_hand):
            assert a.shape == b.shape and torch.equal(a, b)
        grad_mine = torch.autograd.grad(mine, qkv, upstream)[0]
        grad_hand = torch.autograd.grad(by_hand, qkv, upstream)[0]
        assert torch.equal(grad_mine, grad_hand)


def _deferred_gather_worker():
    """The GPT trainer at dp=2 zero=1: steps with the updated shards' all-gather deferred into the next
    forward against steps that gather before returning, tied head + fp32 and untied head + bf16 + full
    recomputation (the layers run again in the backward)."""
    import tempfile

    from training.run.loop import Trainer

    mesh = ProcessMesh.from_env(tp=1, pp=1, cp=1, dp=2, backend="gloo", timeout_s=60)
    out = []
    for tie, recompute, precision in ((True, "none", "fp32"), (False, "full", "bf16")):
        runs = {}
        for defer in (False, True):
            cfg = Config()
            m = cfg.model
            m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 3, 32, 4, 16
            m.tie_embeddings = tie
            cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.recompute = 2, 1, recompute
            cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 8  # 2 micro-batches per rank
            cfg.parallel.bucket_mb = 2048 / 2**20  # 512 fp32 elements: many chunks
            cfg.train.precision, cfg.data.kind, cfg.train.progress = precision, "synthetic", False
            cfg.cluster.peak_tflops = 1.0  # a fixed peak: no matmul timing
            trainer = Trainer(cfg, tempfile.mkdtemp(), mesh, checkpointing=False)
            gather = trainer.optimizer.param_gather
            by_forward = []  # chunks the layers' pre-hooks completed before the next step's finish
            finish = gather.finish
            gather.finish = lambda by_forward=by_forward, gather=gather, finish=finish: (
                by_forward.append(gather._completed),
                finish(),
            )[1]
            losses, pending = [], []
            for _ in range(4):
                micro = trainer.sampler.micro_batches(trainer.state.consumed_samples)
                loss, result, _ = trainer.train_step(micro, defer_param_gather=defer)
                assert not result.skipped
                losses.append(loss)
                pending.append(len(gather._pending))
            trainer.optimizer.finish_param_gather()
            runs[defer] = {
                "losses": losses,
                "params": [p.detach().float().clone() for p in trainer.optimizer.params],
                "pending": pending,
                "by_forward": by_forward,
                "chunks": len(gather.starts),
            }
        out.append(
            {
                "losses": runs[True]["losses"] == runs[False]["losses"],
                "params": all(torch.equal(a, b) for a, b in zip(runs[True]["params"], runs[False]["params"])),
                "pending": runs[True]["pending"],
                "blocking_pending": runs[False]["pending"],
                "by_forward": runs[True]["by_forward"],
                "chunks": runs[True]["chunks"],
                "replica": [p.numpy() for p in runs[True]["params"]],
            }
        )
    mesh.destroy()
    return out


def test_zero1_param_gather_deferred_into_the_next_forward_is_bit_identical():
    results = run_distributed(_deferred_gather_worker, 2, timeout_s=300)
    for case in range(2):
        for res in results:
            r = res[case]
            assert r["losses"] and r["params"], f"case {case}: deferring the gather changed the run"
            assert r["chunks"] > 4
            assert all(n == r["chunks"] for n in r["pending"]), r["pending"]  # step returned before any was done
            assert not any(r["blocking_pending"])
            # The next step's forward completed chunks through the layers' pre-hooks before its optimizer step.
            assert any(done > 0 for done in r["by_forward"][1:]), r["by_forward"]
        for a, b in zip(results[0][case]["replica"], results[1][case]["replica"]):
            assert (a == b).all(), "the dp replicas diverged"
