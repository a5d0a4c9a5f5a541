"""The engine's fast paths at tp = 1 (docs/PERFORMANCE.md) keep the numbers they replace.

- Without SP the layers run batch-first [b, s, h]: the forward equals a sequence-first forward through the same
  modules bit for bit, the hidden states are contiguous, and a chunk's own inputs, outputs and input grads
  (pipeline messages) and its logits stay sequence-first and contiguous;
- the vocab-parallel cross-entropy takes a transposed view of the logits;
- AdamW in blocks, with the clipping and the weight decay inside each block, gives the same bits at any block size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.contract.config import Config
from training.model.gpt import GPTChunk
from training.optim.optimizer import DistributedOptimizer
from training.parallel.layers import vocab_parallel_cross_entropy
from training.parallel.mesh import ProcessMesh


def _cfg(**model) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 32, 4, 16, 50
    for k, v in model.items():
        setattr(m, k, v)
    cfg.train.grad_clip, cfg.train.weight_decay = 0.05, 0.1
    return cfg


def _chunk(cfg: Config, layer_ids=(0, 1), has_embedding=True, has_head=True) -> GPTChunk:
    return GPTChunk(
        cfg.model, cfg.parallel, ProcessMesh.single(), list(layer_ids), has_embedding, has_head, torch.float32, seed=0
    )


def _batch(cfg: Config, b: int = 3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _sequence_first_loss(chunk: GPTChunk, tokens, targets) -> torch.Tensor:
    """The chunk's loss through its own modules with every hidden state [s, b, h], as before the batch-first path."""
    emb = chunk.embedding
    x = F.embedding(tokens.t(), emb.word.weight)  # [s, b, h]
    if emb.position is not None:
        x = x + emb.position.weight[: tokens.shape[1]].unsqueeze(1)
    for layer in chunk.layers.values():
        at = layer.attn
        s, b = x.shape[:2]
        q, k, v = at.split_qkv(at.qkv(layer.attn_norm(x)))  # sequence-first split
        if at.rotary is not None:
            q, k = at.rotary(q), at.rotary(k)
        ctx = at.core(q, k, v, 0).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + at.proj(ctx)
        x = x + layer.mlp(layer.mlp_norm(x))
    weight = chunk.output.weight if chunk.output is not None else emb.word.weight
    logits = F.linear(chunk.final_norm(x), weight)
    return vocab_parallel_cross_entropy(logits, targets.t(), None, chunk.vocab_size).mean()


ARCHS = {
    "gpt": dict(),
    "llama": dict(
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=False,
        bias=False,
        num_attention_heads=8,
        num_query_groups=4,
    ),
    "gpt_math": dict(attention="math"),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batch_first_forward_equals_sequence_first_bit_for_bit(arch):
    cfg = _cfg(**ARCHS[arch])
    chunk = _chunk(cfg)
    assert chunk.batch_first  # tp = 1: no SP
    tokens, targets = _batch(cfg)
    with torch.no_grad():
        assert torch.equal(chunk(tokens, targets), _sequence_first_loss(chunk, tokens, targets))


def test_hidden_states_are_batch_first_and_chunk_boundaries_sequence_first():
    cfg = _cfg()
    b, s, h = 3, cfg.model.seq_length, cfg.model.hidden_size
    first = _chunk(cfg, (0,), has_embedding=True, has_head=False)
    seen = []
    first.layers["0"].register_forward_hook(lambda mod, inp, out: seen.append(out))
    tokens, targets = _batch(cfg, b)
    out = first(tokens)
    assert seen[0].shape == (b, s, h) and seen[0].is_contiguous()
    assert out.shape == (s, b, h) and out.is_contiguous()  # the pipeline message

    last = _chunk(cfg, (1,), has_embedding=False, has_head=True)
    inp = out.detach().requires_grad_(True)
    last(inp, targets).backward()
    assert inp.grad.shape == (s, b, h) and inp.grad.is_contiguous()  # the grad sent back
    logits = last(inp.detach())
    assert logits.shape == (s, b, last.padded_vocab) and logits.is_contiguous()


def test_cross_entropy_of_a_transposed_view():
    logits = torch.randn(4, 5, 8)  # [b, s, V] in memory
    tgt = torch.randint(0, 6, (5, 4))
    view = logits.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(view.transpose(0, 1), tgt, None, vocab_size=6)  # [s, b, V] view
    ours.sum().backward()
    ref_logits = logits.transpose(0, 1)[..., :6].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 6), tgt.reshape(-1), reduction="none").view(5, 4)
    ref.sum().backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(view.grad.transpose(0, 1)[..., :6], ref_logits.grad)
    assert torch.equal(view.grad[..., 6:], torch.zeros(4, 5, 2))


def _train_params(block: int, steps: int = 4):
    cfg = _cfg()
    torch.manual_seed(0)
    chunk = _chunk(cfg)
    opt = DistributedOptimizer(chunk.named_parameters(), cfg, ProcessMesh.single())
    opt.adamw.BLOCK = block
    norms = []
    for _step in range(steps):
        opt.zero_grad(1)
        tokens, targets = _batch(cfg)
        chunk(tokens, targets).backward()
        norms.append(opt.step(1e-2).grad_norm)
    return [p.detach().clone() for p in chunk.parameters()], norms


def test_blocked_adamw_with_clipping_and_decay_is_exact_at_any_block_size():
    whole, norms = _train_params(1 << 30)
    assert all(n > 0.05 for n in norms), "clipping must be active"
    for block in (37, 1024):  # blocks that end inside parameters, decayed and not
        got, _ = _train_params(block)
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), block
