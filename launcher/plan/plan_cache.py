"""What make_plan would recompute for every layout of one search, computed once (pure Python, no torch).

`action=recommend` plans thousands of layouts of one model on one cluster. A stage's model states depend on
tp x pp x cp x dp x zero x ep (and the offload and bucket settings), not on the micro-batch, virtual stages, sp
or recompute the layouts of such a group differ in; the model's parameter and FLOP counts on fewer fields still.
PlanCache keys each on exactly the parallel fields it reads, found by excluding those it provably does not
read: a field added to ParallelConfig later is part of every key until someone shows otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
from typing import NamedTuple

from launcher.plan.model_size import hardware_flops_per_step, model_flops_per_step, params_active, params_total
from launcher.plan.stage_states import StageKind, stage_kinds
from training.contract.config import Config, ParallelConfig


class ModelFigures(NamedTuple):
    """The counts of a plan that depend on the model and a few parallel fields only."""

    params_total: int
    params_active: int
    model_flops_per_step: int
    hardware_flops_per_step: int


def model_figures(cfg: Config) -> ModelFigures:
    """cfg's parameter counts and FLOPs per step (launcher/plan/model_size.py)."""
    return ModelFigures(params_total(cfg), params_active(cfg), model_flops_per_step(cfg), hardware_flops_per_step(cfg))


def _key_of(not_read: set) -> Callable[[ParallelConfig], tuple]:
    names = [f.name for f in fields(ParallelConfig) if f.name not in not_read]
    return attrgetter(*names)  # type: ignore[return-value]  # (several names: a tuple)


# Read by neither stage_states nor what it calls (model_size.stage_params, memory.model_state_bytes and
# param_gather_bytes, levers.zero3_gathered_bytes and offload_bytes, moe.expert_dp); dp enters the key as derived.
# (zero3_gathered_bytes reads vpp: two neighbouring units or three.)
_KINDS_KEY = _key_of(
    {
        "schedule",
        "sp",
        "micro_batch",
        "global_batch",
        "recompute",
        "recompute_num_layers",
        "allow_tp_across_nodes",
        "overlap_grad_reduce",
        "overlap_p2p",
        "cp_comm",
        "offload_dir",
    }
)
# Read by none of model_figures' functions (which read tp, pp, vpp, schedule, recompute, recompute_num_layers and
# global_batch of the parallel fields).
_FIGURES_KEY = _key_of(
    {
        "cp",
        "cp_comm",
        "sp",
        "zero",
        "offload",
        "offload_dir",
        "zero3_reshard_after_forward",
        "micro_batch",
        "allow_tp_across_nodes",
        "bucket_mb",
        "overlap_grad_reduce",
        "overlap_p2p",
    }
)


class PlanCache:
    """stage_kinds and model_figures of the layouts of one search, each computed once. Valid for configs that
    share `base`'s model, train and cluster objects (every layout the search derives from it: only its parallel
    config is new), which nobody changes during the search; anything else is computed afresh. The results are
    shared between plans: read them, do not change them."""

    def __init__(self, base: Config) -> None:
        self._model, self._train, self._cluster = base.model, base.train, base.cluster
        self._kinds: dict[tuple, dict[tuple[bool, bool], StageKind]] = {}
        self._figures: dict[tuple, ModelFigures] = {}

    def _shares_base(self, cfg: Config) -> bool:
        return cfg.model is self._model and cfg.train is self._train and cfg.cluster is self._cluster

    def stage_kinds(self, cfg: Config, dp: int) -> dict[tuple[bool, bool], StageKind]:
        if not self._shares_base(cfg):
            return stage_kinds(cfg, dp)
        key = (dp, _KINDS_KEY(cfg.parallel))
        found = self._kinds.get(key)
        if found is None:
            found = self._kinds[key] = stage_kinds(cfg, dp)
        return found

    def model_figures(self, cfg: Config) -> ModelFigures:
        if not self._shares_base(cfg):
            return model_figures(cfg)
        key = _FIGURES_KEY(cfg.parallel)
        found = self._figures.get(key)
        if found is None:
            found = self._figures[key] = model_figures(cfg)
        return found
