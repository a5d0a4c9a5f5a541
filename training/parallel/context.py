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
- all_gather: every rank gathers the whole K/V once (as Llama 3's training did) and attends its queries to
  them in blocks (each query chunk against the earlier chunks, then causally against its own), keeping for
  backward what the ring keeps (q, k, v, output, log-sum-exp: no s x s scores); backward gathers again,
  recomputes the blocks and reduce-scatters the K/V grads to their owners.

Blocks run on a fused attention kernel that returns the log-sum-exp: torch's CPU flash kernel in fp32, and on
CUDA the flash kernel in the run's 16-bit dtype (fp32 softmax statistics inside); elsewhere fp32 math. Blocks
merge and the grads sum in fp32. There is no dropout on the probabilities (the layout rules refuse cp > 1 with
dropout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from training.parallel import collectives as comm


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
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
    ranks: list[int]
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


# Fused attention kernels that also return the log-sum-exp (and whose backward takes the merged output and
# log-sum-exp, exactly what a block needs): torch's CPU flash kernel (fp32 here), and on CUDA the flash kernel
# in the run's 16-bit dtype (softmax statistics in fp32 inside). Anything else (fp32 on CUDA, a head size the
# flash kernel lacks) takes the fp32 math below.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_CUDA_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_CUDA_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None)


class _CpuKernel:
    """torch's CPU flash attention on fp32 blocks."""

    name = "cpu_flash"

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        return _CPU_FLASH_BWD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


class _CudaKernel:
    """torch's CUDA flash attention on 16-bit blocks. Dense and without dropout, the backward's varlen and RNG
    arguments are unused; it gets them as a forward returned them (what torch's own context-parallel attention
    passes), from the last block computed."""

    name = "cuda_flash"
    aux: tuple[Any, Any, Any, Any] | None = None
    """(cum_seq_q, cum_seq_k, rng_state, unused) of the last forward call."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        res = _CUDA_FLASH(q, k, v, 0.0, causal, False, scale=scale)
        _CudaKernel.aux = (res[2], res[3], res[6], res[7])
        return res[0], res[1]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        aux = _CudaKernel.aux
        if aux is None:  # a backward before any forward in this process (not the engine's order)
            _CudaKernel.forward(q[..., :1, :], k[..., :1, :], v[..., :1, :], False, scale)
            aux = _CudaKernel.aux
        cum_q, cum_k, seed, offset = aux
        sq, sk = q.shape[-2], k.shape[-2]
        return _CUDA_FLASH_BWD(dout, q, k, v, out, lse, cum_q, cum_k, sq, sk, 0.0, causal, seed, offset, scale=scale)[
            :3
        ]


def _kernel(q: torch.Tensor) -> Any | None:
    """The fused kernel for blocks like q, or None for the fp32 math path."""
    if q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BWD is not None:
        return _CpuKernel
    if (
        q.is_cuda
        and _CUDA_FLASH is not None
        and _CUDA_FLASH_BWD is not None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    ):
        return _CudaKernel
    return None


def block_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype blocks are computed (and K/V exchanged) in: the run's 16-bit dtype where the CUDA flash kernel
    takes it, else fp32. Merging and the grads' sums are fp32 either way."""
    return q.dtype if _kernel(q) is _CudaKernel else torch.float32


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
    """q [b, g, r, sq, d], k and v [b, g, 1, sk, d] (block_dtype) -> out [b, g, r, sq, d] and lse [b, g, r, sq],
    both fp32 (for the merge)."""
    kernel = _kernel(q)
    if kernel is not None:
        b, g, r, sq, d = q.shape
        out, lse = kernel.forward(*_heads(q, k, v), causal, scale)
        return out.float().reshape(b, g, r, sq, d), lse.float().reshape(b, g, r, sq)
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores + _causal_bias(scores.shape[-1], scores.device)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def _block_backward(q, k, v, out, dout, lse, scale: float, causal: bool):
    """Grads of one block given the merged output and log-sum-exp of its query rows: (dq, dk, dv) in fp32.
    q, k, v, out and dout in block_dtype, lse fp32."""
    b, g, r, sq, d = q.shape
    kernel = _kernel(q)
    if kernel is not None:
        sk = k.shape[-2]
        dq, dk, dv = kernel.backward(
            dout.reshape(b, g * r, sq, d).contiguous(),
            *_heads(q, k, v),
            out.reshape(b, g * r, sq, d).contiguous(),
            lse.reshape(b, g * r, sq).contiguous(),
            causal,
            scale,
        )
        return (
            dq.float().reshape(b, g, r, sq, d),
            dk.float().reshape(b, g, r, sk, d).sum(2, keepdim=True),
            dv.float().reshape(b, g, r, sk, d).sum(2, keepdim=True),
        )
    q, k, v, out, dout = q.float(), k.float(), v.float(), out.float(), dout.float()
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


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor):
    """Online-softmax merge of a block's (out, lse) into the accumulated one."""
    if acc is None:
        return out, lse
    out0, lse0 = acc
    new = torch.logaddexp(lse0, lse)
    return out0 * torch.exp(lse0 - new).unsqueeze(-1) + out * torch.exp(lse - new).unsqueeze(-1), new


# ---- which chunk pairs a ring step computes -------------------------------------------------------
def ring_blocks(step: int, src: int, me: int) -> list[tuple[str, str, bool]]:
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
        dtype, bd = q.dtype, block_dtype(q)
        qf, kv = q.to(bd), torch.stack([k.to(bd), v.to(bd)]).contiguous()
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
        bd = block_dtype(q)
        qf, dout, outf = q.to(bd), dout.to(bd), out.to(bd)
        kv = torch.stack([k.to(bd), v.to(bd)]).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The grads of the K/V this rank holds now (they travel with them), summed in fp32.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        ring = _Ring(cpc, q.device)
        dkv_pending = None
        for step in range(n):
            src = (me - step) % n
            pending = ring.start(kv, 2 * step) if step < n - 1 else None
            if pending is not None and not cpc.overlap:
                _Ring.finish(pending[1])
            mine = torch.zeros_like(dkv)
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


def _sequence_order(parts: torch.Tensor, c: int) -> torch.Tensor:
    """[cp, ...,  2c, d] per-rank K/V (rank r: chunks r and 2cp-1-r) -> [..., 2 cp c, d] in sequence order."""
    cp = parts.shape[0]
    chunks = [parts[j][..., :c, :] if j < cp else parts[2 * cp - 1 - j][..., c:, :] for j in range(2 * cp)]
    return torch.cat(chunks, dim=-2)


def _rank_order(full: torch.Tensor, cp: int, c: int) -> torch.Tensor:
    """The inverse of _sequence_order: [..., 2 cp c, d] -> [cp, ..., 2c, d] (rank r's two chunks)."""
    return torch.stack(
        [
            torch.cat([full[..., r * c : (r + 1) * c, :], full[..., (2 * cp - 1 - r) * c : (2 * cp - r) * c, :]], -2)
            for r in range(cp)
        ]
    )


def _gathered_blocks(me: int, cp: int, c: int) -> list[tuple[str, int, int, bool]]:
    """(query part, first key, end key, causal) of the all_gather variant's blocks, keys in sequence order: each
    query chunk against every earlier chunk (one block, no mask) and against its own chunk (causal)."""
    out = []
    for part, chunk in (("a", me), ("b", 2 * cp - 1 - me)):
        if chunk:
            out.append((part, 0, chunk * c, False))
        out.append((part, chunk * c, (chunk + 1) * c, True))
    return out


class AllGatherAttention(torch.autograd.Function):
    """parallel.cp_comm=all_gather: every rank gathers the whole K/V once and attends its queries to it, in blocks
    with the ring's saved-state discipline: only q, k, v (local), the output and its log-sum-exp are kept for
    backward (no s x s scores), which gathers the K/V again, recomputes the blocks, and reduce-scatters the
    gathered K/V's grads so each rank gets the sum for its own K/V."""

    @staticmethod
    def _gather(k, v, cpc: CPContext, bd: torch.dtype) -> torch.Tensor:
        kv = torch.stack([k.to(bd), v.to(bd)]).contiguous()
        parts = [torch.empty_like(kv) for _ in range(cpc.cp)]
        comm.all_gather(parts, kv, group=cpc.group)
        return _sequence_order(torch.stack(parts), k.shape[-2] // 2)  # [2, b, g, 1, s, d]

    @staticmethod
    def forward(ctx, q, k, v, cpc: CPContext, scale: float):
        dtype, bd = q.dtype, block_dtype(q)
        c = q.shape[-2] // 2
        full = AllGatherAttention._gather(k, v, cpc, bd)
        qb = q.to(bd)
        acc: dict = {"a": None, "b": None}
        for part, lo, hi, causal in _gathered_blocks(cpc.cp_rank, cpc.cp, c):
            out, lse = _block_forward(_part(qb, part, c), full[0][..., lo:hi, :], full[1][..., lo:hi, :], scale, causal)
            acc[part] = _merge(acc[part], out, lse)
        del full
        lse = torch.cat([acc["a"][1], acc["b"][1]], dim=-1)
        out = torch.cat([acc["a"][0], acc["b"][0]], dim=-2).to(dtype).permute(0, 3, 1, 2, 4).contiguous()
        out = out.permute(0, 2, 3, 1, 4)  # stored [b, s, g, r, d], as the ring's
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cpc, ctx.scale = cpc, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cpc, scale = ctx.cpc, ctx.scale
        bd = block_dtype(q)
        c = q.shape[-2] // 2
        full = AllGatherAttention._gather(k, v, cpc, bd)
        qb, dout, outb = q.to(bd), dout.to(bd), out.to(bd)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dfull = torch.zeros(full.shape, dtype=torch.float32, device=q.device)
        for part, lo, hi, causal in _gathered_blocks(cpc.cp_rank, cpc.cp, c):
            rows = slice(0, c) if part == "a" else slice(c, 2 * c)
            g_q, g_k, g_v = _block_backward(
                qb[..., rows, :],
                full[0][..., lo:hi, :],
                full[1][..., lo:hi, :],
                outb[..., rows, :],
                dout[..., rows, :],
                lse[..., rows],
                scale,
                causal,
            )
            dq[..., rows, :] += g_q
            dfull[0][..., lo:hi, :] += g_k
            dfull[1][..., lo:hi, :] += g_v
        del full
        per_rank = _rank_order(dfull, cpc.cp, c).contiguous()  # [cp, 2, b, g, 1, 2c, d]
        del dfull
        mine = torch.empty(per_rank.shape[1:], dtype=per_rank.dtype, device=per_rank.device)
        comm.reduce_scatter_single(mine.view(-1), per_rank.view(-1), group=cpc.group)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


def all_gather_attention(q, k, v, cpc: CPContext, scale: float) -> torch.Tensor:
    """The all_gather variant: this rank's queries over every rank's gathered K/V (AllGatherAttention)."""
    return AllGatherAttention.apply(q, k, v, cpc, scale)


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
