"""Each rehearsed rank's memory by part against plan.json's memory_bytes of its pipeline stage (pure Python).

What the rehearsal measures per part (training/rehearse/runner.py):
- weights: the distinct storages of the model's parameters;
- grads: the optimizer's gradient buffers (main grads; the expert optimizer's too);
- optimizer: every other tensor the optimizer holds (fp32 masters, Adam moments, step);
- buffers: the model's buffers (RoPE tables; the plan counts none, so only above FLOOR_BYTES is it reported);
- activations: the peak over the step of the bytes autograd saved for backward (distinct storages, model
  states left out), under the kernels a CUDA run picks (training/rehearse/kernels.py);
- host_offload: offload=cpu's state in host memory (on meta under the rehearsal, counted apart);
- param_gather, zero3_gathered: the engine's own peak counters of its ZeRO-1/2 and ZeRO-3 gathers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from training.rehearse.checks import Defect

PARTS = ("weights", "grads", "optimizer", "buffers", "activations", "param_gather", "zero3_gathered", "host_offload")
TOLERANCE = 0.03
"""Relative difference allowed per part (the issue's 3 %)."""
FLOOR_BYTES = 16 * 2**20
"""Differences below this are not reported (scalars, a step counter, an allocator's granularity)."""


def plan_for_stage(plan: Dict[str, Any], stage: int) -> Dict[str, int]:
    """memory_bytes of pipeline stage `stage` (plan.json's `stages`), or the plan's worst stage's."""
    for s in plan.get("stages") or []:
        if int(s.get("stage", -1)) == stage:
            return dict(s.get("memory_bytes") or {})
    return dict(plan.get("memory_bytes") or {})


def compare(measured: Dict[str, int], planned: Dict[str, int]) -> List[Dict[str, Any]]:
    """Per part: measured, planned, relative difference, ok."""
    rows = []
    for part in PARTS:
        m, p = int(measured.get(part, 0)), int(planned.get(part, 0) or 0)
        diff = m - p
        rel = diff / p if p else (0.0 if m == 0 else float("inf"))
        ok = abs(diff) < FLOOR_BYTES or abs(rel) <= TOLERANCE
        rows.append({"part": part, "rehearsed": m, "planned": p, "difference": rel if p else None, "ok": ok})
    return rows


def memory_defects(results, plan: Optional[Dict[str, Any]]) -> List[Defect]:
    """One defect per part and stage whose worst rank differs from the plan by more than TOLERANCE."""
    if not plan:
        return []
    worst: Dict[tuple, tuple] = {}
    for r in results:
        if r.error or not r.memory:
            continue
        stage = r.coords.get("pp", 0)
        for row in compare(r.memory, plan_for_stage(plan, stage)):
            if row["ok"]:
                continue
            key = (stage, row["part"])
            gap = abs(row["rehearsed"] - row["planned"])
            if key not in worst or gap > worst[key][0]:
                worst[key] = (gap, r.rank, row)
    out = []
    for (stage, part), (_, rank, row) in sorted(worst.items()):
        rel = row["difference"]
        how = f"{rel * 100:+.1f} %" if rel is not None else "the plan counts none"
        out.append(
            Defect(
                "memory",
                f"stage {stage} {part}: rehearsed {_gib(row['rehearsed'])} on rank {rank}, planned "
                f"{_gib(row['planned'])} ({how}; tolerance {TOLERANCE * 100:.0f} %)",
                [rank],
            )
        )
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"
