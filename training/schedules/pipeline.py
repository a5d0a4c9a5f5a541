"""Pipeline-parallel schedules: gpipe, 1f1b, interleaved_1f1b and zb_h1, run with batched point-to-point exchanges.

A schedule is a per-rank list of actions, F(chunk, mb) and B(chunk, mb) (`build_actions`, a pure
function): F runs a chunk forward on the activation received from the previous virtual stage (the
first virtual stage takes the token ids; the last returns the micro-batch loss), B runs it backward on
the grad received from the next virtual stage (the last backpropagates the scaled loss). gpipe, 1f1b and
interleaved are Megatron-LM's orders (interleaved: Megatron-Core's schedule table, micro-batch groups of
parallel.microbatch_group_size, 0 = pp; groups other than pp exchange differently, see Communication). zb_h1 (ZB-H1, Qi
et al. 2024) is 1f1b with each B computing only the input grad (torch.autograd.grad with retain_graph; the
grads reaching the weights' start nodes kept by node pre-hooks) and a W action later computing the weight
grads from them (torch.autograd.backward with inputs=, so the optimizer's grad hooks run): rank r defers r
W's, filling the cool-down where 1f1b idles; the first stage, with no input grad to hurry, runs its whole
backward at B. W needs no communication.

Output deallocation (Megatron's deallocate_pipeline_outputs): a non-last stage keeps only its output's
autograd edge (torch.autograd.graph.get_gradient_edge) and backward starts there; the output's storage is
referenced by its outgoing message alone, which the exchanger keeps until the send is known complete (waited,
or is_completed), so no stage output lives from its send to its backward.

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
Interleaved with micro-batch groups g != pp (pp < g <= m) cannot use these units: their exchanges wait on each
other in a cycle, or (pp = 2) pair messages out of issue order (tests/engine/test_pipeline.py walks every case).
There `_round_plans` walks the whole pipeline in lock-step rounds (each rank runs its next action when its input
has arrived) and puts every message in the exchanges, the sender's and the receiver's, of the round after the one
that made it: matched ops always share a round, so no cycle can form, and each direction lists a round's
messages in one order. A rank may then make several exchanges between two actions, and a received message
may wait in its buffer for its action (the in-flight counts, set by the order, do not change).
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
class (make_schedule picks training/schedules/no_pipeline.py's NoPipelineSchedule), so a rank never sends to itself.

Virtual stage of local chunk c on pipeline rank r: c * p + r (model.build_gpt's order). Every message
has a fixed shape per step, [s/tp if sp else s, micro_batch, h] in the model dtype.

In-flight micro-batches (forward done, backward not yet) on rank r, which bound the activations held:
  gpipe m;  1f1b min(m, p - r);  interleaved min(m v, 2 (p - r - 1) + (v - 1) g + 1) chunk micro-batches
  (g the group, pp by default);  zb_h1 min(m, p) (graphs kept until W).
The planner (launcher/plan/memory.py `inflight_microbatches`) uses the same numbers.

Each step records this rank's busy time (forward and backward compute only, not waiting or
communication) and its wall time; the pipeline's idle share, 1 - mean busy / longest wall over the
pipeline ranks, is reported next to the planner's (p - 1) / (v m + p - 1), zb_h1's (p - 1)/(3 m + p - 1) at
m >= p (planned_idle_share; docs/FORMULAS.md; W counts as busy).

Tied embeddings: the last stage's copy of `embedding.word.weight` starts equal to the first stage's
(initialisation is seeded by parameter name) and its grad is all-reduced over mesh.embedding_group by
the optimizer after the last backward (training/optim/model_parallel.py), so both copies stay equal.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from training.contract.layout_rules import (
    interleaved_batch_rules,
    raise_errors,
    schedule_rules,
    sequence_parallel_on,
)
from training.contract.precision import param_dtype
from training.observe.busy_timer import BusyTimer
from training.parallel import collectives as comm

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")

Action = tuple[str, int, int]
"""("F" | "B" | "W", local chunk index, micro-batch index); W (zb_h1 only): the weight grads of a B that
computed only the input grad."""

Message = tuple[str, int, int]
"""("act" | "grad", virtual stage that receives it, micro-batch index)."""

P2P = tuple[str, Message, int]
"""("send" | "recv", message, peer pipeline rank)."""

Exchange = tuple[P2P, ...]
"""One batch_isend_irecv: the sends, then the receives, of one point between two units."""


# ---- the orders (pure) ----------------------------------------------------------------------------
def check_schedule(kind: str, p: int, v: int, m: int, group: int = 0) -> None:
    """Errors a user can cause with the schedule's shape, each naming the fix."""
    if kind not in SCHEDULES:
        raise ValueError(f"parallel.schedule={kind!r}: use one of {', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline needs pp, vpp and micro-batches >= 1 (got pp={p}, vpp={v}, m={m})")
    raise_errors(schedule_rules(kind, p, v) + interleaved_batch_rules(kind, p, m, group=group))


def group_size(p: int, group: int) -> int:
    """The interleaved schedule's micro-batch group size: parallel.microbatch_group_size, 0 meaning pp."""
    return group or p


def _interleaved_table(p: int, v: int, m: int, group: int = 0) -> list[tuple[int, int]]:
    """(chunk, micro-batch) of an interleaved rank's forwards in order: groups of g micro-batches (the last
    group the m mod g left over) go through chunk 0, then chunk 1, ... (Megatron-Core's get_schedule_table
    with microbatch_group_size_per_vp_stage = g). The k-th backward is the k-th entry with chunk v - 1 - chunk."""
    g = group_size(p, group)
    out: list[tuple[int, int]] = []
    for start in range(0, m, g):
        end = m if start + g >= m else start + g
        out += [(c, mb) for c in range(v) for mb in range(start, end)]
    return out


def build_units(kind: str, p: int, rank: int, m: int, v: int = 1, group: int = 0) -> list[list[Action]]:
    """The ordered F/B (and zb_h1's W) actions of pipeline rank `rank` for one step of m micro-batches, cut
    where the rank exchanges messages: one action per unit, except interleaved's steady F+B pairs (with micro-batch
    groups other than pp only the order counts: build_comm_plan places those exchanges by rounds)."""
    check_schedule(kind, p, v, m, group)
    if kind == "gpipe":
        return [[("F", 0, i)] for i in range(m)] + [[("B", 0, i)] for i in range(m)]
    if kind in ("1f1b", "zb_h1"):
        warm = min(p - rank - 1, m)
        order: list[Action] = [("F", 0, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", 0, warm + i), ("B", 0, i)]
        order += [("B", 0, i) for i in range(m - warm, m)]
        if kind == "zb_h1":
            order = _zero_bubble_h1(order, rank)
        return [[a] for a in order]
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * group_size(p, group), total)
    table = _interleaved_table(p, v, m, group)
    fwd = [("F", c, mb) for c, mb in table]
    bwd = [("B", v - 1 - c, mb) for c, mb in table]
    out = [[a] for a in fwd[:warm]]
    out += [[fwd[warm + i], bwd[i]] for i in range(total - warm)]
    return out + [[a] for a in bwd[total - warm :]]


def _zero_bubble_h1(order: list[Action], rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3): 1f1b's order with each backward
    split into B (input grad, sent on at once) and W (weight grad). Rank r defers the W of its first r
    micro-batches: after its j-th B it runs the oldest pending W only when j >= r, and the deferred ones after
    its last B, where they fill the time 1f1b's rank r spends waiting for grads (torch.distributed.pipelining's
    _get_1f1b_rank_ops with enable_zero_bubble and r 1f1b micro-batches builds the same order). At most r + 1
    micro-batches wait for their W, while rank r holds p - r forwards at most: the peak of every rank stays
    1f1b's p of the first rank."""
    out: list[Action] = []
    pending: list[Action] = []
    j = 0
    for a in order:
        out.append(a)
        if a[0] == "B":
            pending.append(("W", a[1], a[2]))
            if j >= rank:
                out.append(pending.pop(0))
            j += 1
    return out + pending


def build_actions(kind: str, p: int, rank: int, m: int, v: int = 1, group: int = 0) -> list[Action]:
    """The ordered F/B (W) actions of pipeline rank `rank` for one step of m micro-batches."""
    return [a for unit in build_units(kind, p, rank, m, v, group) for a in unit]


def _needs(action: Action, p: int, rank: int, v: int) -> P2P | None:
    """The receive that `action` consumes (None on the first forward / last backward stage)."""
    kind, c, mb = action
    vs = c * p + rank
    if kind == "W":
        return None
    if kind == "F":
        return None if vs == 0 else ("recv", ("act", vs, mb), (vs - 1) % p)
    return None if vs == p * v - 1 else ("recv", ("grad", vs, mb), (vs + 1) % p)


def _produces(action: Action, p: int, rank: int, v: int) -> P2P | None:
    """The send of what `action` produces (None on the last forward / first backward stage)."""
    kind, c, mb = action
    vs = c * p + rank
    if kind == "W":
        return None
    if kind == "F":
        return None if vs == p * v - 1 else ("send", ("act", vs + 1, mb), (vs + 1) % p)
    return None if vs == 0 else ("send", ("grad", vs - 1, mb), (vs - 1) % p)


def build_comm_plan(kind: str, p: int, rank: int, m: int, v: int = 1, group: int = 0) -> list[Action | Exchange]:
    """Rank `rank`'s step: its actions with exchanges (tuples of P2P ops, never empty) between them; see the
    module docstring for why this order. Interleaved with micro-batch groups other than pp: `_round_plans`."""
    if kind == "interleaved_1f1b" and group_size(p, group) != p:
        check_schedule(kind, p, v, m, group)
        return list(_round_plans(p, m, v, group)[rank])
    return _with_exchanges(build_units(kind, p, rank, m, v, group), p, rank, v)


@functools.lru_cache(maxsize=64)
def _round_plans(p: int, m: int, v: int, group: int) -> tuple[tuple[Action | Exchange, ...], ...]:
    """Every rank's plan for interleaved with micro-batch groups g != pp, from a lock-step walk of the whole
    pipeline: in round t each rank runs its next action if its input has arrived, then every message made in
    round t goes in round t + 1's exchanges, the sender's and the receiver's (a rank without ops in a round has
    no exchange there). Each exchange holds the sends, then the receives, sorted by (peer, message), so both ends
    of a direction list a round's messages in one order; rounds order the rest. Deadlock-free under NCCL's
    rules: a round-t op's match is in the peer's round-t exchange, so by induction on t every exchange completes
    whatever the real timing. The cost: a received message may wait for its action (one [s, b, h] buffer each),
    where the unit plan's rendezvous makes the sender wait instead, which for g > pp waits in a cycle
    (tests/engine/test_pipeline.py shows both)."""
    actions = [build_actions("interleaved_1f1b", p, r, m, v, group) for r in range(p)]
    plans: list[list[Action | Exchange]] = [[] for _ in range(p)]
    pos, arrived = [0] * p, [set() for _ in range(p)]
    made: list[tuple[int, P2P]] = []
    while made or any(pos[r] < len(actions[r]) for r in range(p)):
        ops: list[list[P2P]] = [[] for _ in range(p)]
        for r, send in sorted(made, key=lambda x: (x[0], x[1][2], x[1][1])):
            ops[r].append(send)
        for r, (_, msg, peer) in sorted(made, key=lambda x: (x[1][2], x[0], x[1][1])):
            ops[peer].append(("recv", msg, r))
            arrived[peer].add(msg)
        for r in range(p):
            if ops[r]:
                plans[r].append(tuple(ops[r]))
        made, ran = [], False
        for r in range(p):
            if pos[r] == len(actions[r]):
                continue
            action = actions[r][pos[r]]
            need = _needs(action, p, r, v)
            if need is None or need[1] in arrived[r]:
                if need is not None:
                    arrived[r].discard(need[1])
                plans[r].append(action)
                pos[r] += 1
                ran = True
                out = _produces(action, p, r, v)
                if out is not None:
                    made.append((r, out))
        if not ran and not made and any(pos[r] < len(actions[r]) for r in range(p)):
            raise AssertionError(f"interleaved p={p} v={v} m={m} g={group}: the order waits on itself")
    return tuple(tuple(plan) for plan in plans)


def build_forward_plan(p: int, rank: int, m: int, v: int = 1, group: int = 0) -> list[Action | Exchange]:
    """Evaluation's forward-only step of rank `rank`: every forward in the training order's sequence (micro-batch
    order; interleaved's chunk groups when v > 1), one per unit, with the same exchanges between units. Only
    activations travel and each rank's forwards come in order, so the exchanges form a chain (no cycle)."""
    if v == 1:
        forwards = [("F", 0, i) for i in range(m)]
    else:
        forwards = [("F", c, mb) for c, mb in _interleaved_table(p, v, m, group)]
    return _with_exchanges([[a] for a in forwards], p, rank, v)


def _with_exchanges(units: list[list[Action]], p: int, rank: int, v: int) -> list[Action | Exchange]:
    """The units' actions with one exchange (sends of the previous unit, receives of the next) between them."""
    out: list[Action | Exchange] = []
    prev: list[Action] = []
    for unit in units + [[]]:
        sends = [s for s in (_produces(a, p, rank, v) for a in prev) if s is not None]
        recvs = [r for r in (_needs(a, p, rank, v) for a in unit) if r is not None]
        if sends or recvs:
            out.append(tuple(sends + recvs))
        out += unit
        prev = unit
    return out


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most (chunk, micro-batch) forwards whose backward has not run yet (with W actions: whose W has not),
    over the action list: their autograd graphs are held."""
    split = any(kind == "W" for kind, _, _ in actions)
    live = peak = 0
    for kind, _, _ in actions:
        live += 1 if kind == "F" else (-1 if kind == ("W" if split else "B") else 0)
        peak = max(peak, live)
    return peak


def planned_idle_share(
    p: int, m: int, v: int = 1, kind: str = "1f1b", group: int = 0, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
) -> float:
    """The planner's idle share of wall clock (launcher/plan/estimate.py `bubble`, docs/FORMULAS.md):
    (p - 1) / (v m + p - 1) for gpipe, 1f1b and interleaved (any micro-batch group); zb_h1, with t_f, t_b, t_w
    the forward, input-grad and weight-grad times of a micro-batch (the planner's backward is two forwards, one
    of each: 1, 1, 1), idles (p - 1)(t_f + t_b - t_w) per rank (Qi et al. 2024, section 3.1) beside
    m (t_f + t_b + t_w) of work."""
    if kind == "zb_h1":
        work = m * (t_f + t_b + t_w)
        # m < p: the last micro-batch's forward and input-grad chains, then one W, are the critical path.
        wall = max(work + (p - 1) * max(t_f + t_b - t_w, t_f, t_b), (p + m - 1) * (t_f + t_b) + t_w)
        return 1.0 - work / wall
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
    saved_bytes_per_forward: list[int] = field(default_factory=list)
    """Bytes saved by each forward, in action order."""
    peak_outputs_alive: int = 0
    """Most earlier stage outputs (the tensors a forward returned, not the last stage's loss) still alive when a
    forward returns: 0 with output deallocation, where only the autograd edge of an output is kept."""
    peak_message_bytes: int = 0
    """Most bytes of outgoing messages the schedule references at once (waiting for their exchange, or sent and
    not yet known complete): the only references that keep a stage output's storage alive."""


class _StepState:
    """One forward_backward's bookkeeping, shared by its units."""

    def __init__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], total: torch.Tensor, busy: BusyTimer):
        self.micro_batches, self.total, self.busy = micro_batches, total, busy
        # (chunk, mb) -> (input, the last stage's loss or the autograd edge of the stage output, saved bytes)
        self.held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | GradientEdge, int]] = {}
        self.waiting_w: dict[tuple[int, int], tuple[list[_WeightGroup], int]] = {}  # zb_h1: B done, W not yet
        self.outputs: list[weakref.ref] = []  # every stage output of the step (output deallocation's measurement)
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, sent at the next exchange
        self.inbox: dict[Message, torch.Tensor] = {}  # received, consumed by the next unit
        self.stats = StepStats()
        self.live_bytes = 0


def storage_id(t: torch.Tensor) -> int:
    """Which storage t views: its address; on meta (a rehearsal), where every address is 0, the storage's own
    identity."""
    st = t.untyped_storage()
    return st.data_ptr() if t.device.type != "meta" else st._cdata


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages t keeps alive: a wrapper subclass's (torchao's float8 tensors, whose own storage
    is no real one) inner tensors."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        return [x for name in t.__tensor_flatten__()[0] for x in _inner_tensors(getattr(t, name))]
    return [t]


class _SavedBytes:
    """Counts the unique non-parameter storages that autograd saves during one forward."""

    def __init__(self, param_ptrs: set):
        self.param_ptrs, self.seen = param_ptrs, {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for inner in _inner_tensors(t):
            ptr = storage_id(inner)
            if ptr not in self.param_ptrs:
                self.seen[ptr] = inner.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


class PipelineSchedule:
    """Runs one rank's share of a pipeline step over its model chunks (virtual-stage order)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        kind: str,
        pp: int,
        pp_rank: int,
        pp_ranks: list[int],
        pp_group,
        p2p_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        scale_loss: Callable[[torch.Tensor, int], torch.Tensor],
        measure_memory: bool = True,
        overlap_p2p: bool = False,
        microbatch_group_size: int = 0,
    ):
        """pp_ranks: global rank of each pipeline rank of this pipeline; scale_loss(loss, m) -> the
        tensor to backpropagate on the last stage (the optimizer's mean and loss scale); overlap_p2p:
        sends in the background and (not on NCCL) receives posted one exchange early (module docstring);
        microbatch_group_size: interleaved_1f1b's micro-batch group (0: pp)."""
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
        # parallel.fp8_all_gather: the float8 storage zero=3 gathers a weight into is model state too (zero3.py)
        self._param_ptrs |= {
            storage_id(q.fp8_storage) for c in chunks for q in c.parameters() if hasattr(q, "fp8_storage")
        }
        self._group_ready = False
        self.mb_group = microbatch_group_size
        m_min = max(pp, microbatch_group_size, 1) if kind == "interleaved_1f1b" else 1
        check_schedule(kind, pp, self.v, m_min, microbatch_group_size)

    # -- topology --
    def _vstage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _ensure_group(self) -> None:
        if self.p > 1 and not self._group_ready:
            # A NCCL communicator's first batch_isend_irecv must involve all of its ranks; a collective
            # creates it (and is harmless on gloo).
            comm.all_reduce_op(torch.zeros(1, device=self.device), group=self.group)
            self._group_ready = True

    def _walk(
        self,
        plan: list[Action | Exchange],
        unit: Callable[[str, int, int], None],
        outbox: dict[Message, torch.Tensor],
        inbox: dict[Message, torch.Tensor],
        after_exchange: Callable[[_Exchanger], None] | None = None,
    ) -> None:
        """Runs a plan in order: each exchange through one _Exchanger (what the units put in `outbox` goes out,
        what arrives lands in `inbox`), each unit as unit(kind, chunk, micro-batch)."""
        exchanger = _Exchanger(self, plan)
        for step in plan:
            if isinstance(step[0], tuple):
                exchanger.exchange(outbox, inbox)
                if after_exchange is not None:
                    after_exchange(exchanger)
                continue
            kind, c, mb = step
            unit(kind, c, mb)
        exchanger.finish()
        assert not outbox and not inbox, "every message of the plan is sent and consumed"

    # -- the step --
    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean micro-batch loss on the last
        stage (detached fp32; zero elsewhere). Grads accumulate through the optimizer's hooks."""
        m = len(micro_batches)
        plan = build_comm_plan(self.kind, self.p, self.rank, m, self.v, self.mb_group)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._ensure_group()
        self._sync()
        t_start = time.perf_counter()
        # CUDA: events on the compute stream, no device-wide sync per unit
        step = _StepState(micro_batches, total, BusyTimer(self.device))
        units = {"F": self._forward_unit, "B": self._backward_unit, "W": self._weight_unit}

        def note_messages(exchanger: _Exchanger) -> None:
            st = step.stats
            st.peak_message_bytes = max(st.peak_message_bytes, exchanger.message_bytes(step.outbox))

        self._walk(plan, lambda kind, c, mb: units[kind](step, c, mb), step.outbox, step.inbox, note_messages)
        assert not step.held and not step.waiting_w, "every forward has had its backward (and W)"
        self._sync()  # once per step: the wall clock ends when this rank's queued work has
        self._finish_stats(step.stats, step.busy, t_start)
        self.last_m = m
        return step.total / m

    def _forward_unit(self, step: _StepState, c: int, mb: int) -> None:
        """F: one chunk's forward of one micro-batch; its output goes to the outbox (or its loss to the total)."""
        st, vs, last_v = step.stats, self._vstage(c), self.num_virtual - 1
        tokens, targets = step.micro_batches[mb]
        if vs == 0:
            x, inp = tokens.to(self.device), None
        else:
            inp = step.inbox.pop(("act", vs, mb)).requires_grad_(True)
            x = inp
        counter = _SavedBytes(self._param_ptrs)
        step.busy.start()
        if self.measure_memory:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                out = self._forward(c, x, targets if vs == last_v else None)
        else:
            out = self._forward(c, x, targets if vs == last_v else None)
        step.busy.stop()
        if vs == last_v:
            step.total += out.detach().float()
            step.held[(c, mb)] = (inp, out, counter.total)
        else:
            # Output deallocation (Megatron's deallocate_pipeline_outputs): the message is the output's
            # storage and the step keeps only the output's autograd edge, so the storage lives as long
            # as the message does (until its send has completed: _Exchanger), not until backward.
            # Backward starts at the edge with the received grad (shape-checked against the graph).
            step.outbox[("act", vs + 1, mb)] = out.detach().contiguous()
            step.held[(c, mb)] = (inp, get_gradient_edge(out), counter.total)
            st.peak_outputs_alive = max(st.peak_outputs_alive, sum(1 for r in step.outputs if r() is not None))
            step.outputs.append(weakref.ref(out))
        del out
        step.live_bytes += counter.total
        st.saved_bytes_per_forward.append(counter.total)
        st.peak_saved_bytes = max(st.peak_saved_bytes, step.live_bytes)
        st.peak_in_flight = max(st.peak_in_flight, len(step.held) + len(step.waiting_w))

    def _backward_unit(self, step: _StepState, c: int, mb: int) -> None:
        """B: one chunk's backward of one micro-batch (zb_h1: the input grad only, its W kept for later); the
        input grad goes to the outbox."""
        vs = self._vstage(c)
        inp, root, nbytes = step.held.pop((c, mb))
        grad_out = None if vs == self.num_virtual - 1 else step.inbox.pop(("grad", vs, mb))
        step.busy.start()
        if isinstance(root, torch.Tensor):
            root = self.scale_loss(root.float(), len(step.micro_batches))  # the last stage: the scaled loss
        if self.kind == "zb_h1" and inp is not None:
            grad_in, groups = _input_pass(root, grad_out, inp, self.chunks[c])
            step.waiting_w[(c, mb)] = (groups, nbytes)
        else:  # the whole backward (zb_h1's first stage has no input grad to hurry: its W is empty)
            torch.autograd.backward(root, grad_tensors=grad_out)
            grad_in = None if inp is None else inp.grad
            if self.kind == "zb_h1":
                step.waiting_w[(c, mb)] = ([], nbytes)
            else:
                step.live_bytes -= nbytes
        step.busy.stop()
        if vs > 0:
            assert grad_in is not None
            step.outbox[("grad", vs - 1, mb)] = grad_in.contiguous()

    def _weight_unit(self, step: _StepState, c: int, mb: int) -> None:
        """W (zb_h1): the weight grads a B left for later."""
        groups, nbytes = step.waiting_w.pop((c, mb))
        step.busy.start()
        _weight_pass(groups)
        step.busy.stop()
        step.live_bytes -= nbytes

    def _finish_stats(self, st: StepStats, busy: BusyTimer, t_start: float) -> None:
        """This rank's busy and wall time, and the pipeline's idle share over its ranks, into self.stats."""
        st.wall_s = time.perf_counter() - t_start
        st.busy_s = busy.seconds()
        st.idle_share = max(0.0, 1.0 - st.busy_s / st.wall_s) if st.wall_s > 0 else 0.0
        # The pipeline's wall clock is the longest rank's (a rank that finishes early idles until the
        # step ends); ranks start together, synchronised by the previous step's collectives.
        busy_t = torch.tensor([st.busy_s], dtype=torch.float64, device=self.device)
        wall = torch.tensor([st.wall_s], dtype=torch.float64, device=self.device)
        if self.p > 1:
            comm.all_reduce_op(busy_t, group=self.group)
            comm.all_reduce_op(wall, group=self.group, op=comm.ReduceOp.MAX)
        st.idle_share_mean = max(0.0, 1.0 - comm.value(busy_t, 0.0) / self.p / comm.value(wall, 1.0))
        self.stats = st

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Evaluation: forwards of every micro-batch through the pipeline, no graph, no backward; returns the
        mean micro-batch loss on the last stage (detached fp32; zero elsewhere)."""
        m = len(micro_batches)
        last_v = self.num_virtual - 1
        outbox: dict[Message, torch.Tensor] = {}
        inbox: dict[Message, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._ensure_group()
        plan = build_forward_plan(self.p, self.rank, m, self.v)

        def forward(_kind: str, c: int, mb: int) -> None:
            nonlocal total
            vs = self._vstage(c)
            tokens, targets = micro_batches[mb]
            x = tokens.to(self.device) if vs == 0 else inbox.pop(("act", vs, mb))
            out = self._forward(c, x, targets if vs == last_v else None)
            if vs == last_v:
                total += out.float()
            else:
                outbox[("act", vs + 1, mb)] = out.contiguous()

        self._walk(plan, forward, outbox, inbox)
        return total / m

    def _forward(self, c: int, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        if targets is not None:
            return self.chunks[c](x, targets.to(self.device))
        return self.chunks[c](x)

    def metrics(self) -> dict[str, float]:
        """Fields for the metrics line: measured idle share (mean over stages) next to the plan's."""
        return {
            "bubble_measured": round(self.stats.idle_share_mean, 4),
            "bubble_planned": round(
                planned_idle_share(self.p, getattr(self, "last_m", 1), self.v, self.kind, self.mb_group), 4
            ),
        }


def _completed(work) -> bool:
    """A send's work has completed (its buffer may be freed); a backend without the query: not known yet."""
    try:
        return bool(work.is_completed())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# ---- zb_h1's split backward (public autograd APIs) ----------------------------------------------------
@dataclass
class _WeightGroup:
    """Parameters whose weight grads start at the same nodes of the input-grad path ("intermediates": the
    nodes, matmuls and norms, that take both an activation and a parameter), with the grads that reached
    those nodes during B."""

    params: list[torch.Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


def _grad_node(t: torch.Tensor) -> Node | None:
    """The node autograd sends t's grad to: grad_fn, or a leaf's AccumulateGrad (reached through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _weight_groups(root: Node, inp: torch.Tensor, params: list[torch.Tensor]) -> list[_WeightGroup]:
    """Split the graph under `root`: the nodes from which the stage input is reached (B runs them), and for
    each parameter the nodes of that set where its own branch starts (W runs from there). Parameters sharing
    such a node form one group. The method of torch.distributed.pipelining's stage_backward_input, on
    torch.autograd.graph's public Node API."""
    users: dict[Node, list[Node]] = {root: []}
    todo = [root]
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in users:
                users[nxt] = []
                todo.append(nxt)
            users[nxt].append(node)
    inp_node = _grad_node(inp)
    on_path: set[Node] = set()
    todo = [inp_node] if inp_node in users else []
    while todo:  # every node above the input
        node = todo.pop()
        if node not in on_path:
            on_path.add(node)
            todo += users[node]
    by_node: dict[Node, _WeightGroup] = {}
    for param in params:
        acc = _grad_node(param)
        if acc not in users:
            continue  # not used by this forward
        seen: set[Node] = {acc}
        starts: set[Node] = set()
        todo = [acc]
        while todo:  # up from the parameter until the input's path
            for user in users[todo.pop()]:
                if user in on_path:
                    starts.add(user)
                elif user not in seen:
                    seen.add(user)
                    todo.append(user)
        group = _WeightGroup([param], sorted(starts, key=id))
        for node in starts:  # merge with the groups that share a start node
            other = by_node.get(node)
            if other is not None and other is not group:
                group.params += [q for q in other.params if all(q is not x for x in group.params)]
                group.nodes += [n for n in other.nodes if n not in group.nodes]
                for n in other.nodes:
                    by_node[n] = group
            by_node[node] = group
    unique: dict[int, _WeightGroup] = {id(g): g for g in by_node.values()}
    return list(unique.values())


def _input_pass(
    root: torch.Tensor | GradientEdge, grad_out: torch.Tensor | None, inp: torch.Tensor, chunk
) -> tuple[torch.Tensor, list[_WeightGroup]]:
    """zb_h1's B: the grad of the stage input only (the graph kept, torch.autograd.grad with retain_graph), and
    the grads reaching each weight group's start nodes, captured by node pre-hooks for its W."""
    root_node = root.grad_fn if isinstance(root, torch.Tensor) else root.node
    assert root_node is not None
    groups = _weight_groups(root_node, inp, [q for q in chunk.parameters() if q.requires_grad])
    handles = []
    for group in groups:
        for node in group.nodes:

            def keep(grads, group=group, node=node):
                group.grads[node] = tuple(grads)

            handles.append(node.register_prehook(keep))
    try:
        (grad_in,) = torch.autograd.grad(root, [inp], grad_outputs=grad_out, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_in, groups


def _weight_pass(groups: list[_WeightGroup]) -> None:
    """zb_h1's W: each group's weight grads from the grads its start nodes received in B, accumulated into the
    parameters' .grad like a whole backward (torch.autograd.backward with inputs=, so the optimizer's grad hooks
    run). A group with several start nodes pins each to its B grad: a start node above another must not add its
    W-pass grad to the one B already delivered."""
    for group in groups:
        edges, grads = [], []
        for node in group.nodes:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.nodes) > 1:
            for node in group.nodes:
                kept = group.grads.get(node)
                handles.append(node.register_prehook(lambda _g, b=kept: b))
        try:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=group.params, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        group.grads.clear()


class _Exchanger:
    """Runs one step's exchanges in plan order: each is one batch_isend_irecv (tag 0: matching is by issue
    order, as on NCCL). Without overlap every op is waited for before the next unit runs; with it only the
    receives are, and (early_recv) the next exchange's receives are posted together with this one's ops."""

    def __init__(self, sched: PipelineSchedule, plan: list[Action | Exchange]):
        self.s = sched
        self.exchanges: list[Exchange] = [step for step in plan if isinstance(step[0], tuple)]
        self.k = 0  # index of the next exchange
        self.posted: dict[Message, object] = {}  # receives posted early: message -> work
        self.sends: list[tuple[object, torch.Tensor]] = []  # (work, tensor) not yet waited for

    def _recv_op(self, msg: Message, peer: int, inbox: dict) -> comm.P2POp:
        s = self.s
        buf = torch.empty(s.shape, dtype=s.dtype, device=s.device)
        inbox[msg] = buf
        return comm.recv_op(buf, s.pp_ranks[peer], s.group)

    def exchange(self, outbox: dict, inbox: dict) -> None:
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
            for kind, msg in kinds[: len(works)]:
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

    def message_bytes(self, outbox: dict) -> int:
        """Bytes of the outgoing messages referenced now: in the outbox and in sends not yet known complete.
        Sends that have completed are dropped first (their buffers, stage outputs under deallocation, freed)."""
        self.sends = [(w, t) for w, t in self.sends if not _completed(w)]
        tensors = list(outbox.values()) + [t for _, t in self.sends]
        return sum(t.numel() * t.element_size() for t in tensors)

    def finish(self) -> None:
        """Wait for the sends still in flight (their tensors live until then)."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        assert not self.posted, "every early receive belongs to a later exchange of the step"


def p2p_shape(cfg) -> tuple[int, int, int]:
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
    group = getattr(pc, "microbatch_group_size", 0)
    check_schedule(kind, mesh.pp, len(chunks), m, group)  # len(chunks): the vpp this rank really built
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
        microbatch_group_size=group,
    )
