"""Pipeline-parallel schedules: gpipe, 1f1b and interleaved_1f1b, run with point-to-point send/recv.

A schedule is a per-rank list of actions, F(chunk, mb) and B(chunk, mb) (`build_actions`, a pure
function), executed in order by `PipelineSchedule.forward_backward`:
  F: receive the input of (chunk, mb) from the previous virtual stage (blocking; the first virtual
     stage takes the token ids), run the chunk, send the output to the next virtual stage (async);
     the last virtual stage returns the micro-batch loss instead.
  B: receive d(output) from the next virtual stage (the last one backpropagates the scaled loss),
     backward, send d(input) to the previous virtual stage (async).
Sends never block (isend, waited for at the end of the step) and receives are posted a few actions
ahead and waited for just before the compute that needs them, so any order in which each F follows its producer and each B its consumer
runs without deadlock; the three orders below are Megatron-LM's.

Virtual stage of local chunk c on pipeline rank r: c * p + r (model.build_gpt's order). Every message
has a fixed shape per step, [s/tp if sp else s, micro_batch, h] in the model dtype, and a tag naming
(direction, receiving virtual stage, micro-batch), so a mismatch is an error, never a silent swap.
That holds on gloo only: NCCL ignores tags (a pair's messages match in issue order) and runs a pair's
sends and receives one after another on one stream, so a receive posted ahead can block a send the peer
waits for. NOT YET RUN ON NCCL: Megatron batches each step's send/recv pair (batch_isend_irecv) for this.

In-flight micro-batches (forward done, backward not yet) on rank r, which bound the activations held:
  gpipe m;  1f1b min(m, p - r);  interleaved min(m v, 2 (p - r - 1) + (v - 1) p + 1) chunk micro-batches.
The planner (launcher/plan.py `inflight_microbatches`) uses the same numbers.

Each step records this rank's busy time (forward and backward compute only, not waiting or
communication) and its wall time; the pipeline's idle share, 1 - mean busy / longest wall over the
pipeline ranks, is reported next to the planner's (p - 1) / (v m + p - 1).

Tied embeddings: the last stage's copy of `embedding.word.weight` starts equal to the first stage's
(initialisation is seeded by parameter name) and its grad is all-reduced over mesh.embedding_group by
the optimizer after the last backward (training/optimizer.py), so both copies stay equal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

RECV_LOOKAHEAD = 2
"""Receives are posted this many actions ahead (bounds the extra receive buffers to 3 messages)."""

Action = Tuple[str, int, int]
"""("F" | "B", local chunk index, micro-batch index)."""


# ---- the orders (pure) ----------------------------------------------------------------------------
def check_schedule(kind: str, p: int, v: int, m: int) -> None:
    """Errors a user can cause with the schedule's shape, each naming the fix."""
    if kind not in SCHEDULES:
        raise ValueError(f"parallel.schedule={kind!r}: use one of {', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline needs pp, vpp and micro-batches >= 1 (got pp={p}, vpp={v}, m={m})")
    if v > 1 and kind != "interleaved_1f1b":
        raise ValueError(f"parallel.vpp={v} needs parallel.schedule=interleaved_1f1b (or set parallel.vpp=1)")
    if kind == "interleaved_1f1b" and m % p:
        raise ValueError(f"interleaved_1f1b needs the micro-batches per step ({m}) to be a multiple of "
                         f"parallel.pp={p}: change parallel.global_batch (micro_batch x dp x a multiple of pp)")


def _interleaved_chunk(k: int, p: int, v: int, forward: bool) -> Tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) of an interleaved rank: groups of p
    micro-batches go through chunk 0, then chunk 1, ... (Megatron's get_model_chunk_id)."""
    group, pos = divmod(k, p * v)
    chunk = pos // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + pos % p


def build_actions(kind: str, p: int, rank: int, m: int, v: int = 1) -> List[Action]:
    """The ordered F/B actions of pipeline rank `rank` for one step of m micro-batches."""
    check_schedule(kind, p, v, m)
    if kind == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if kind == "1f1b":
        warm = min(p - rank - 1, m)
        out: List[Action] = [("F", 0, i) for i in range(warm)]
        for i in range(m - warm):
            out += [("F", 0, warm + i), ("B", 0, i)]
        return out + [("B", 0, i) for i in range(m - warm, m)]
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    fwd = [("F",) + _interleaved_chunk(k, p, v, True) for k in range(total)]
    bwd = [("B",) + _interleaved_chunk(k, p, v, False) for k in range(total)]
    out = list(fwd[:warm])
    for i in range(total - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[total - warm:]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most (chunk, micro-batch) forwards whose backward has not run yet, over the action list."""
    live = peak = 0
    for kind, _, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def planned_idle_share(p: int, m: int, v: int = 1) -> float:
    """The planner's idle share of wall clock, (p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


# ---- execution ------------------------------------------------------------------------------------
@dataclass
class StepStats:
    """What this rank measured during the last `forward_backward`."""

    busy_s: float = 0.0
    """Seconds of forward and backward compute on this rank."""
    wall_s: float = 0.0
    """Seconds from the first action to the last send completing."""
    idle_share: float = 0.0
    """1 - busy / wall on this rank."""
    idle_share_mean: float = 0.0
    """1 - mean busy / longest wall over the pipeline ranks: the pipeline's idle share (the metrics line's)."""
    peak_in_flight: int = 0
    """Most chunk micro-batches held between forward and backward."""
    peak_saved_bytes: int = 0
    """Most activation bytes saved for backward (unique storages, parameters excluded) held at once."""
    saved_bytes_per_forward: List[int] = field(default_factory=list)
    """Bytes saved by each forward, in action order."""


class _SavedBytes:
    """Counts the unique non-parameter storages that autograd saves during one forward."""

    def __init__(self, param_ptrs: set):
        self.param_ptrs, self.seen = param_ptrs, {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.param_ptrs:
            self.seen[ptr] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


class PipelineSchedule:
    """Runs one rank's share of a pipeline step over its model chunks (virtual-stage order)."""

    def __init__(self, chunks: List[torch.nn.Module], kind: str, pp: int, pp_rank: int, pp_ranks: List[int],
                 pp_group, p2p_shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 scale_loss: Callable[[torch.Tensor, int], torch.Tensor], measure_memory: bool = True):
        """pp_ranks: global rank of each pipeline rank of this pipeline; scale_loss(loss, m) -> the
        tensor to backpropagate on the last stage (the optimizer's mean and loss scale)."""
        self.chunks, self.kind, self.p, self.rank = chunks, kind, pp, pp_rank
        self.v = len(chunks)
        self.pp_ranks, self.group = list(pp_ranks), pp_group
        self.shape, self.dtype, self.device = tuple(p2p_shape), dtype, device
        self.scale_loss, self.measure_memory = scale_loss, measure_memory
        self.stats = StepStats()
        self.num_virtual = self.p * self.v
        self._param_ptrs = {q.untyped_storage().data_ptr() for c in chunks for q in c.parameters()}
        check_schedule(kind, pp, self.v, max(pp, 1) if kind == "interleaved_1f1b" else 1)

    # -- topology --
    def _vstage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _peer(self, vstage: int) -> int:
        """Global rank holding virtual stage `vstage`."""
        return self.pp_ranks[vstage % self.p]

    def _tag(self, backward: bool, vstage: int, mb: int, m: int) -> int:
        return ((int(backward) * self.num_virtual) + vstage) * m + mb

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- the step --
    def forward_backward(self, micro_batches: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean micro-batch loss on the last
        stage (detached fp32; zero elsewhere). Grads accumulate through the optimizer's hooks."""
        m = len(micro_batches)
        actions = build_actions(self.kind, self.p, self.rank, m, self.v)
        last_v = self.num_virtual - 1
        held: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor, int]] = {}
        sends: List = []
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        st = StepStats()
        live_bytes = 0
        self._sync()
        t_start = time.perf_counter()
        posted: Dict[int, Tuple[torch.Tensor, object]] = {}
        for i, (kind, c, mb) in enumerate(actions):
            vs = self._vstage(c)
            if kind == "F":
                tokens, targets = micro_batches[mb]
                self._post_recvs(actions, i, m, posted)
                if vs == 0:
                    x, inp = tokens.to(self.device), None
                else:
                    inp, work = posted.pop(i)
                    work.wait()
                    inp.requires_grad_(True)
                    x = inp
                counter = _SavedBytes(self._param_ptrs)
                t0 = time.perf_counter()
                if self.measure_memory:
                    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                        out = self._forward(c, x, targets if vs == last_v else None)
                else:
                    out = self._forward(c, x, targets if vs == last_v else None)
                self._sync()
                st.busy_s += time.perf_counter() - t0
                if vs == last_v:
                    total += out.detach().float()
                else:
                    sends.append(dist.isend(out.detach().contiguous(), dst=self._peer(vs + 1), group=self.group,
                                            tag=self._tag(False, vs + 1, mb, m)))
                held[(c, mb)] = (inp, out, counter.total)
                live_bytes += counter.total
                st.saved_bytes_per_forward.append(counter.total)
                st.peak_saved_bytes = max(st.peak_saved_bytes, live_bytes)
                st.peak_in_flight = max(st.peak_in_flight, len(held))
            else:
                inp, out, nbytes = held.pop((c, mb))
                self._post_recvs(actions, i, m, posted)
                if vs == last_v:
                    grad_out = None
                else:
                    grad_out, work = posted.pop(i)
                    work.wait()
                t0 = time.perf_counter()
                if grad_out is None:
                    self.scale_loss(out.float(), m).backward()
                else:
                    torch.autograd.backward(out, grad_tensors=grad_out)
                self._sync()
                st.busy_s += time.perf_counter() - t0
                live_bytes -= nbytes
                if vs > 0:
                    sends.append(dist.isend(inp.grad.contiguous(), dst=self._peer(vs - 1), group=self.group,
                                            tag=self._tag(True, vs - 1, mb, m)))
                del inp, out, grad_out
        for work in sends:
            work.wait()
        st.wall_s = time.perf_counter() - t_start
        st.idle_share = max(0.0, 1.0 - st.busy_s / st.wall_s) if st.wall_s > 0 else 0.0
        # The pipeline's wall clock is the longest rank's (a rank that finishes early idles until the
        # step ends); ranks start together, synchronised by the previous step's collectives.
        busy = torch.tensor([st.busy_s], dtype=torch.float64, device=self.device)
        wall = torch.tensor([st.wall_s], dtype=torch.float64, device=self.device)
        if self.p > 1:
            dist.all_reduce(busy, group=self.group)
            dist.all_reduce(wall, group=self.group, op=dist.ReduceOp.MAX)
        st.idle_share_mean = max(0.0, 1.0 - float(busy.item()) / self.p / float(wall.item()))
        self.stats = st
        self.last_m = m
        return total / m

    def _post_recvs(self, actions: List[Action], i: int, m: int, posted: Dict) -> None:
        """Post the receives of actions i .. i + RECV_LOOKAHEAD that are not posted yet, so a message is
        already here when its consumer starts (a receive posted on demand costs a round trip)."""
        last_v = self.num_virtual - 1
        for j in range(i, min(i + RECV_LOOKAHEAD + 1, len(actions))):
            kind, c, mb = actions[j]
            vs = self._vstage(c)
            if j in posted or (kind == "F" and vs == 0) or (kind == "B" and vs == last_v):
                continue
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            peer = self._peer(vs - 1) if kind == "F" else self._peer(vs + 1)
            posted[j] = (buf, dist.irecv(buf, src=peer, group=self.group, tag=self._tag(kind == "B", vs, mb, m)))

    def _forward(self, c: int, x: torch.Tensor, targets: Optional[torch.Tensor]) -> torch.Tensor:
        if targets is not None:
            return self.chunks[c](x, targets.to(self.device))
        return self.chunks[c](x)

    def metrics(self) -> Dict[str, float]:
        """Fields for the metrics line: measured idle share (mean over stages) next to the plan's."""
        return {"bubble_measured": round(self.stats.idle_share_mean, 4),
                "bubble_planned": round(planned_idle_share(self.p, getattr(self, "last_m", 1), self.v), 4)}


def p2p_shape(cfg) -> Tuple[int, int, int]:
    """Shape of every activation / gradient message: [s/tp if sp else s, micro_batch, h]."""
    s, tp = cfg.model.seq_length, cfg.parallel.tp
    if cfg.parallel.sp and tp > 1:
        s //= tp
    return (s, cfg.parallel.micro_batch, cfg.model.hidden_size)


def make_pipeline_schedule(cfg, mesh, chunks, optimizer) -> PipelineSchedule:
    """The schedule training.loop uses when pp > 1 (parallel.schedule picks the order)."""
    from training.config import derived_dp
    from training.optimizer import PRECISIONS

    pc = cfg.parallel
    dp = derived_dp(cfg) or mesh.dp
    m = pc.global_batch // (pc.micro_batch * dp)
    kind = pc.schedule
    if mesh.pp > 1 and kind == "interleaved_1f1b" and len(chunks) < 2:
        raise ValueError("parallel.schedule=interleaved_1f1b needs parallel.vpp >= 2 model chunks per rank; "
                         "set parallel.vpp=2 or parallel.schedule=1f1b")
    check_schedule(kind, mesh.pp, len(chunks), m)
    ranks = mesh.group_ranks.get("pp") or list(range(mesh.pp))
    return PipelineSchedule(chunks, kind, mesh.pp, mesh.pp_rank, ranks, mesh.pp_group, p2p_shape(cfg),
                            PRECISIONS[cfg.train.precision], mesh.device, optimizer.scale_loss)
