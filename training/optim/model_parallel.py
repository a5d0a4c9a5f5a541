"""Model-parallel gradient finalisation: the reductions a gradient needs before the data-parallel one.

- Sequence parallelism: a replicated parameter used on sequence shards (`sequence_parallel`, e.g. norm
  weights) gets on each tp rank the grad of its shard only; the sum over tp is the full grad.
- Tied embeddings with pp > 1: the first stage (input embedding) and the last (output layer) hold a copy
  of `embedding.word.weight` each; summing their grads over the embedding group keeps the copies equal.
`counts_in_norm` says which rank's copy of a parameter enters the global grad norm, so that every element
of the model counts exactly once.
"""

from __future__ import annotations

from typing import Any

import torch

from training.contract.layout_rules import sequence_parallel_on
from training.parallel import collectives as comm

TIED_EMBEDDING = "embedding.word.weight"
"""The parameter name the first and the last pipeline stage share when embeddings are tied."""


def counts_in_norm(name: str, param: torch.Tensor, mesh) -> bool:
    """Whether this rank's copy of `param` enters the global grad norm (each element exactly once)."""
    if getattr(param, "tp_shard_dim", None) is None and mesh.tp_rank != 0:
        return False  # replicated over tp: tp rank 0 speaks for the group
    if name == TIED_EMBEDDING and mesh.pp > 1 and not mesh.is_first_stage:
        return False  # the last stage's copy of the tied embedding: the first stage counts it
    return True


def allreduce_flat(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum `tensors` in place over `group` with one all-reduce per dtype (identity for None / size 1)."""
    if group is None or comm.world_size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        comm.all_reduce_op(flat, group=group)
        pos = 0
        for t in same:
            t.copy_(flat[pos : pos + t.numel()].view_as(t))
            pos += t.numel()


class ModelParallelGradSync:
    """Finalises the main grads of this rank's parameters over tp (sp) and the pipeline ends (tied embedding)."""

    def __init__(self, names: list[str], params: list[torch.nn.Parameter], cfg, mesh):
        self.mesh = mesh
        sp = sequence_parallel_on(cfg.parallel.sp, mesh.tp)
        self.sp_params = [i for i, p in enumerate(params) if sp and getattr(p, "sequence_parallel", False)]
        self.tied_index = None
        if mesh.pp > 1 and cfg.model.tie_embeddings and TIED_EMBEDDING in names:
            self.tied_index = names.index(TIED_EMBEDDING)

    def param_indices(self) -> list[int]:
        """The parameters (indices in construction order) whose grads this reduces before the dp reduction."""
        return self.sp_params + ([self.tied_index] if self.tied_index is not None else [])

    def __call__(self, grads: list[torch.Tensor]) -> None:
        """Reduce in place the grads (one per parameter, in the order given at construction) that need it."""
        if self.sp_params:
            allreduce_flat([grads[i] for i in self.sp_params], self.mesh.tp_group)
        if self.tied_index is not None and (self.mesh.is_first_stage or self.mesh.is_last_stage):
            comm.all_reduce_op(grads[self.tied_index], group=self.mesh.embedding_group)
