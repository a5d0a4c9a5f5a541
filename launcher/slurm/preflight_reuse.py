"""Which nodes a requeued attempt need not preflight again (cluster.preflight.requeue_reuse_min).

With `cluster.preflight.mode` warn or gate every attempt checks its nodes before training. After a stop with a
checkpoint (a preemption, the time limit, train.exit_interval) the requeued attempt is on the critical path of
the run (signal -> resumed step), and a node that passed the preflight minutes ago and then trained until the
stop has shown nothing against it. The prologue (launcher/slurm/driver.py) exports such nodes as
MESHRUN_PREFLIGHT_PASSED, as an in-job restart does for the nodes of its allocation (launcher/slurm/in_job.py),
and training/preflight/runner.py skips them: no preflight when every node passed, else only the new nodes'
checks and matmul with the collectives over every rank. Pure Python, from events.jsonl alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def requeue_passed(
    events: Sequence[dict[str, Any]], attempt: int, nodes: Sequence[str], window_s: float, now: float
) -> list[str]:
    """Nodes of `nodes` whose last preflight check passed at most window_s before `now`, when the previous attempt
    ended in a requeue after a stop with a checkpoint (`requeued` cause stopped_early) and no `failed` event named
    the node since that check. A node an attempt reused (its `started` event's preflight_passed) was not checked
    by that attempt's preflight: its last check stays the earlier one."""
    if window_s <= 0 or attempt <= 0:
        return []
    ends = [ev for ev in events if ev.get("event") == "requeued" and ev.get("attempt") == attempt - 1]
    if not ends or ends[-1].get("cause") != "stopped_early":
        return []
    reused = {ev.get("attempt"): set(ev.get("preflight_passed") or []) for ev in events if ev.get("event") == "started"}
    checked: dict[str, float] = {}
    for ev in events:
        if ev.get("event") == "preflight":
            bad = set(ev.get("bad_nodes") or [])
            for node, status in (ev.get("nodes") or {}).items():
                if node in reused.get(ev.get("attempt"), set()):
                    continue
                if status != "fail" and node not in bad:
                    checked[node] = float(ev.get("time") or 0.0)
                else:
                    checked.pop(node, None)
        elif ev.get("event") == "failed":
            checked.pop(str(ev.get("node")), None)
    return [n for n in nodes if n in checked and now - checked[n] <= window_s]
