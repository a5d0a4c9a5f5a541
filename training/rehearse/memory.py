"""Each rehearsed rank's memory by part against plan.json's memory_bytes of its pipeline stage (pure Python).

What the rehearsal measures per part (training/rehearse/runner.py):
- weights: the distinct storages of the model's parameters;
- grads: the optimizer's gradient buffers (main grads; the expert optimizer's too);
- optimizer: every other tensor the optimizer holds (fp32 masters, Adam moments, step);
- buffers: the model's buffers (RoPE tables; the plan counts none, so only above FLOOR_BYTES is it reported);
- activations: the peak over the step of the bytes autograd saved for backward (distinct storages, model
  states left out), under the kernels a CUDA run picks (training/rehearse/kernels.py);
- host_offload: offload=cpu's state in host memory (on meta under the rehearsal, counted apart);
- param_gather, zero3_gathered: the engine's own peak counters of its ZeRO-1/2 and ZeRO-3 gathers;
- pipeline_messages: the pipeline schedule's own peak of the outgoing p2p messages it holds at once
  (training/schedules/pipeline.py StepStats.peak_message_bytes; a cuda run's sends complete as NCCL's would,
  training/rehearse/messages.py), against plan.json's pipeline_messages;
- checkpoint_staging: the device bytes a save's pieces hold beyond the model's and the optimizer's storages
  (what the optimizer's state_dict materialises for CheckpointManager.save); checkpoint_staging_host: an async
  save's host buffers (training/checkpoint/staging.py), host memory like host_offload.

The plan counts neither of the last two as a part; they enter the comparison through `total`, the tracked peak
against plan.json's memory_bytes total (tracked_total).
"""

from __future__ import annotations

from typing import Any

from training.rehearse.checks import Defect

PARTS = (
    "weights",
    "grads",
    "optimizer",
    "buffers",
    "activations",
    "param_gather",
    "zero3_gathered",
    "host_offload",
    "pipeline_messages",
)
"""The parts compared one by one with the plan's."""
TOTAL_ONLY = ("checkpoint_staging", "checkpoint_staging_host")
"""Parts the plan has no figure for: shown, and judged through the total only."""
TOLERANCE = 0.03
"""Relative difference allowed per part (the issue's 3 %)."""
FLOOR_BYTES = 16 * 2**20
"""Differences below this are not reported (scalars, a step counter, an allocator's granularity)."""


def plan_for_stage(plan: dict[str, Any], stage: int) -> dict[str, int]:
    """memory_bytes of pipeline stage `stage` (plan.json's `stages`), or the plan's worst stage's."""
    for s in plan.get("stages") or []:
        if int(s.get("stage", -1)) == stage:
            return dict(s.get("memory_bytes") or {})
    return dict(plan.get("memory_bytes") or {})


def tracked_total(measured: dict[str, int]) -> int:
    """The device peak the rehearsal tracks, as plan.json's total counts it: the model states and buffers,
    plus the larger of the step's transient memory (activations, ZeRO-3's gathered units, the pipeline's
    messages in flight) and a save's device staging (the save runs after the step's activations are freed).
    param_gather is left out as the plan's total leaves it (it is the plan's reserve, after the step)."""
    m = {k: int(measured.get(k, 0) or 0) for k in PARTS + TOTAL_ONLY}
    step = m["activations"] + m["zero3_gathered"] + m["pipeline_messages"]
    return m["weights"] + m["grads"] + m["optimizer"] + m["buffers"] + max(step, m["checkpoint_staging"])


def compare(measured: dict[str, int], planned: dict[str, int]) -> list[dict[str, Any]]:
    """Per part, then the total: measured, planned, relative difference, ok."""
    rows = []
    for part in PARTS + TOTAL_ONLY + ("total",):
        if part in TOTAL_ONLY:
            m = int(measured.get(part, 0) or 0)
            rows.append({"part": part, "rehearsed": m, "planned": 0, "difference": None, "ok": True})
            continue
        m = tracked_total(measured) if part == "total" else int(measured.get(part, 0))
        p = int(planned.get(part, 0) or 0)
        if part == "total" and not p:
            continue  # a plan without a total (an old plan.json): nothing to compare
        diff = m - p
        rel = diff / p if p else (0.0 if m == 0 else float("inf"))
        ok = abs(diff) < FLOOR_BYTES or abs(rel) <= TOLERANCE
        rows.append({"part": part, "rehearsed": m, "planned": p, "difference": rel if p else None, "ok": ok})
    return rows


def memory_defects(results, plan: dict[str, Any] | None) -> list[Defect]:
    """One defect per part and stage whose worst rank differs from the plan by more than TOLERANCE."""
    if not plan:
        return []
    worst: dict[tuple, tuple] = {}
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
