"""Which rank and which layer first produced a non-finite value, asked only once the loss is non-finite.

The failing step's micro-batches are replayed forward (no graph) through the same schedule, so pipeline stages
exchange activations as in training, with a forward hook on every module of every model chunk. Each rank keeps
the first module, in execution order, whose output holds a NaN or an infinity (an inner module finishes before
the module around it, so that is the innermost layer where it appeared). The ranks gather their findings and
the first one in model order (virtual pipeline stage, then execution order) is the answer: rank 0 appends a
`nonfinite` event (step, rank, node, layer, every rank's finding) and every rank with a finding says it on stderr.

The replay restores each chunk's dropout counter first, so its dropout masks are the failing step's, and puts it
back after, so a resumed run stays exact. It runs once per trainer: a run whose loss stays non-finite (fp16
overflow skips, or broken weights) is not replayed at every step. Costs nothing until the loss is non-finite.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from training.contract.rundir.events import append_event
from training.parallel import collectives as comm


def _non_finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return any(_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return False


def find_first_nonfinite(chunks: list[torch.nn.Module], replay) -> dict[str, Any] | None:
    """Run `replay()` with hooks on every module of `chunks`; the first module whose output is non-finite as
    {"chunk", "layer", "order"}, or None."""
    first: list[dict[str, Any]] = []
    counter = [0]
    handles = []

    def hook_for(chunk_index: int, name: str):
        def hook(module, inputs, output):
            counter[0] += 1
            if not first and _non_finite(output):
                first.append(
                    {
                        "chunk": chunk_index,
                        "layer": name or type(module).__name__,
                        "order": counter[0],
                        "module": type(module).__name__,
                        "input_finite": not _non_finite(inputs),
                    }
                )

        return hook

    for c, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            handles.append(module.register_forward_hook(hook_for(c, name)))
    try:
        with torch.no_grad():
            replay()
    finally:
        for h in handles:
            h.remove()
    return first[0] if first else None


def probe_nonfinite(trainer, micro, micro_steps_before: list[int], loss: float) -> dict[str, Any] | None:
    """Every rank calls it (the loss is global, so every rank knows) right after the failing forward/backward.
    Returns the first finding over all ranks, or None when the replay found nothing non-finite."""
    if getattr(trainer, "nan_probed", False):
        return None
    trainer.nan_probed = True
    mesh, chunks = trainer.mesh, trainer.chunks
    after = [int(getattr(c, "micro_step", 0)) for c in chunks]

    def replay():
        for c, m in zip(chunks, micro_steps_before):
            if hasattr(c, "micro_step"):
                c.micro_step = m
        trainer.schedule.forward_only(micro)

    try:
        mine = find_first_nonfinite(chunks, replay)
    finally:
        for c, m in zip(chunks, after):
            if hasattr(c, "micro_step"):
                c.micro_step = m
    from training.observe.straggler import node_name

    node = node_name()
    if mine is not None:
        # Virtual stage of chunk c on pipeline rank p (interleaved schedules): c * pp + p.
        mine.update(rank=mesh.rank, node=node, stage=mine["chunk"] * mesh.pp + mesh.pp_rank)
    every: list[Any] = [mine]
    if comm.is_initialized() and comm.world_size() > 1:
        every = [None] * comm.world_size()
        comm.all_gather_object(every, mine)
    found = [f for f in every if f]
    step = trainer.state.step + 1  # the step being taken (the loop counts it after the optimizer)
    if mine is not None:
        print(
            f"nonfinite: step {step}: rank {mesh.rank} on {node}: layer {mine['layer']} ({mine['module']}) "
            f"produced the first non-finite value on this rank"
            + ("" if mine["input_finite"] else " (its input was already non-finite)"),
            file=sys.stderr,
        )
    if not found:
        if mesh.rank == 0:
            print(
                f"nonfinite: step {step}: loss {loss}; replaying the step's forward found no non-finite layer "
                "output (the backward or the loss reduction produced it)",
                file=sys.stderr,
            )
            append_event(trainer.run_dir, "nonfinite", step=step, loss=str(loss), rank=None, layer=None, findings=[])
        return None
    first = min(found, key=lambda f: (f["stage"], f["order"], f["rank"]))
    if mesh.rank == 0:
        print(
            f"nonfinite: step {step}: loss {loss}; first non-finite value from rank {first['rank']} on "
            f"{first['node']}, layer {first['layer']}",
            file=sys.stderr,
        )
        append_event(
            trainer.run_dir,
            "nonfinite",
            step=step,
            loss=str(loss),
            rank=first["rank"],
            node=first["node"],
            layer=first["layer"],
            findings=found,
        )
    return first
