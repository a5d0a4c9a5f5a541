"""Pipeline-parallel schedules: gpipe, 1f1b and interleaved_1f1b, run with batched point-to-point exchanges.

A schedule is a per-rank list of actions, F(chunk, mb) and B(chunk, mb) (`build_actions`, a pure
function): F runs a chunk forward on the activation received from the previous virtual stage (the
first virtual stage takes the token ids; the last returns the micro-batch loss), B runs it backward on
the grad received from the next virtual stage (the last backpropagates the scaled loss). The three
orders are Megatron-LM's.

Communication (`build_comm_plan`, pure): the actions are cut into units (one action each, except the
steady-state F+B pairs of interleaved_1f1b) and between two units the rank makes ONE exchange,
`dist.batch_isend_irecv` of [the sends of the previous unit's outputs] + [the receives of the next
unit's inputs], waited for before the next unit runs (Megatron's send_forward_recv_backward,
send_backward_recv_forward, ... of p2p_communication.py). Every op has tag 0. Why this shape:
  * NCCL ignores tags: the k-th send from rank a to rank b meets b's k-th receive from a. Each rank
    issues its sends in the order it produces messages and its receives in the order it consumes them;
    for the orders above the two sequences agree on every (a -> b) direction, including pp=2 where
    activations and grads share a direction (tests/engine/test_pipeline.py checks this for many (p, v, m),
    and the gloo runs, with every tag 0, would swap data and fail the equivalence tests otherwise).
  * NCCL runs a pair's P2P traffic on one stream, one exchange after another, and a send may wait for
    its receive: an exchange completes only once the peers reach the exchanges holding the matching
    ops. The exchanges above never wait on each other in a cycle (the test simulates this rule for
    every rank). Interleaved needs its steady F+B pairs as one unit (Megatron's
    send_forward_backward_recv_forward_backward): one exchange per action there deadlocks.
  * batch_isend_irecv issues a unit's sends and receives together, so neither blocks the other.
A NCCL communicator's first batch_isend_irecv must involve all its ranks: the first step starts with
an all_reduce over the pipeline group, which creates it.
Overlap (parallel.overlap_p2p, `PipelineSchedule(overlap_p2p=True)`): an exchange waits only for its
receives; its sends complete in the background while the rank computes, and are waited for at the end of
the step (their tensors are kept alive until then). On backends other than NCCL it also posts the next
exchange's receives right after this one's, so their data arrives while the next unit computes; each
direction's sends and receives keep their issue order, so tag-0 matching is unchanged. NCCL keeps the
plan's exchanges exactly (an early receive would enter NCCL's per-pair stream ahead of exchanges the
simulation above orders before it), only without waiting for its sends.
Verified here on gloo (tag-0 issue-order matching, equivalence) and, for NCCL's stream/rendezvous
rules, by that pure simulation; the test suite has no NCCL run (that needs two GPUs). pp=1 never reaches this
class (training.run.loop uses its NoPipelineSchedule), so a rank never sends to itself.

Virtual stage of local chunk c on pipeline rank r: c * p + r (model.build_gpt's order). Every message
has a fixed shape per step, [s/tp if sp else s, micro_batch, h] in the model dtype.

In-flight micro-batches (forward done, backward not yet) on rank r, which bound the activations held:
  gpipe m;  1f1b min(m, p - r);  interleaved min(m v, 2 (p - r - 1) + (v - 1) p + 1) chunk micro-batches.
The planner (launcher/plan/memory.py `inflight_microbatches`) uses the same numbers.

Each step records this rank's busy time (forward and backward compute only, not waiting or
communication) and its wall time; the pipeline's idle share, 1 - mean busy / longest wall over the
pipeline ranks, is reported next to the planner's (p - 1) / (v m + p - 1).

Tied embeddings: the last stage's copy of `embedding.word.weight` starts equal to the first stage's
(initialisation is seeded by parameter name) and its grad is all-reduced over mesh.embedding_group by
the optimizer after the last backward (training/optim/model_parallel.py), so both copies stay equal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from training.parallel import collectives as comm
from training.observe.busy_timer import BusyTimer
from training.contract.layout_rules import interleaved_batch_rules, raise_errors, schedule_rules, sequence_parallel_on
from training.contract.precision import param_dtype

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

Action = Tuple[str, int, int]
"""("F" | "B", local chunk index, micro-batch index)."""

Message = Tuple[str, int, int]
"""("act" | "grad", virtual stage that receives it, micro-batch index)."""

P2P = Tuple[str, Message, int]
"""("send" | "recv", message, peer pipeline rank)."""

Exchange = Tuple[P2P, ...]
"""One batch_isend_irecv: the sends, then the receives, of one point between two units."""


# ---- the orders (pure) ----------------------------------------------------------------------------
def check_schedule(kind: str, p: int, v: int, m: int) -> None:
    """Errors a user can cause with the schedule's shape, each naming the fix."""
    if kind not in SCHEDULES:
        raise ValueError(f"parallel.schedule={kind!r}: use one of {', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline needs pp, vpp and micro-batches >= 1 (got pp={p}, vpp={v}, m={m})")
    raise_errors(schedule_rules(kind, p, v) + interleaved_batch_rules(kind, p, m))


def _interleaved_chunk(k: int, p: int, v: int, forward: bool) -> Tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) of an interleaved rank: groups of p
    micro-batches go through chunk 0, then chunk 1, ... (Megatron's get_model_chunk_id)."""
    group, pos = divmod(k, p * v)
    chunk = pos // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + pos % p


def build_units(kind: str, p: int, rank: int, m: int, v: int = 1) -> List[List[Action]]:
    """The ordered F/B actions of pipeline rank `rank` for one step of m micro-batches, cut where the
    rank exchanges messages: one action per unit, except interleaved's steady F+B pairs."""
    check_schedule(kind, p, v, m)
    if kind == "gpipe":
        return [[("F", 0, i)] for i in range(m)] + [[("B", 0, i)] for i in range(m)]
    if kind == "1f1b":
        warm = min(p - rank - 1, m)
        out: List[List[Action]] = [[("F", 0, i)] for i in range(warm)]
        for i in range(m - warm):
            out += [[("F", 0, warm + i)], [("B", 0, i)]]
        return out + [[("B", 0, i)] for i in range(m - warm, m)]
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    fwd = [("F",) + _interleaved_chunk(k, p, v, True) for k in range(total)]
    bwd = [("B",) + _interleaved_chunk(k, p, v, False) for k in range(total)]
    out = [[a] for a in fwd[:warm]]
    out += [[fwd[warm + i], bwd[i]] for i in range(total - warm)]
    return out + [[a] for a in bwd[total - warm :]]


def build_actions(kind: str, p: int, rank: int, m: int, v: int = 1) -> List[Action]:
    """The ordered F/B actions of pipeline rank `rank` for one step of m micro-batches."""
    return [a for unit in build_units(kind, p, rank, m, v) for a in unit]


def _needs(action: Action, p: int, rank: int, v: int) -> Optional[P2P]:
    """The receive that `action` consumes (None on the first forward / last backward stage)."""
    kind, c, mb = action
    vs = c * p + rank
    if kind == "F":
        return None if vs == 0 else ("recv", ("act", vs, mb), (vs - 1) % p)
    return None if vs == p * v - 1 else ("recv", ("grad", vs, mb), (vs + 1) % p)


def _produces(action: Action, p: int, rank: int, v: int) -> Optional[P2P]:
    """The send of what `action` produces (None on the last forward / first backward stage)."""
    kind, c, mb = action
    vs = c * p + rank
    if kind == "F":
        return None if vs == p * v - 1 else ("send", ("act", vs + 1, mb), (vs + 1) % p)
    return None if vs == 0 else ("send", ("grad", vs - 1, mb), (vs - 1) % p)


def build_comm_plan(kind: str, p: int, rank: int, m: int, v: int = 1) -> List[Union[Action, Exchange]]:
    """Rank `rank`'s step: its actions with an exchange (a tuple of P2P ops, never empty) between two
    units, before the first and after the last; see the module docstring for why this order."""
    return _with_exchanges(build_units(kind, p, rank, m, v), p, rank, v)


def build_forward_plan(p: int, rank: int, m: int, v: int = 1) -> List[Union[Action, Exchange]]:
    """Evaluation's forward-only step of rank `rank`: every forward in the training order's sequence (micro-batch
    order; interleaved's chunk groups when v > 1), one per unit, with the same exchanges between units. Only
    activations travel and each rank's forwards come in order, so the exchanges form a chain (no cycle)."""
    if v == 1:
        forwards = [("F", 0, i) for i in range(m)]
    else:
        forwards = [("F",) + _interleaved_chunk(k, p, v, True) for k in range(m * v)]
    return _with_exchanges([[a] for a in forwards], p, rank, v)


def _with_exchanges(units: List[List[Action]], p: int, rank: int, v: int) -> List[Union[Action, Exchange]]:
    """The units' actions with one exchange (sends of the previous unit, receives of the next) between them."""
    out: List[Union[Action, Exchange]] = []
    prev: List[Action] = []
    for unit in units + [[]]:
        sends = [s for s in (_produces(a, p, rank, v) for a in prev) if s is not None]
        recvs = [r for r in (_needs(a, p, rank, v) for a in unit) if r is not None]
        if sends or recvs:
            out.append(tuple(sends + recvs))
        out += unit
        prev = unit
    return out


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


def storage_id(t: torch.Tensor) -> int:
    """Which storage t views: its address; on meta (a rehearsal), where every address is 0, the storage's own
    identity."""
    st = t.untyped_storage()
    return st.data_ptr() if t.device.type != "meta" else st._cdata


class _SavedBytes:
    """Counts the unique non-parameter storages that autograd saves during one forward."""

    def __init__(self, param_ptrs: set):
        self.param_ptrs, self.seen = param_ptrs, {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = storage_id(t)
        if ptr not in self.param_ptrs:
            self.seen[ptr] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


class PipelineSchedule:
    """Runs one rank's share of a pipeline step over its model chunks (virtual-stage order)."""

    def __init__(
        self,
        chunks: List[torch.nn.Module],
        kind: str,
        pp: int,
        pp_rank: int,
        pp_ranks: List[int],
        pp_group,
        p2p_shape: Tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        scale_loss: Callable[[torch.Tensor, int], torch.Tensor],
        measure_memory: bool = True,
        overlap_p2p: bool = False,
    ):
        """pp_ranks: global rank of each pipeline rank of this pipeline; scale_loss(loss, m) -> the
        tensor to backpropagate on the last stage (the optimizer's mean and loss scale); overlap_p2p:
        sends in the background and (not on NCCL) receives posted one exchange early (module docstring)."""
        self.overlap_p2p = overlap_p2p
        self.early_recv = overlap_p2p and comm.is_initialized() and comm.backend(pp_group) != "nccl"
        self.chunks, self.kind, self.p, self.rank = chunks, kind, pp, pp_rank
        self.v = len(chunks)
        self.pp_ranks, self.group = list(pp_ranks), pp_group
        self.shape, self.dtype, self.device = tuple(p2p_shape), dtype, device
        self.scale_loss, self.measure_memory = scale_loss, measure_memory
        self.stats = StepStats()
        self.num_virtual = self.p * self.v
        self._param_ptrs = {storage_id(q) for c in chunks for q in c.parameters()}
        self._group_ready = False
        check_schedule(kind, pp, self.v, max(pp, 1) if kind == "interleaved_1f1b" else 1)

    # -- topology --
    def _vstage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- the step --
    def forward_backward(self, micro_batches: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean micro-batch loss on the last
        stage (detached fp32; zero elsewhere). Grads accumulate through the optimizer's hooks."""
        m = len(micro_batches)
        plan = build_comm_plan(self.kind, self.p, self.rank, m, self.v)
        last_v = self.num_virtual - 1
        held: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor, int]] = {}
        outbox: Dict[Message, torch.Tensor] = {}  # produced, sent at the next exchange
        inbox: Dict[Message, torch.Tensor] = {}  # received, consumed by the next unit
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        st = StepStats()
        live_bytes = 0
        if self.p > 1 and not self._group_ready:
            # A NCCL communicator's first batch_isend_irecv must involve all of its ranks; a collective
            # creates it (and is harmless on gloo).
            comm.all_reduce_op(torch.zeros(1, device=self.device), group=self.group)
            self._group_ready = True
        self._sync()
        t_start = time.perf_counter()
        busy = BusyTimer(self.device)  # CUDA: events on the compute stream, no device-wide sync per unit
        exchanger = _Exchanger(self, plan)
        for step in plan:
            if isinstance(step[0], tuple):
                exchanger.exchange(outbox, inbox)
                continue
            kind, c, mb = step
            vs = self._vstage(c)
            if kind == "F":
                tokens, targets = micro_batches[mb]
                if vs == 0:
                    x, inp = tokens.to(self.device), None
                else:
                    inp = inbox.pop(("act", vs, mb)).requires_grad_(True)
                    x = inp
                counter = _SavedBytes(self._param_ptrs)
                busy.start()
                if self.measure_memory:
                    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                        out = self._forward(c, x, targets if vs == last_v else None)
                else:
                    out = self._forward(c, x, targets if vs == last_v else None)
                busy.stop()
                if vs == last_v:
                    total += out.detach().float()
                else:
                    outbox[("act", vs + 1, mb)] = out.detach().contiguous()
                held[(c, mb)] = (inp, out, counter.total)
                live_bytes += counter.total
                st.saved_bytes_per_forward.append(counter.total)
                st.peak_saved_bytes = max(st.peak_saved_bytes, live_bytes)
                st.peak_in_flight = max(st.peak_in_flight, len(held))
            else:
                inp, out, nbytes = held.pop((c, mb))
                grad_out = None if vs == last_v else inbox.pop(("grad", vs, mb))
                busy.start()
                if grad_out is None:
                    self.scale_loss(out.float(), m).backward()
                else:
                    torch.autograd.backward(out, grad_tensors=grad_out)
                busy.stop()
                live_bytes -= nbytes
                if vs > 0:
                    outbox[("grad", vs - 1, mb)] = inp.grad.contiguous()
                del inp, out, grad_out
        exchanger.finish()
        assert not outbox and not inbox, "every message of the plan is sent and consumed"
        self._sync()  # once per step: the wall clock ends when this rank's queued work has
        st.wall_s = time.perf_counter() - t_start
        st.busy_s = busy.seconds()
        st.idle_share = max(0.0, 1.0 - st.busy_s / st.wall_s) if st.wall_s > 0 else 0.0
        # The pipeline's wall clock is the longest rank's (a rank that finishes early idles until the
        # step ends); ranks start together, synchronised by the previous step's collectives.
        busy = torch.tensor([st.busy_s], dtype=torch.float64, device=self.device)
        wall = torch.tensor([st.wall_s], dtype=torch.float64, device=self.device)
        if self.p > 1:
            comm.all_reduce_op(busy, group=self.group)
            comm.all_reduce_op(wall, group=self.group, op=comm.ReduceOp.MAX)
        st.idle_share_mean = max(0.0, 1.0 - comm.value(busy, 0.0) / self.p / comm.value(wall, 1.0))
        self.stats = st
        self.last_m = m
        return total / m

    @torch.no_grad()
    def forward_only(self, micro_batches: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Evaluation: forwards of every micro-batch through the pipeline, no graph, no backward; returns the
        mean micro-batch loss on the last stage (detached fp32; zero elsewhere)."""
        m = len(micro_batches)
        last_v = self.num_virtual - 1
        outbox: Dict[Message, torch.Tensor] = {}
        inbox: Dict[Message, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.p > 1 and not self._group_ready:
            comm.all_reduce_op(torch.zeros(1, device=self.device), group=self.group)  # see forward_backward
            self._group_ready = True
        plan = build_forward_plan(self.p, self.rank, m, self.v)
        exchanger = _Exchanger(self, plan)
        for step in plan:
            if isinstance(step[0], tuple):
                exchanger.exchange(outbox, inbox)
                continue
            _, c, mb = step
            vs = self._vstage(c)
            tokens, targets = micro_batches[mb]
            x = tokens.to(self.device) if vs == 0 else inbox.pop(("act", vs, mb))
            out = self._forward(c, x, targets if vs == last_v else None)
            if vs == last_v:
                total += out.float()
            else:
                outbox[("act", vs + 1, mb)] = out.contiguous()
        exchanger.finish()
        assert not outbox and not inbox, "every message of the plan is sent and consumed"
        return total / m

    def _forward(self, c: int, x: torch.Tensor, targets: Optional[torch.Tensor]) -> torch.Tensor:
        if targets is not None:
            return self.chunks[c](x, targets.to(self.device))
        return self.chunks[c](x)

    def metrics(self) -> Dict[str, float]:
        """Fields for the metrics line: measured idle share (mean over stages) next to the plan's."""
        return {
            "bubble_measured": round(self.stats.idle_share_mean, 4),
            "bubble_planned": round(planned_idle_share(self.p, getattr(self, "last_m", 1), self.v), 4),
        }


class _Exchanger:
    """Runs one step's exchanges in plan order: each is one batch_isend_irecv (tag 0: matching is by issue
    order, as on NCCL). Without overlap every op is waited for before the next unit runs; with it only the
    receives are, and (early_recv) the next exchange's receives are posted together with this one's ops."""

    def __init__(self, sched: "PipelineSchedule", plan: List[Union[Action, Exchange]]):
        self.s = sched
        self.exchanges: List[Exchange] = [step for step in plan if isinstance(step[0], tuple)]
        self.k = 0  # index of the next exchange
        self.posted: Dict[Message, object] = {}  # receives posted early: message -> work
        self.sends: List[Tuple[object, torch.Tensor]] = []  # (work, tensor) not yet waited for

    def _recv_op(self, msg: Message, peer: int, inbox: Dict) -> "comm.P2POp":
        s = self.s
        buf = torch.empty(s.shape, dtype=s.dtype, device=s.device)
        inbox[msg] = buf
        return comm.recv_op(buf, s.pp_ranks[peer], s.group)

    def exchange(self, outbox: Dict, inbox: Dict) -> None:
        s, ops = self.s, self.exchanges[self.k]
        self.k += 1
        batch, kinds = [], []  # kinds: ("send", tensor) | ("recv", msg) | ("early", msg) per op
        for direction, msg, peer in ops:
            if direction == "send":
                t = outbox.pop(msg)
                batch.append(comm.send_op(t, s.pp_ranks[peer], s.group))
                kinds.append(("send", t))
            elif msg not in self.posted:
                batch.append(self._recv_op(msg, peer, inbox))
                kinds.append(("recv", msg))
        if s.early_recv and self.k < len(self.exchanges):
            for direction, msg, peer in self.exchanges[self.k]:
                if direction == "recv":
                    batch.append(self._recv_op(msg, peer, inbox))
                    kinds.append(("early", msg))
        works = comm.batch_isend_irecv(batch) if batch else []
        if not s.overlap_p2p or len(works) != len(batch):
            for work in works:  # the plain path (or a backend that returns one work for the batch)
                work.wait()
            for (kind, msg), work in zip(kinds, works):
                if kind == "early":
                    self.posted[msg] = None  # already complete
            return
        for (kind, what), work in zip(kinds, works):
            if kind == "send":
                self.sends.append((work, what))
            elif kind == "recv":
                work.wait()
            else:
                self.posted[what] = work
        for direction, msg, _ in ops:  # this exchange's receives posted one exchange ago
            if direction == "recv" and msg in self.posted:
                work = self.posted.pop(msg)
                if work is not None:
                    work.wait()

    def finish(self) -> None:
        """Wait for the sends still in flight (their tensors live until then)."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        assert not self.posted, "every early receive belongs to a later exchange of the step"


def p2p_shape(cfg) -> Tuple[int, int, int]:
    """Shape of every activation / gradient message: [s/tp if sp else s, micro_batch, h], s this cp rank's tokens."""
    s, tp = cfg.model.seq_length // max(1, getattr(cfg.parallel, "cp", 1)), cfg.parallel.tp
    if sequence_parallel_on(cfg.parallel.sp, tp):
        s //= tp
    return (s, cfg.parallel.micro_batch, cfg.model.hidden_size)


def make_pipeline_schedule(cfg, mesh, chunks, optimizer) -> PipelineSchedule:
    """The schedule training.run.loop uses when pp > 1 (parallel.schedule picks the order)."""
    from training.contract.config import derived_dp

    pc = cfg.parallel
    dp = derived_dp(cfg) or mesh.dp
    m = pc.global_batch // (pc.micro_batch * dp)
    kind = pc.schedule
    check_schedule(kind, mesh.pp, len(chunks), m)  # len(chunks): the vpp this rank really built
    ranks = mesh.group_ranks.get("pp") or list(range(mesh.pp))
    return PipelineSchedule(
        chunks,
        kind,
        mesh.pp,
        mesh.pp_rank,
        ranks,
        mesh.pp_group,
        p2p_shape(cfg),
        param_dtype(cfg.train.precision),
        mesh.device,
        optimizer.scale_loss,
        overlap_p2p=getattr(pc, "overlap_p2p", True),
    )
