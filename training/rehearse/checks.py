"""The rehearsal's checks over every rehearsed rank's recorded calls (pure Python: no torch).

- mismatch: per process group, every rehearsed member issues the same sequence of collectives (op, dtype,
  element count, reduce op, root); the first divergence is reported with both ranks' call sites and sequences.
- deadlock: the ranks' programs run under NCCL's rules (below) until every rank is done or none can move; a
  cycle of waits is a deadlock, a wait on a rank that has finished is an unmatched call.
- foreign_device: a tensor that is not on the run's device reaching a collective of a cuda run (under the
  rehearsal every device tensor is meta, so a cpu one is what NCCL would refuse).
- memory: each part of a rank's memory against plan.json's memory_bytes of its stage (memory.py).

NCCL's rules as simulated (conservative: what NCCL may do once a message outgrows its buffers):
- a rank issues its calls in order, one at a time (one stream);
- a collective completes when every rehearsed member of its group has reached its matching collective (the
  k-th call on that group);
- an un-batched isend/irecv runs on the rank pair's own communicator and blocks until the peer's current call
  is the matching irecv/isend (a send may wait for its receive; the pair's ops run in issue order; creating the
  pair's communicator waits for both);
- a batch_isend_irecv is posted whole when the rank reaches it (the group's communicator runs the batch's ops
  together); its k-th send to a peer matches that peer's k-th batched receive from the rank, posted then or
  since (NCCL pairs a direction's ops in issue order), and a matched op stays matched while either side moves
  on; the batch completes once every one of its ops is matched.
Ranks outside the rehearsal (representative mode) are taken to answer every call.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

P2P = ("isend", "irecv", "send", "recv")
NO_MATCH = ("new_group", "new_subgroups")  # world-wide, checked on the world's sequence
WINDOW = 3


@dataclass
class Defect:
    """One finding (rehearsal.json's `defects`)."""

    kind: str
    """mismatch | deadlock | foreign_device | memory | error."""
    message: str
    """What is wrong, in one sentence."""
    ranks: list[int] = field(default_factory=list)
    """The ranks involved."""
    sites: list[str] = field(default_factory=list)
    """The engine call sites involved."""
    sequences: dict[str, list[str]] = field(default_factory=dict)
    """Per rank (as a string key), the calls around the divergence or the calls in the cycle."""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "ranks": self.ranks,
            "sites": self.sites,
            "sequences": self.sequences,
        }


def _sig(c) -> tuple:
    """What must agree between the members of a collective."""
    if c.op == "all_to_all_single":
        return (c.op, c.dtype)  # split sizes legitimately differ per member
    if c.op in ("all_gather_object", "broadcast_object_list", "barrier"):
        return (c.op, c.root)
    return (c.op, c.dtype, c.numel, c.reduce_op, c.root)


def _show(c) -> str:
    text = f"#{c.order} {c.op}"
    if c.dtype:
        text += f" {c.dtype}[{c.numel}]"
    if c.reduce_op:
        text += f" {c.reduce_op}"
    if c.root is not None:
        text += f" root={c.root}"
    if c.peer is not None:
        text += f" peer={c.peer}" + (f" batch={c.batch}" if c.batch is not None else " unbatched")
    return f"{text} [{c.phase}] at {c.site}"


def per_group(calls_by_rank: dict[int, Sequence[Any]]) -> dict[tuple[int, ...], dict[int, list[Any]]]:
    """group (ranks) -> member rank -> that member's collectives on it, in order (p2p excluded)."""
    out: dict[tuple[int, ...], dict[int, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for rank, calls in calls_by_rank.items():
        for c in calls:
            if c.op in P2P:
                continue
            key = tuple(c.group) if c.op not in NO_MATCH else ("world",)
            out[key][rank].append(c)
    return out


def check_matching(calls_by_rank: dict[int, Sequence[Any]], world: int) -> list[Defect]:
    """Per group, every rehearsed member's sequence against the lowest rehearsed member's."""
    defects = []
    for group, members in per_group(calls_by_rank).items():
        expected = set(range(world)) if group == ("world",) else set(group)
        present = sorted(r for r in members if r in expected)
        # A group whose rehearsed members did not all reach it is still compared: a member with no call is
        # an empty sequence (only members that were rehearsed and finished count).
        for r in sorted(expected & set(calls_by_rank)):
            if r not in members:
                members[r] = []
                present.append(r)
        present = sorted(set(present))
        if len(present) < 2:
            continue
        ref = present[0]
        for r in present[1:]:
            d = _first_divergence(members[ref], members[r])
            if d is None:
                continue
            a, b = members[ref], members[r]
            label = "world" if group == ("world",) else _ranks_text(group)
            ca = _show(a[d]) if d < len(a) else "(nothing: its sequence ends here)"
            cb = _show(b[d]) if d < len(b) else "(nothing: its sequence ends here)"
            defects.append(
                Defect(
                    "mismatch",
                    f"group {label}: call {d} on the group differs between rank {ref} ({ca}) and rank {r} ({cb})",
                    [ref, r],
                    [x.site for x in (a[d : d + 1] + b[d : d + 1])],
                    {
                        str(ref): [_show(c) for c in a[max(0, d - WINDOW) : d + WINDOW]],
                        str(r): [_show(c) for c in b[max(0, d - WINDOW) : d + WINDOW]],
                    },
                )
            )
            break  # one report per group: the first divergence
    return defects


def _first_divergence(a: list[Any], b: list[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if _sig(x) != _sig(y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ranks_text(group: Sequence[int]) -> str:
    g = list(group)
    if len(g) > 2 and g == list(range(g[0], g[0] + len(g) * (g[1] - g[0]), g[1] - g[0])) and g[1] > g[0]:
        step = g[1] - g[0]
        return f"[{g[0]}..{g[-1]}" + (f" step {step}]" if step > 1 else "]")
    return str(g)


def check_devices(calls_by_rank: dict[int, Sequence[Any]], device: str) -> list[Defect]:
    """cuda runs: every tensor of a recorded call is on the device (meta under the rehearsal)."""
    if device != "cuda":
        return []
    found: dict[str, Defect] = {}
    for rank, calls in calls_by_rank.items():
        for c in calls:
            if c.device and c.device != "meta":
                d = found.get(c.site)
                if d is None:
                    found[c.site] = Defect(
                        "foreign_device",
                        f"a {c.device} tensor reaches {c.op} at {c.site}: an NCCL group has no {c.device} backend "
                        f'("No backend type associated with device type {c.device}")',
                        [rank],
                        [c.site],
                        {str(rank): [_show(c)]},
                    )
                elif rank not in d.ranks:
                    d.ranks.append(rank)
    return list(found.values())


# ---- the deadlock simulation ----------------------------------------------------------------------------------


@dataclass
class _Step:
    """One unit a rank issues: a collective, an un-batched p2p op, or a whole batch."""

    kind: str  # "coll" | "p2p" | "batch"
    calls: list[Any]
    key: tuple = ()  # collectives: (the group's number, index on the group)
    group: tuple = ()  # collectives: the group's ranks, or ("world",)


def _program(calls: Sequence[Any], groups: dict[tuple, int]) -> list[_Step]:
    """The rank's steps; `groups` numbers every group met (filled here, shared by the ranks): a collective's key
    is a pair of ints, cheap to hash where a group of 1,024 ranks is not."""
    steps: list[_Step] = []
    seen: dict[int, int] = defaultdict(int)
    by_object: dict[int, int] = {}  # id(group tuple) -> its number: a rank's calls share their group's tuple
    for c in calls:
        if c.op in ("send", "recv"):
            if steps and steps[-1].kind == "batch" and steps[-1].calls[0].batch == c.batch:
                steps[-1].calls.append(c)
            else:
                steps.append(_Step("batch", [c]))
        elif c.op in ("isend", "irecv"):
            steps.append(_Step("p2p", [c]))
        else:
            group = ("world",) if c.op in NO_MATCH else c.group
            gid = by_object.get(id(group))
            if gid is None:
                gid = by_object[id(group)] = groups.setdefault(tuple(group), len(groups))
            steps.append(_Step("coll", [c], (gid, seen[gid]), tuple(group)))
            seen[gid] += 1
    return steps


def _complement(c) -> str:
    return {"isend": "irecv", "irecv": "isend", "send": "recv", "recv": "send"}[c.op]


def check_deadlock(calls_by_rank: dict[int, Sequence[Any]], world: int) -> list[Defect]:
    """Run every rehearsed rank's program under the rules in the module doc."""
    sim = _Simulation(calls_by_rank, world)
    sim.run()
    live = [r for r in sim.progs if sim.head(r) is not None]
    return [_stuck(live, sim.waits_for, sim.head)] if live else []


class _Simulation:
    """The ranks' programs and where each stands.

    It runs event by event: a rank moves on until its current step waits, and a rank is tried again when something
    it may wait for happened (its collective's last member arrived, its p2p peer reached a step, a peer posted a
    batch). Each rule only ever waits for other ranks to move on, so the order of the moves does not change where
    the ranks stop; waits_for is asked only to explain a stop. Each step is looked at a bounded number of times
    (a collective counts its arrivals instead of re-checking its group), so the cost grows with the calls, not with
    calls x group size."""

    def __init__(self, calls_by_rank: dict[int, Sequence[Any]], world: int):
        groups: dict[tuple, int] = {}
        self.progs = {r: _program(calls, groups) for r, calls in calls_by_rank.items()}
        self.group_of = {gid: group for group, gid in groups.items()}
        self.pos = {r: 0 for r in self.progs}
        self.known = set(self.progs)
        self.world = world
        # Batched p2p, per direction (src, dst): how many sends and receives have been posted, and each posted
        # op's index in its direction (the k-th send meets the k-th receive).
        self.posted_sends: dict[tuple[int, int], int] = defaultdict(int)
        self.posted_recvs: dict[tuple[int, int], int] = defaultdict(int)
        self.index: dict[int, int] = {}  # id(call) -> its index in its direction
        self.was_posted: set[tuple[int, int]] = set()  # (rank, step position) of the batches posted
        self.members: dict[int, int] = {}  # group number -> its rehearsed members
        self.arrived: dict[tuple, list[int]] = defaultdict(list)  # collective key -> the ranks at it
        self.at: dict[int, int] = {}  # rank -> the position it arrived at its current collective
        self.queue, self.queued = deque(self.progs), set(self.progs)

    def head(self, r: int) -> _Step | None:
        prog = self.progs.get(r)
        return prog[self.pos[r]] if prog is not None and self.pos[r] < len(prog) else None

    def post(self, r: int) -> None:
        """Rank r reached its current step: a batch's ops are posted, each taking its place in its direction."""
        s = self.head(r)
        if s is None or s.kind != "batch" or (r, self.pos[r]) in self.was_posted:
            return
        self.was_posted.add((r, self.pos[r]))
        for c in s.calls:
            if c.op == "send":
                self.index[id(c)] = self.posted_sends[(r, c.peer)]
                self.posted_sends[(r, c.peer)] += 1
            else:
                self.index[id(c)] = self.posted_recvs[(c.peer, r)]
                self.posted_recvs[(c.peer, r)] += 1

    def matched(self, r: int, c) -> bool:
        if c.op == "send":
            return self.posted_recvs[(r, c.peer)] > self.index[id(c)]
        return self.posted_sends[(c.peer, r)] > self.index[id(c)]

    def waits_for(self, r: int) -> set[int]:
        """The rehearsed ranks rank r's current step is waiting for (empty: it can complete)."""
        s = self.head(r)
        assert s is not None
        blockers: set[int] = set()
        if s.kind == "coll":
            group = set(range(self.world)) if s.group == ("world",) else set(s.group)
            for m in group & self.known:
                h = self.head(m)
                if m != r and (h is None or h.kind != "coll" or h.key != s.key):
                    blockers.add(m)
            return blockers
        for c in s.calls:
            peer = c.peer
            if peer not in self.known or peer == r:
                continue
            if s.kind == "batch":
                if not self.matched(r, c):
                    blockers.add(peer)
                continue
            h = self.head(peer)
            want = _complement(c)
            if h is None or h.kind == "coll" or not any(x.op == want and x.peer == r for x in h.calls):
                blockers.add(peer)
            elif s.kind == "p2p" and h.kind != "p2p":
                blockers.add(peer)  # an un-batched op pairs with the peer's un-batched op (same communicator)
        return blockers

    def _need(self, gid: int) -> int:
        if gid not in self.members:
            group = self.group_of[gid]
            self.members[gid] = len(self.known) if group == ("world",) else len(self.known.intersection(group))
        return self.members[gid]

    def _wake(self, r: int) -> None:
        if r not in self.queued:
            self.queued.add(r)
            self.queue.append(r)

    def run(self) -> None:
        """Move every rank as far as the rules let it."""
        while self.queue:
            r = self.queue.popleft()
            self.queued.discard(r)
            while (s := self.head(r)) is not None and self._move(r, s):
                pass

    def _move(self, r: int, s: _Step) -> bool:
        """Complete rank r's current step s if it can (and whatever completes with it); False: it waits."""
        known, pos = self.known, self.pos
        if s.kind == "coll":
            if self.at.get(r) != pos[r]:
                self.at[r] = pos[r]
                self.arrived[s.key].append(r)
            if len(self.arrived[s.key]) < self._need(s.key[0]):
                return False
            for m in self.arrived.pop(s.key):  # the members complete together
                pos[m] += 1
                if m != r:
                    self._wake(m)
            return True
        if s.kind == "p2p":
            c = s.calls[0]
            if c.peer in known and c.peer != r:
                h = self.head(c.peer)
                want = _complement(c)
                if h is None or h.kind != "p2p" or not any(x.op == want and x.peer == r for x in h.calls):
                    return False
                pos[c.peer] += 1  # the pair completes together
                self._wake(c.peer)
            pos[r] += 1
            return True
        if (r, pos[r]) not in self.was_posted:
            self.post(r)
            for c in s.calls:
                if c.peer in known and c.peer != r:
                    self._wake(c.peer)
        if any(c.peer in known and c.peer != r and not self.matched(r, c) for c in s.calls):
            return False
        pos[r] += 1
        return True


def _stuck(live: list[int], waits_for, head) -> Defect:
    graph = {r: sorted(waits_for(r)) for r in live}
    cycle = _find_cycle(graph)
    if cycle:
        ranks = cycle
        what = "a cycle of waits: " + " -> ".join(str(r) for r in cycle + cycle[:1])
        kind_msg = "deadlock"
    else:
        r = live[0]
        done = [b for b in graph[r] if head(b) is None]
        ranks = [r] + done
        what = f"rank {r} waits for rank(s) {done or graph[r]}, which finished without the matching call"
        kind_msg = "unmatched call"
    seqs = {str(r): [_show(c) for c in head(r).calls] if head(r) else [] for r in ranks}
    sites = sorted({c.site for r in ranks if head(r) for c in head(r).calls})
    return Defect("deadlock", f"{kind_msg} under NCCL's rules: {what}", ranks, sites, seqs)


def _find_cycle(graph: dict[int, list[int]]) -> list[int]:
    color: dict[int, int] = {}
    stack: list[int] = []

    def visit(u: int) -> list[int]:
        color[u] = 1
        stack.append(u)
        for v in graph.get(u, []):
            if v not in graph:
                continue
            if color.get(v) == 1:
                return stack[stack.index(v) :]
            if v not in color:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = 2
        return []

    for u in sorted(graph):
        if u not in color:
            found = visit(u)
            if found:
                return found
    return []
