"""Tensor / sequence parallel GPT against a single-process reference (fp32, gloo, tiny dims).

One process spawn per world size runs every case (spawning dominates the runtime on 2 cores);
each rank also computes the single-process reference itself and compares its own shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.dist import run_distributed
from helpers.oracles_engine import allreduce_sequence_parallel_grads

from training.contract.config import Config
from training.model.gpt import GPTChunk, build_gpt, chunk_layer_ids, keyed_dropout
from training.parallel.layers import vocab_parallel_cross_entropy
from training.parallel.mesh import ProcessMesh

V, S, B = 51, 16, 2  # vocab 51 is padded to 52 at tp=2 and tp=4

ARCHS = {
    "gpt": dict(
        norm="layernorm",
        activation="gelu",
        position="learned",
        tie_embeddings=True,
        bias=True,
        num_attention_heads=4,
        num_query_groups=None,
        attention="math",
    ),
    "llama": dict(
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=False,
        bias=False,
        num_attention_heads=8,
        num_query_groups=4,
        attention="flash",
    ),
}


def _cfg(arch: str, sp=False, recompute="none", dropout=0.0) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.seq_length, m.vocab_size, m.ffn_hidden_size = 2, 32, S, V, 64
    m.dropout = dropout
    for k, v in ARCHS[arch].items():
        setattr(m, k, v)
    cfg.parallel.sp, cfg.parallel.recompute = sp, recompute
    cfg.train.seed = 7
    return cfg


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _fwd_bwd(cfg: Config, mesh: ProcessMesh, steps: int = 1):
    (model,) = build_gpt(cfg, mesh, torch.float32)
    ids, tgt = _batch()
    losses = []
    for _ in range(steps):
        loss = model(ids, tgt)
        loss.backward()
        losses.append(loss.item())
    allreduce_sequence_parallel_grads(model.parameters(), mesh.tp_group)
    return losses, model


def _compare(model, ref_model, mesh):
    """Largest |local grad - reference shard| over every parameter, and its name."""
    ref = dict(ref_model.named_parameters())
    worst, name = 0.0, ""
    for n, p in model.named_parameters():
        r_w, r_g = ref[n].detach(), ref[n].grad
        if tuple(r_w.shape) != p.global_shape:  # vocabulary padding rows: zero weights, zero grads
            assert n in ("embedding.word.weight", "output.weight") and r_w.shape[1:] == p.global_shape[1:], n
            pad = p.global_shape[0] - r_w.shape[0]
            r_w, r_g = F.pad(r_w, (0, 0, 0, pad)), F.pad(r_g, (0, 0, 0, pad))
        g = r_g if p.tp_shard_dim is None else r_g.chunk(mesh.tp, dim=p.tp_shard_dim)[mesh.tp_rank]
        w = r_w if p.tp_shard_dim is None else r_w.chunk(mesh.tp, p.tp_shard_dim)[mesh.tp_rank]
        assert torch.equal(p.detach(), w), f"{n}: initialisation depends on the layout"
        d = (p.grad - g).abs().max().item() / (g.abs().max().item() + 1e-8)
        if d > worst:
            worst, name = d, n
    assert set(ref) == {n for n, _ in model.named_parameters()}
    return worst, name


def _saved_bytes(model, ids, tgt) -> int:
    """Unique storage bytes saved for backward by one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, tgt)
    loss.backward()
    return sum(seen.values())


def _tp_worker(layouts, memory_tp):
    """Every case of every (tp, dp) layout in one world (new_group may build several meshes)."""
    single = ProcessMesh.single()
    torch.manual_seed(0)
    out = {"cases": [], "memory": None}
    refs = {}
    meshes = {}
    for tp, dp, cases in layouts:
        mesh = meshes[tp] = ProcessMesh.from_env(tp, 1, 1, dp, backend="gloo", timeout_s=60)
        for arch, sp, recompute, dropout in cases:
            key = (arch, dropout)
            if key not in refs:
                refs[key] = _fwd_bwd(_cfg(arch, dropout=dropout), single)
            ref_losses, ref_model = refs[key]
            losses, model = _fwd_bwd(_cfg(arch, sp, recompute, dropout), mesh)
            worst, name = _compare(model, ref_model, mesh)
            out["cases"].append(
                dict(
                    case=(tp, arch, sp, recompute, dropout),
                    loss=losses[0],
                    ref_loss=ref_losses[0],
                    grad_rel=worst,
                    worst=name,
                    tp_rank=mesh.tp_rank,
                )
            )
    if memory_tp:
        ids, tgt = _batch()
        figures = {}
        mesh = meshes[memory_tp]
        for label, m, sp in (("single", single, False), ("tp", mesh, False), ("tp_sp", mesh, True)):
            (model,) = build_gpt(_cfg("gpt", sp), m, torch.float32)
            figures[label] = _saved_bytes(model, ids, tgt)
        out["memory"] = figures
        # Residual dropout draws the whole sequence's mask and keeps the local rows, so with dropout on
        # SP (masks on sequence shards) equals plain TP (masks on the replicated sequence).
        (l_tp,), m_tp = _fwd_bwd(_cfg("gpt", False, dropout=0.1), mesh)
        (l_sp,), m_sp = _fwd_bwd(_cfg("gpt", True, dropout=0.1), mesh)
        diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(m_tp.parameters(), m_sp.parameters()))
        out["dropout"] = dict(tp=l_tp, sp=l_sp, grad_diff=diff, no_dropout=refs[("gpt", 0.0)][0][0])
    mesh.destroy()
    return out


def test_tp2_tp4_match_single_process_sp_on_off_recompute_and_sp_saves_memory():
    """4 ranks: tp=4 (sp on/off), then tp=2 x dp=2 (sp on/off x recompute none/selective/full)."""
    tp4 = [(arch, sp, "none", 0.0) for arch in ARCHS for sp in (False, True)]
    tp2 = [(arch, sp, rc, 0.0) for arch in ARCHS for sp in (False, True) for rc in ("none", "selective", "full")]
    results = run_distributed(_tp_worker, 4, args=([(4, 1, tp4), (2, 2, tp2)], 2), timeout_s=240)
    assert len(results[0]["cases"]) == len(tp4) + len(tp2)
    losses = {}
    for rank_out in results:
        for c in rank_out["cases"]:
            assert abs(c["loss"] - c["ref_loss"]) <= 1e-5 * abs(c["ref_loss"]), c
            assert c["grad_rel"] < 1e-5, c
            # The loss is the same number on every rank (every tp rank, and the dp replicas).
            assert losses.setdefault(c["case"], c["loss"]) == c["loss"], c
    for r in results:
        d = r["dropout"]
        assert d["tp"] != d["no_dropout"] and abs(d["tp"] - d["sp"]) < 1e-6 and d["grad_diff"] < 1e-6, d
        mem = r["memory"]
        print("saved activation bytes per rank (tp=2):", mem)
        assert mem["tp_sp"] < mem["tp"] < mem["single"], mem


# ---- single-process checks ----------------------------------------------------------------------


def test_vocab_cross_entropy_equals_torch_and_ignores_padding():
    logits = torch.randn(5, 3, 8, requires_grad=True)
    tgt = torch.randint(0, 6, (5, 3))
    ours = vocab_parallel_cross_entropy(logits, tgt, None, vocab_size=6)  # columns 6, 7 are padding
    ref_logits = logits.detach()[..., :6].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 6), tgt.reshape(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(ours, ref)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad[..., :6], ref_logits.grad)
    assert logits.grad[..., 6:].abs().max() == 0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_recompute_and_dropout_are_deterministic(arch):
    """With dropout on, full / selective recomputation replays the same masks: same loss and grads."""
    mesh = ProcessMesh.single()
    base_losses, base = _fwd_bwd(_cfg(arch, dropout=0.2), mesh, steps=2)
    nodrop_losses, _ = _fwd_bwd(_cfg(arch, dropout=0.0), mesh, steps=1)
    assert base_losses[0] != nodrop_losses[0] and base_losses[0] != base_losses[1]  # dropout is active
    for rc in ("selective", "full"):
        losses, model = _fwd_bwd(_cfg(arch, recompute=rc, dropout=0.2), mesh, steps=2)
        assert losses == base_losses, rc
        for (n, p), q in zip(model.named_parameters(), base.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=n)


def test_pipeline_chunks_keep_global_names():
    cfg = _cfg("llama")
    cfg.model.num_layers, cfg.parallel.pp, cfg.parallel.vpp = 8, 2, 2
    assert chunk_layer_ids(8, 2, 2, 0) == [[0, 1], [4, 5]]
    assert chunk_layer_ids(8, 2, 2, 1) == [[2, 3], [6, 7]]
    names = {}
    for pp_rank in (0, 1):
        mesh = ProcessMesh(world_size=2, pp=2, pp_rank=pp_rank)
        chunks = build_gpt(cfg, mesh, torch.float32)
        assert [c.has_embedding for c in chunks] == [pp_rank == 0, False]
        assert [c.has_head for c in chunks] == [False, pp_rank == 1]
        for c in chunks:
            names.update({n: p for n, p in c.named_parameters()})
    (whole,) = build_gpt(_whole(cfg), ProcessMesh.single(), torch.float32)
    assert names.keys() == dict(whole.named_parameters()).keys()
    for n, p in whole.named_parameters():
        assert torch.equal(names[n], p), n  # init does not depend on the stage holding the parameter
    with pytest.raises(ValueError, match="num_layers"):
        chunk_layer_ids(6, 2, 2, 0)


def _whole(cfg: Config) -> Config:
    import copy

    c = copy.deepcopy(cfg)
    c.parallel.pp, c.parallel.vpp = 1, 1
    return c


def test_layout_errors_name_the_fix():
    cfg = _cfg("llama")
    mesh = ProcessMesh(world_size=8, tp=8)
    with pytest.raises(ValueError, match="num_query_groups"):
        GPTChunk(cfg.model, cfg.parallel, mesh, [0], True, True, torch.float32, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_params_keep_an_fp32_loss(dtype):
    """Params in bf16/fp16 (same init, rounded), softmax and cross-entropy in fp32."""
    mesh = ProcessMesh.single()
    ids, tgt = _batch()
    for arch in ARCHS:
        cfg = _cfg(arch)
        (ref,) = build_gpt(cfg, mesh, torch.float32)
        (half,) = build_gpt(cfg, mesh, dtype)
        assert all(p.dtype == dtype for p in half.parameters())
        loss = half(ids, tgt)
        assert loss.dtype == torch.float32
        loss.backward()
        # bf16 keeps 8 mantissa bits: the loss of a 2-layer model agrees to about 1e-2 relative.
        assert abs(loss.item() - ref(ids, tgt).item()) < 2e-2 * loss.item(), arch
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in half.parameters())


def test_sharded_dropout_mask_is_the_full_mask_sliced():
    x = torch.ones(8, 2, 4)
    full = keyed_dropout(x, 0.5, key=11)
    shards = [keyed_dropout(x[i * 2 : (i + 1) * 2], 0.5, key=11, shard=i, num_shards=4) for i in range(4)]
    assert torch.equal(torch.cat(shards), full)
    assert 0 < (full == 0).sum() < full.numel() and torch.equal(full.unique(), torch.tensor([0.0, 2.0]))
    assert not torch.equal(keyed_dropout(x, 0.5, key=12), full)
