"""Tensor / sequence parallel building blocks: communication regions and parallel layers."""

from training.parallel.collectives import (
    all_reduce,
    copy_to_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from training.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    set_tp_meta,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "all_reduce",
    "copy_to_tp",
    "group_rank",
    "group_size",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "column_parallel_linear",
    "set_tp_meta",
    "vocab_parallel_cross_entropy",
]
