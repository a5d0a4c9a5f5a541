"""When a pipeline send completes under NCCL, from the schedule alone (the rehearsal's model of NCCL's p2p works).

torch's batch_isend_irecv on NCCL coalesces a batch into ONE work (torch.distributed's _coalescing_manager: the
backend supports coalescing), so the engine's exchange (training/schedules/pipeline.py _Exchanger) waits every
batch of two ops or more whole, its sends included; only a batch of one op keeps its own work, and a lone send is
then left to complete in the background. The fake backend does not coalesce (one work per op, never complete
before its wait, as gloo), so under the rehearsal training/rehearse/runner.py hands the engine NCCL's shape: one
work per batch, whose `is_completed` answers from this module.

A lone send is complete once its peer has posted the matching receive (NCCL moves the data as soon as both ops
are posted). The sender can only be sure of that through the messages it has received: the peer's posting must
happen before the sender's check in the order the step's messages impose (happens-before over every pipeline
rank's comm plan, build_comm_plan). That is the latest a real run can free the buffer, whatever the timing, so
the count of sends in flight it gives is an upper bound; launcher/plan/memory.py `pipeline_message_count` is the
same count in closed form (docs/FORMULAS.md, Pipeline messages in flight).
"""

from __future__ import annotations

import functools

from training.schedules.pipeline import build_comm_plan


def _exchanges(kind: str, p: int, rank: int, m: int, v: int, group: int) -> list[tuple]:
    return [s for s in build_comm_plan(kind, p, rank, m, v, group) if isinstance(s[0], tuple)]


@functools.lru_cache(maxsize=16)
def lone_send_releases(kind: str, p: int, m: int, v: int = 1, group: int = 0) -> tuple[dict[int, int], ...]:
    """Per pipeline rank: {index of an exchange that is one send: index of the rank's first exchange after which
    that send is known complete (len(exchanges): only at the step's end)}."""
    plans = [_exchanges(kind, p, r, m, v, group) for r in range(p)]
    sent_at, recv_at = {}, {}  # message -> (rank, exchange index); every message of a step is distinct
    for r, exchanges in enumerate(plans):
        for k, ops in enumerate(exchanges):
            for direction, msg, _ in ops:
                (sent_at if direction == "send" else recv_at)[msg] = (r, k)
    # clock[r][k][q]: the latest exchange rank q is known to have posted when rank r's exchange k has returned.
    clock: list[list[list[int]]] = [[] for _ in range(p)]

    def posted(q: int, y: int) -> list[int] | None:
        """What rank q's posting of its exchange y implies (None: not computed yet)."""
        if y > 0 and len(clock[q]) < y:
            return None
        base = list(clock[q][y - 1]) if y > 0 else [-1] * p
        base[q] = max(base[q], y)
        return base

    progress = True
    while progress:
        progress = False
        for r, exchanges in enumerate(plans):
            while len(clock[r]) < len(exchanges):
                k = len(clock[r])
                ops = exchanges[k]
                now = posted(r, k)
                assert now is not None
                # A receive returns once its sender posted; a coalesced batch (two ops or more) is waited whole,
                # so its sends too have met their receivers' postings.
                deps = [sent_at[msg] for d, msg, _ in ops if d == "recv"]
                if len(ops) > 1:
                    deps += [recv_at[msg] for d, msg, _ in ops if d == "send"]
                known = [posted(q, y) for q, y in deps]
                if any(x is None for x in known):
                    break
                for x in known:
                    now = [max(a, b) for a, b in zip(now, x)]  # type: ignore[arg-type]
                clock[r].append(now)
                progress = True
    assert all(len(clock[r]) == len(plans[r]) for r in range(p)), "the schedule's exchanges wait on each other"
    out = []
    for r, exchanges in enumerate(plans):
        releases = {}
        for k, ops in enumerate(exchanges):
            if len(ops) == 1 and ops[0][0] == "send":
                q, y = recv_at[ops[0][1]]
                releases[k] = next((j for j in range(k, len(exchanges)) if clock[r][j][q] >= y), len(exchanges))
        out.append(releases)
    return tuple(out)


def peak_lone_sends(kind: str, p: int, rank: int, m: int, v: int = 1, group: int = 0) -> int:
    """Most lone sends of pipeline rank `rank` not known complete at once, over the checks after its exchanges."""
    releases = lone_send_releases(kind, p, m, v, group)[rank]
    n = len(_exchanges(kind, p, rank, m, v, group))
    return max((sum(1 for x, rel in releases.items() if x <= k < rel) for k in range(n)), default=0)


class _BatchWork:
    """NCCL's one work for a whole batch_isend_irecv; `done` answers is_completed (None: only once waited)."""

    def __init__(self, works: list, done=None):
        self.works, self.done = works, done

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return self.done is not None and bool(self.done())


class NcclWorks:
    """While entered (around a cuda run's rehearsed step): batch_isend_irecv answers with NCCL's shape, one work
    per batch (so the engine takes NCCL's path: a batch of two ops or more waited whole), and the work of a
    pipeline exchange that is one send completes after the exchange lone_send_releases names."""

    def __init__(self, schedule):
        self.schedule = schedule if getattr(schedule, "p", 1) > 1 else None
        self.exchange = 0  # pipeline exchanges issued in this forward_backward
        self.releases: dict[int, int] = {}

    def __enter__(self) -> NcclWorks:
        from training.parallel import collectives as comm

        self._real = comm.batch_isend_irecv
        comm.batch_isend_irecv = self.batch_isend_irecv
        s = self.schedule
        if s is not None:
            self._forward_backward = real = s.forward_backward

            def forward_backward(micro_batches):
                self.exchange = 0
                self.releases = lone_send_releases(s.kind, s.p, len(micro_batches), s.v, s.mb_group)[s.rank]
                return real(micro_batches)

            s.forward_backward = forward_backward
        return self

    def __exit__(self, *exc) -> None:
        from training.parallel import collectives as comm

        comm.batch_isend_irecv = self._real
        if self.schedule is not None:
            self.schedule.forward_backward = self._forward_backward

    def batch_isend_irecv(self, ops: list) -> list:
        works = self._real(ops)
        s = self.schedule
        if s is None or not ops or ops[0].group is not s.group:
            return [_BatchWork(works)]
        k, self.exchange = self.exchange, self.exchange + 1
        release = self.releases.get(k)
        if release is None:
            return [_BatchWork(works)]
        # The engine checks after each exchange; after its exchange j, self.exchange is j + 1.
        return [_BatchWork(works, lambda: self.exchange - 1 >= release)]
