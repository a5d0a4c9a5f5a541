"""A CUDA out-of-memory error explained: which part overflowed (model states or activations, the plan against what
was measured) and which levers fit that part in this layout. Writes an `oom` event and returns the message the
rank prints (training/main.py).

States (weights, gradients, optimizer) are allocated when the model and optimizer are built; activations grow
during forward. So an OOM before the engine was built, or with the measured states already taking nearly all the
memory, is the states' (levers: ZeRO, more tp, more pp); otherwise the activations' (levers: sequence
parallelism, context parallelism, recompute, a smaller micro-batch). Levers already at their limit are left out.
"""

from __future__ import annotations

import json
from typing import Any

from training.contract.rundir.events import append_event
from training.contract.rundir.paths import RunPaths

STATES_FULL = 0.9
"""Measured states above this share of the GPU's memory leave too little for any activations: the states' fault."""


def _plan(run_dir: str) -> dict[str, Any]:
    try:
        with open(RunPaths(run_dir).plan) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _split_at(cfg, pp: int) -> str:
    """The pipeline split keys (training/contract/stage_split.py) that divide the layers at pp, as overrides: empty
    when the layout's own split (or the even one) does."""
    from training.contract.stage_split import NO_SPLIT, SPLIT_KEYS, StageSplit, split_options

    p = cfg.parallel
    v = p.vpp if str(p.schedule) == "interleaved_1f1b" and pp > 1 else 1
    given = {k: getattr(p, k) for k in SPLIT_KEYS}
    if StageSplit(cfg.model.num_layers, pp, v, **given).counts() is not None:
        return ""
    options = split_options(cfg.model.num_layers, pp, v)
    if not options:
        return ""
    keys = {**NO_SPLIT, **options[0]}
    return "".join(f" parallel.{k}={str(val).lower()}" for k, val in keys.items() if val or given[k])


def levers(cfg, part: str) -> list[str]:
    """Overrides that shrink `part` (states | activations) in this layout, the ones already in use left out."""
    p = cfg.parallel
    out: list[str] = []
    if part == "states":
        if p.zero == 0:
            out.append("parallel.zero=1 (optimizer states and fp32 masters sharded over dp)")
        out.append(f"parallel.tp={p.tp * 2} (weights split over more GPUs of a node)")
        out.append(f"parallel.pp={p.pp * 2}{_split_at(cfg, p.pp * 2)} (fewer layers per GPU)")
        return out
    if p.tp > 1 and not p.sp:
        out.append("parallel.sp=true (norm and dropout activations split over tp)")
    out.append(f"parallel.cp={p.cp * 2} (the sequence split over more GPUs)")
    if str(p.recompute) != "full":
        out.append("parallel.recompute=full (keep only each layer's input)")
    if p.micro_batch > 1:
        out.append(f"parallel.micro_batch={max(1, p.micro_batch // 2)}")
    return out


def explain(
    cfg,
    run_dir: str,
    exc: BaseException,
    states_bytes: int | None,
    capacity: int | None,
    rank: int = 0,
    node: str = "",
    built: bool | None = None,
) -> str:
    """The `oom` event and the message: the overflowing part, planned against measured, and its levers.
    states_bytes: GPU memory allocated once the engine was built (None: not built, or not measurable); built:
    whether the engine was built (default: states_bytes is not None)."""
    built = states_bytes is not None if built is None else built
    plan = _plan(run_dir)
    mem = plan.get("memory_bytes") or {}
    planned_states = sum(int(mem.get(k, 0)) for k in ("weights", "grads", "optimizer"))
    planned_acts = int(mem.get("activations", 0))
    capacity = capacity or int(plan.get("gpu_memory_bytes", 0)) or None
    if not built:
        part = "states"
        why = "while the model and optimizer were being built"
    elif states_bytes is None:  # built, not measured: the plan decides
        part = "states" if capacity and planned_states >= STATES_FULL * capacity else "activations"
        why = (
            f"planned: states {planned_states / 2**30:.2f} GiB, activations {planned_acts / 2**30:.2f} GiB "
            "(nothing measured)"
        )
    elif capacity and states_bytes >= STATES_FULL * capacity:
        part = "states"
        why = (
            f"the model states took {states_bytes / 2**30:.2f} GiB of {capacity / 2**30:.2f} GiB before the first step"
        )
    else:
        part = "activations"
        why = (
            f"the model states took {states_bytes / 2**30:.2f} GiB (planned {planned_states / 2**30:.2f}); the "
            f"activations (planned {planned_acts / 2**30:.2f} GiB) did not fit in the rest"
        )
    fix = levers(cfg, part)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    append_event(
        run_dir,
        "oom",
        rank=rank,
        node=node,
        part=part,
        states_bytes=states_bytes,
        planned_states_bytes=planned_states,
        planned_activations_bytes=planned_acts,
        gpu_memory_bytes=capacity,
        levers=fix,
        error=first[:500],
    )
    return (
        f"CUDA out of memory on rank {rank}{f' ({node})' if node else ''}: the {part} overflowed ({why}); "
        f"fix: {'; or '.join(fix)}. Planned per GPU: states {planned_states / 2**30:.2f} GiB, activations "
        f"{planned_acts / 2**30:.2f} GiB (run.dir/plan.json); `meshrun action=plan` with the fix shows the new "
        f"total. torch: {first[:300]}"
    )
