"""Which ranks a rehearsal runs (pure Python).

Every rank up to FULL_LIMIT. Beyond it, one representative of each distinct coordinate class (pipeline stage x
first / middle / last position in tp, cp, ep and dp: the positions whose programs can differ), plus every
member of one group of each kind that contains rank 0's class representatives, so that matching is still
checked inside a whole group of every kind.
"""

from __future__ import annotations

from training.parallel.mesh import coords_of, rank_groups

FULL_LIMIT = 256


def _position(i: int, n: int) -> str:
    return "first" if i == 0 else ("last" if i == n - 1 else "middle")


def coordinate_class(c: dict[str, int], tp: int, pp: int, cp: int, dp: int, ep: int) -> tuple:
    """pipeline stage x first/middle/last in tp, cp, ep (inside dp) and dp."""
    return (
        c["pp"],
        _position(c["tp"], tp),
        _position(c["cp"], cp),
        _position(c["dp"] % ep, ep),
        _position(c["dp"], dp),
    )


def select(tp: int, pp: int, cp: int, dp: int, ep: int = 1) -> tuple[list[int], dict[int, str]]:
    """(ranks to rehearse, {rank: why}) for the layout; why is "all" below FULL_LIMIT."""
    world = tp * pp * cp * dp
    if world <= FULL_LIMIT:
        return list(range(world)), {r: "all" for r in range(world)}
    why: dict[int, str] = {}
    for r in range(world):
        cls = coordinate_class(coords_of(r, tp, pp, cp, dp), tp, pp, cp, dp, ep)
        label = "class stage {} tp {} cp {} ep {} dp {}".format(*cls)
        if label not in why.values():
            why[r] = label
    for kind, lists in rank_groups(tp, pp, cp, dp, ep).items():
        for ranks in lists:
            if 0 in ranks:
                for r in ranks:
                    why.setdefault(r, f"member of rank 0's {kind} group")
                break
    return sorted(why), why
