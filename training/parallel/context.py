"""Context parallelism: the sequence split over the cp group, attention computed across it.

Load-balanced split (docs/CONTRACTS.md): a sample's sequence of s tokens is cut into 2 x cp chunks of
c = s / (2 cp) tokens; cp rank i holds chunks i and 2cp-1-i, in that order. Under a causal mask the early
chunks attend to few keys and the late ones to many, so every rank gets the same attention work.

Every op outside attention is per token, so a rank runs the model on its 2c tokens with their true
positions (`CPContext.positions`: learned position rows and RoPE angles are taken there). Attention needs
every earlier key:

- ring (default): the K/V of each rank travel around the cp ring, one hop per step, the next block's
  send/receive running asynchronously while this block's attention is computed. Each block yields a
  partial output and its log-sum-exp; blocks merge by the online-softmax rule
  (out = sum_b exp(lse_b - lse) out_b with lse = logsumexp_b lse_b). A block whose keys all lie after the
  queries is skipped: at step j > 0 a rank computes exactly two chunk pairs (both query chunks against the
  source's first chunk, or the second query chunk against both source chunks), so no rank waits for another.
  Backward rings the K/V again, and their gradients travel with them one hop behind, so each rank's dK/dV
  arrive back at their owner after cp hops.
- all_gather: every rank gathers the whole K/V once (as Llama 3's training did), attends its queries to
  them under the mask of true positions; the gather's backward sums the K/V grads over the group.

Attention here is computed in fp32 (softmax statistics included) and cast back, as the single-process
math path does; it has no dropout on the probabilities (the layout rules refuse cp > 1 with dropout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from training.parallel import collectives as comm


def chunk_ids(cp: int, cp_rank: int) -> Tuple[int, int]:
    """The two chunks (of 2 x cp) of every sample that cp rank `cp_rank` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (0 .. s-1) of this cp rank's tokens, in the order it holds them."""
    if seq_length % (2 * cp):
        raise ValueError(f"seq_length {seq_length} is not divisible by 2 x cp = {2 * cp}")
    c = seq_length // (2 * cp)
    a, b = chunk_ids(cp, cp_rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(device)


def split_sequence(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's two chunks of x along `dim` (the full sequence), concatenated (a copy)."""
    s = x.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"sequence of {s} tokens is not divisible by 2 x cp = {2 * cp}")
    c = s // (2 * cp)
    a, b = chunk_ids(cp, cp_rank)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


@dataclass
class CPContext:
    """What attention and the position embeddings of one rank need to know about the cp group."""

    cp: int
    """Context-parallel degree (> 1)."""
    cp_rank: int
    """This rank's index in the cp group."""
    group: Any
    """The cp process group."""
    ranks: List[int]
    """Global ranks of the group, by cp rank (the ring's order)."""
    comm: str = "ring"
    """ring | all_gather (parallel.cp_comm)."""
    overlap: bool = True
    """Ring: the next block's K/V exchange runs during this block's attention; False waits for it first
    (bench/bench_context_parallel.py measures the difference)."""

    def positions(self, seq_length: int, device) -> torch.Tensor:
        """True positions of this rank's tokens."""
        return local_positions(seq_length, self.cp, self.cp_rank, device)


# ---- one block of attention ------------------------------------------------------------------------
def _causal_bias(n: int, device) -> torch.Tensor:
    return torch.full((n, n), float("-inf"), device=device).triu_(1)


# CPU: torch's fused attention kernel that also returns the log-sum-exp (and its backward, which takes the merged
# output and log-sum-exp, exactly what a ring block needs); elsewhere the math below.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BWD is not None


def _heads(q, k, v):
    """[b, g, r, s, d] queries and [b, g, 1, s, d] keys/values as [b, g r, s, d] each (keys repeated per query)."""
    b, g, r, sq, d = q.shape
    sk = k.shape[-2]
    return (
        q.reshape(b, g * r, sq, d).contiguous(),
        k.expand(b, g, r, sk, d).reshape(b, g * r, sk, d).contiguous(),
        v.expand(b, g, r, sk, d).reshape(b, g * r, sk, d).contiguous(),
    )


def _block_forward(q, k, v, scale: float, causal: bool):
    """q [b, g, r, sq, d], k and v [b, g, 1, sk, d] (fp32) -> out [b, g, r, sq, d], lse [b, g, r, sq]."""
    if _fused(q):
        b, g, r, sq, d = q.shape
        out, lse = _CPU_FLASH(*_heads(q, k, v), 0.0, causal, scale=scale)
        return out.reshape(b, g, r, sq, d), lse.reshape(b, g, r, sq)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores + _causal_bias(scores.shape[-1], scores.device)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def _block_backward(q, k, v, out, dout, lse, scale: float, causal: bool):
    """Grads of one block given the merged output and log-sum-exp of its query rows: (dq, dk, dv)."""
    b, g, r, sq, d = q.shape
    if _fused(q):
        sk = k.shape[-2]
        dq, dk, dv = _CPU_FLASH_BWD(
            dout.reshape(b, g * r, sq, d).contiguous(),
            *_heads(q, k, v),
            out.reshape(b, g * r, sq, d).contiguous(),
            lse.reshape(b, g * r, sq).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return (
            dq.reshape(b, g, r, sq, d),
            dk.reshape(b, g, r, sk, d).sum(2, keepdim=True),
            dv.reshape(b, g, r, sk, d).sum(2, keepdim=True),
        )
    delta = (dout * out).sum(-1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores + _causal_bias(scores.shape[-1], scores.device)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # the block's share of the final softmax
    dv = torch.matmul(probs.transpose(-1, -2), dout).sum(2, keepdim=True)
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(2, keepdim=True)
    return dq, dk, dv


def _merge(acc: Optional[Tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor):
    """Online-softmax merge of a block's (out, lse) into the accumulated one."""
    if acc is None:
        return out, lse
    out0, lse0 = acc
    new = torch.logaddexp(lse0, lse)
    return out0 * torch.exp(lse0 - new).unsqueeze(-1) + out * torch.exp(lse - new).unsqueeze(-1), new


# ---- which chunk pairs a ring step computes -------------------------------------------------------
def ring_blocks(step: int, src: int, me: int) -> List[Tuple[str, str, bool]]:
    """(query part, key part, causal) of the blocks of ring step `step` whose K/V came from cp rank `src`.

    Parts: "a" (the first chunk), "b" (the second), "ab" (both). Step 0 is the rank's own K/V.
    """
    if step == 0:
        return [("a", "a", True), ("b", "a", False), ("b", "b", True)]
    if src < me:  # source chunk src precedes both of my chunks; its second chunk follows both
        return [("ab", "a", False)]
    return [("b", "ab", False)]  # src > me: both source chunks precede my second chunk, follow my first


def _part(x: torch.Tensor, part: str, c: int) -> torch.Tensor:
    return x if part == "ab" else (x[..., :c, :] if part == "a" else x[..., c:, :])


class _Ring:
    """Asynchronous exchange with the ring neighbours: send to cp rank i+1, receive from i-1.

    Each exchange is ONE batch_isend_irecv of its send and its receive, on the cp group's communicator, which a
    collective creates first (comm.create_communicator). Two separate isend/irecv deadlock on NCCL: un-batched
    ops run on a communicator per rank pair, created lazily and in issue order, so at cp = 2 each rank's send
    waits for a receive queued behind the peer's own send once a block outgrows NCCL's buffering, and at cp >= 3
    every rank blocks creating its pair with the next rank while that one creates its own with the one after.
    """

    def __init__(self, ctx: CPContext, device: torch.device):
        self.next = ctx.ranks[(ctx.cp_rank + 1) % ctx.cp]
        self.prev = ctx.ranks[(ctx.cp_rank - 1) % ctx.cp]
        self.group = ctx.group
        comm.create_communicator(self.group, device)

    def start(self, send: torch.Tensor, tag: int):
        recv = torch.empty_like(send)
        works = comm.batch_isend_irecv(
            [comm.send_op(send, self.next, self.group, tag), comm.recv_op(recv, self.prev, self.group, tag)]
        )
        return recv, list(works)

    @staticmethod
    def finish(works: list) -> None:
        """Wait for the exchange; the list is emptied, so a second call is a no-op (waiting twice on a gloo
        send would wait for a send that never comes)."""
        while works:
            works.pop().wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys, K/V passed around the ring.

    q [b, g, r, 2c, d], k and v [b, g, 1, 2c, d] (r query heads per key/value group); returns [b, g, r, 2c, d].
    """

    @staticmethod
    def forward(ctx, q, k, v, cpc: CPContext, scale: float):
        dtype = q.dtype
        qf, kv = q.float(), torch.stack([k.float(), v.float()]).contiguous()
        c = q.shape[-2] // 2
        me, n = cpc.cp_rank, cpc.cp
        ring = _Ring(cpc, q.device)
        acc = {"a": None, "b": None}
        for step in range(n):
            src = (me - step) % n
            pending = ring.start(kv, step) if step < n - 1 else None  # the next block's K/V, while this one computes
            if pending is not None and not cpc.overlap:
                _Ring.finish(pending[1])
            for qp, kp, causal in ring_blocks(step, src, me):
                out, lse = _block_forward(_part(qf, qp, c), _part(kv[0], kp, c), _part(kv[1], kp, c), scale, causal)
                if qp == "ab":
                    acc["a"] = _merge(acc["a"], out[..., :c, :], lse[..., :c])
                    acc["b"] = _merge(acc["b"], out[..., c:, :], lse[..., c:])
                else:
                    acc[qp] = _merge(acc[qp], out, lse)
            if pending is not None:
                kv, works = pending
                _Ring.finish(works)
        lse = torch.cat([acc["a"][1], acc["b"][1]], dim=-1)
        # Stored [b, s, g, r, d] like SDPA's output: merging the heads after attention is then a view, and
        # the projection's saved input is this same tensor (for fp32), not a second copy.
        out = torch.cat([acc["a"][0], acc["b"][0]], dim=-2).to(dtype).permute(0, 3, 1, 2, 4).contiguous()
        out = out.permute(0, 2, 3, 1, 4)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cpc, ctx.scale = cpc, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cpc, scale = ctx.cpc, ctx.scale
        me, n = cpc.cp_rank, cpc.cp
        c = q.shape[-2] // 2
        qf, dout, outf = q.float(), dout.float(), out.float()
        kv = torch.stack([k.float(), v.float()]).contiguous()
        dq = torch.zeros_like(qf)
        dkv = torch.zeros_like(kv)  # the grads of the K/V this rank holds now (they travel with them)
        ring = _Ring(cpc, q.device)
        dkv_pending = None
        for step in range(n):
            src = (me - step) % n
            pending = ring.start(kv, 2 * step) if step < n - 1 else None
            if pending is not None and not cpc.overlap:
                _Ring.finish(pending[1])
            mine = torch.zeros_like(kv)
            for qp, kp, causal in ring_blocks(step, src, me):
                rows = slice(None) if qp == "ab" else (slice(0, c) if qp == "a" else slice(c, 2 * c))
                cols = slice(None) if kp == "ab" else (slice(0, c) if kp == "a" else slice(c, 2 * c))
                g_q, g_k, g_v = _block_backward(
                    qf[..., rows, :],
                    kv[0][..., cols, :],
                    kv[1][..., cols, :],
                    outf[..., rows, :],
                    dout[..., rows, :],
                    lse[..., rows],
                    scale,
                    causal,
                )
                dq[..., rows, :] += g_q
                mine[0][..., cols, :] += g_k
                mine[1][..., cols, :] += g_v
            if dkv_pending is not None:  # the grads of this step's K/V gathered so far, one hop behind them
                dkv, works = dkv_pending
                _Ring.finish(works)
                mine += dkv
            dkv_pending = ring.start(mine, 2 * step + 1)  # on towards the K/V's owner
            if not cpc.overlap:
                _Ring.finish(dkv_pending[1])
            if pending is not None:
                kv, works = pending
                _Ring.finish(works)
        dkv, works = dkv_pending  # after cp hops: the grads of this rank's own K/V
        _Ring.finish(works)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


class _GatherKV(torch.autograd.Function):
    """All-gather of the stacked K/V over the cp group (by cp rank); backward sums the grads, keeps this rank's."""

    @staticmethod
    def forward(ctx, kv, cpc: CPContext):
        ctx.cpc = cpc
        parts = [torch.empty_like(kv) for _ in range(cpc.cp)]
        comm.all_gather(parts, kv.contiguous(), group=cpc.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce_op(grad, group=ctx.cpc.group)
        return grad[ctx.cpc.cp_rank], None


def all_gather_attention(q, k, v, cpc: CPContext, scale: float) -> torch.Tensor:
    """The all_gather variant: this rank's queries over every rank's gathered K/V, masked by true positions."""
    dtype = q.dtype
    kv = _GatherKV.apply(torch.stack([k.float(), v.float()]), cpc)  # [cp, 2, b, g, 1, 2c, d]
    keys = torch.cat(list(kv[:, 0]), dim=-2)
    values = torch.cat(list(kv[:, 1]), dim=-2)
    s_local = q.shape[-2]
    seq = s_local * cpc.cp
    qpos = local_positions(seq, cpc.cp, cpc.cp_rank, q.device)
    kpos = torch.cat([local_positions(seq, cpc.cp, r, q.device) for r in range(cpc.cp)])
    bias = torch.zeros((s_local, seq), device=q.device).masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale + bias
    return torch.matmul(scores.softmax(dim=-1), values).to(dtype)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cpc: CPContext) -> torch.Tensor:
    """Causal attention across the cp group. q [b, heads, 2c, d]; k, v [b, groups, 2c, d] -> [b, heads, 2c, d]."""
    b, heads, s, d = q.shape
    groups = k.shape[1]
    q5 = q.reshape(b, groups, heads // groups, s, d)
    k5, v5 = k.unsqueeze(2), v.unsqueeze(2)
    scale = 1.0 / math.sqrt(d)
    if cpc.comm == "all_gather":
        out = all_gather_attention(q5, k5, v5, cpc, scale)
    else:
        out = RingAttention.apply(q5, k5, v5, cpc, scale)
    return out.reshape(b, heads, s, d)
