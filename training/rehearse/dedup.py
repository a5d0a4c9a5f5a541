"""Rehearsal deduplication (pure Python): run one rank per coordinate class, derive the others by relabelling.

A rank's program (its calls' ops, dtypes and element counts, in order) depends on its coordinates only through:
- its pipeline stage (the layers it holds, the schedule's plan: training/schedules/pipeline.py);
- tp: the vocab shard (`chunk(tp)[tp_rank]`, training/model/init.py: every shard but the last is full) and
  tp rank 0's norm share (training/optim/model_parallel.py); the SP slice is the same size on every rank;
- cp: the two sequence chunks (cp_rank, 2cp - 1 - cp_rank) of equal size (training/parallel/context.py) and the
  ring's neighbours (cp_rank +- 1, relative);
- dp / ep / edp: the ZeRO shard of the flat order at index dp_rank x cp + cp_rank (training/optim/flat.py:
  ceil(n / (dp x cp)) elements each, padding at the end), the experts ep_rank x E/ep.. (training/model/moe.py)
  and the expert optimizer's shard at edp_rank = dp_rank // ep (training/optim/optimizer.py);
- global rank 0 (the checkpoint manager's directory name, training/checkpoint/manager.py): rank 0 is the only
  rank first in every position of stage 0, so it is a class of its own.
So ranks at one stage whose position (first / middle / last) agrees on every one of those axes run the same
program. The middle shards are taken to be full, which holds whenever the flat order has more than
(dp x cp - 1) x ceil(n / (dp x cp)) elements (every real model; tests/engine/test_rehearse.py checks the
derivation against running every rank, an uneven ZeRO-3 shard among them).

A member's calls are its representative's mapped through the mesh automorphism that moves the representative
onto it: a cyclic shift along tp, cp, the ep position inside an ep group and the ep group's index (dp_rank =
block x ep + ep_rank), the stage unchanged. Every group kind (training/parallel/mesh.py rank_groups) fixes some
axes and spans the others, so a shift maps groups onto groups; being cyclic, it keeps the ring's neighbours
(relative peers) right. A group is mapped member by member (then sorted, as the mesh's lists are); a p2p peer
through the shift; a broadcast / reduce root, which the engine names by its place in the group, keeps that
place; new_group / new_subgroups (issued world-wide in one order) are left as they are. Memory parts are the
representative's.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from training.parallel.mesh import coords_of, rank_of

NO_MAP = ("new_group", "new_subgroups")


def _position(i: int, n: int) -> str:
    return "first" if i == 0 else ("last" if i == n - 1 else "middle")


def class_key(rank: int, tp: int, pp: int, cp: int, dp: int, ep: int) -> tuple:
    """The coordinate class of a rank: its stage and its first / middle / last position on every axis its
    program depends on (module doc)."""
    c = coords_of(rank, tp, pp, cp, dp)
    d = c["dp"]
    return (
        c["pp"],
        _position(c["tp"], tp),
        _position(c["cp"], cp),
        _position(d % ep, ep),
        _position(d // ep, dp // ep),
        _position(d, dp),
        _position(d * cp + c["cp"], dp * cp),
    )


def classes(ranks: list[int], tp: int, pp: int, cp: int, dp: int, ep: int) -> dict[int, list[int]]:
    """{representative: [the other ranks of `ranks` in its class]}; the representative is the lowest rank."""
    first: dict[tuple, int] = {}
    out: dict[int, list[int]] = {}
    for r in sorted(ranks):
        key = class_key(r, tp, pp, cp, dp, ep)
        if key in first:
            out[first[key]].append(r)
        else:
            first[key] = r
            out[r] = []
    return out


def relabelling(src: int, dst: int, tp: int, pp: int, cp: int, dp: int, ep: int) -> Callable[[int], int]:
    """The mesh automorphism (cyclic shifts per axis, module doc) taking rank `src` to rank `dst` (same stage)."""
    a, b = coords_of(src, tp, pp, cp, dp), coords_of(dst, tp, pp, cp, dp)
    if a["pp"] != b["pp"]:
        raise ValueError(f"ranks {src} and {dst} are on different pipeline stages")
    dt, dc = b["tp"] - a["tp"], b["cp"] - a["cp"]
    blocks = dp // ep
    de, db = b["dp"] % ep - a["dp"] % ep, b["dp"] // ep - a["dp"] // ep

    done: dict[int, int] = {}

    def move(r: int) -> int:
        got = done.get(r)
        if got is None:
            c = coords_of(r, tp, pp, cp, dp)
            d = ((c["dp"] // ep + db) % blocks) * ep + (c["dp"] % ep + de) % ep
            got = done[r] = rank_of((c["tp"] + dt) % tp, (c["cp"] + dc) % cp, c["pp"], d, tp, cp, pp)
        return got

    return move


def _group(group, move: Callable[[int], int]) -> tuple[int, ...]:
    g = tuple(group)
    mapped = tuple(move(r) for r in g)
    return tuple(sorted(mapped)) if list(g) == sorted(g) else mapped


def derive_calls(calls, move: Callable[[int], int]) -> list:
    """The representative's calls as the member `move` takes it to issues them."""
    out = []
    groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # a few distinct groups, each mapped once
    for c in calls:
        if c.op in NO_MAP:
            out.append(c)
            continue
        key = tuple(c.group)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _group(key, move)
        root = c.root
        if root is not None and root in key:
            root = group[key.index(root)]
        elif root is not None:
            root = move(root)
        new = copy.copy(c)  # the same fields as dataclasses.replace, without its per-call __init__
        new.group, new.root = group, root
        new.peer = move(c.peer) if c.peer is not None else None
        out.append(new)
    return out


def derive_result(rep, dst: int, tp: int, pp: int, cp: int, dp: int, ep: int):
    """Member `dst`'s RankResult from its class representative's `rep` (calls relabelled, memory as is)."""
    move = relabelling(rep.rank, dst, tp, pp, cp, dp, ep)
    c = coords_of(dst, tp, pp, cp, dp)
    coords = {"tp": c["tp"], "pp": c["pp"], "cp": c["cp"], "dp": c["dp"], "ep": c["dp"] % ep}
    return dataclasses.replace(
        rep,
        rank=dst,
        coords=coords if rep.coords else {},
        calls=derive_calls(rep.calls, move),
        memory=dict(rep.memory),
        groups={k: _group(v, move) for k, v in rep.groups.items()},
        seconds=0.0,
    )
