"""The MoE routing figures of a logged step (model.num_experts > 0): the metrics row's moe_aux_loss,
moe_max_load and moe_dropped_tokens, and rank 0's `moe_load` event with the tokens per expert of each layer."""

from __future__ import annotations

from training.contract.rundir.events import append_event
from training.model.moe import moe_metrics
from training.observe.observer import StepObserver, StepRecord

ROW_FIELDS = ("moe_aux_loss", "moe_max_load", "moe_dropped_tokens")


class MoeLoad(StepObserver):
    """One of the loop's observers (observe/observer.py); its figures are a collective over dp and pp."""

    def __init__(self, cfg, run_dir: str, mesh, chunks):
        self.run_dir, self.mesh, self.chunks = run_dir, mesh, chunks
        self.num_layers, self.num_experts = cfg.model.num_layers, cfg.model.num_experts

    def after_step(self, step: int, record: StepRecord) -> None:
        if not record.logged or self.num_experts <= 0:
            return
        load = moe_metrics(self.chunks, self.mesh, self.num_layers, self.num_experts)
        record.fields.update({k: load[k] for k in ROW_FIELDS})
        if self.mesh.rank == 0:
            append_event(
                self.run_dir,
                "moe_load",
                step=step,
                tokens_per_expert=load["tokens_per_expert"],
                max_load=load["max_load"],
            )
