"""A pipeline stage's model states: everything of one rank's memory but its activations (pure Python, no torch).

A stage's parameters, model states and gathers depend only on whether it holds the embedding (first) and the head
(last); the middle stages share them (every split of training/contract/stage_split.py gives the middle pipeline
ranks the same layers: only the first and the last rank's counts may differ). make_plan takes each stage kind's memory from stage_kinds and fills in
the stage's activations and total.
"""

from __future__ import annotations

from typing import NamedTuple

from launcher.plan.context_memory import optimizer_shard_degree
from launcher.plan.levers import offload_bytes, zero3_gathered_bytes
from launcher.plan.memory import model_state_bytes, param_gather_bytes
from launcher.plan.model_size import StageParams, stage_params
from launcher.plan.moe import expert_dp
from training.contract.config import Config


def stage_states(cfg: Config, st: int, dp: int) -> tuple[StageParams, dict[str, int]]:
    """(stage_params, the model-state bytes of one rank of stage st: weights, grads, optimizer, zero3_gathered,
    the offload figures and param_gather), everything of a stage's memory but its activations. It depends on
    the stage only through whether it is the first and whether it is the last (model_size.stage_params)."""
    par = cfg.parallel
    sp_ = stage_params(cfg, st)
    mem = model_state_bytes(sp_.total - sp_.experts, cfg.train.precision, par.zero, optimizer_shard_degree(cfg, dp))
    if sp_.experts:  # the experts' states shard over their own (expert-data-parallel) group
        experts = model_state_bytes(sp_.experts, cfg.train.precision, par.zero, expert_dp(cfg, dp))
        mem = {k: mem[k] + experts[k] for k in mem}
    mem["zero3_gathered"] = zero3_gathered_bytes(cfg, st) if par.zero >= 3 else 0
    mem.update(offload_bytes(cfg, sp_.total, optimizer_shard_degree(cfg, dp)))  # device optimizer bytes, host / files
    if sp_.experts:  # dense and expert states, each sharded over its own group
        dense = offload_bytes(cfg, sp_.total - sp_.experts, optimizer_shard_degree(cfg, dp))
        experts = offload_bytes(cfg, sp_.experts, expert_dp(cfg, dp))
        mem.update({k: dense[k] + experts[k] for k in dense})
    # The dense optimizer's gather window, and the expert optimizer's own over its group: the loop defers both
    # (training/optim/optimizer.py _update: the dense gather is in flight when the experts' starts), so both
    # windows are held at once until the next forward waits for them.
    mem["param_gather"] = param_gather_bytes(cfg, sp_.total - sp_.experts, optimizer_shard_degree(cfg, dp))
    if sp_.experts:
        mem["param_gather"] += param_gather_bytes(cfg, sp_.experts, expert_dp(cfg, dp))
    return sp_, mem


class StageKind(NamedTuple):
    """The first, a middle or the last stage of a pipeline, before its activations."""

    params: StageParams
    memory: dict[str, int]
    """plan.json's per-stage memory_bytes in its key order, activations and total 0 (make_plan fills them in)."""
    model_states: int
    """weights + grads + optimizer."""


def stage_kinds(cfg: Config, dp: int) -> dict[tuple[bool, bool], StageKind]:
    """Each kind of stage of cfg's pipeline by (first, last): (True, True) alone when pp = 1."""
    par = cfg.parallel
    out = {}
    for st in sorted({0, min(1, par.pp - 1), par.pp - 1}):  # one stage of each kind
        sp_, states = stage_states(cfg, st, dp)
        mem = {k: states[k] for k in ("weights", "grads", "optimizer")}
        mem["activations"] = 0
        mem.update({k: v for k, v in states.items() if k not in mem and k != "param_gather"})
        mem["total"] = 0
        # Transient, beside total (the README's and users' model-state + activation figures): kept back in
        # reserve_bytes with the CUDA reserve, so `fits` and the headroom count it.
        mem["param_gather"] = states["param_gather"]
        out[(st == 0, st == par.pp - 1)] = StageKind(sp_, mem, mem["weights"] + mem["grads"] + mem["optimizer"])
    return out
