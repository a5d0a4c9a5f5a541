"""The sharding description: every tensor a rank holds, as rectangular chunks of a layout-free global tensor.

DCP can only reshard what it knows the global placement of (a plain per-rank tensor under a shared key is
taken as replicated: docs/PLATFORM.md). So each piece a rank holds is described by its offsets in the
*stored* global tensor of its parameter, and all pieces of one key become one ShardedTensor:

- model weights: the rank's tp shard, placed at tp_rank x local size on `param.tp_shard_dim`;
- optimizer states (fp32 master, exp_avg, exp_avg_sq): a ZeRO-1 shard is an arbitrary flat range of the rank's
  flattened parameters, i.e. for each parameter it touches a flat range of that parameter's local tp shard,
  which splits into at most a few rectangles (a partial row, full rows, a partial row), each placed the same way;
- vocabulary-padded tensors (`embedding.word.weight`, `output.weight`) are stored with only their first
  vocab_size rows, because padding depends on tp and a checkpoint must load at any tp.

Replicated copies are written once: by dp rank 0 for model weights and zero=0 states, by tp rank 0 for
parameters replicated over tp. Loading is the same description with the local tensors as destinations,
so DCP copies the overlapping parts of whatever chunks the saved layout had.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from training.parallel import collectives as comm

# torch.distributed._shard (ShardedTensor) is imported where it is used: it pulls in DCP and DTensor, about
# 1.1 s of CPU per rank, which a fresh start does not need before its first save (training/observe/startup.py).
if TYPE_CHECKING:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

VOCAB_PARAMS = ("embedding.word.weight", "output.weight")
"""Parameters whose dim 0 is the (padded) vocabulary."""


@dataclass
class ParamInfo:
    """Where one parameter's local tensor sits in its global tensor."""

    name: str
    """Layout-independent name (docs/CONTRACTS.md)."""
    local_shape: tuple[int, ...]
    """Shape of the tensor this rank holds."""
    stored_shape: tuple[int, ...]
    """Shape in the checkpoint: the global shape with vocabulary padding removed."""
    tp_shard_dim: int | None
    """Dimension split over tp, None when replicated over tp."""
    tp_rank: int
    """This rank's position in its tp group."""


@dataclass
class Piece:
    """One rectangle of a stored global tensor held by this rank."""

    key: str
    """State-dict key, e.g. `model/layers.0.mlp.fc1.weight` or `optim/exp_avg/...`."""
    tensor: torch.Tensor
    """The local data (a view into the live buffer where possible: saves and loads go straight through)."""
    offsets: tuple[int, ...]
    """Offsets of the rectangle in the stored global tensor."""
    global_shape: tuple[int, ...]
    """The stored global tensor's shape."""


def param_info(name: str, param: torch.Tensor, tp_rank: int, vocab_size: int) -> ParamInfo:
    """Read the placement attributes the model puts on each parameter (tp_shard_dim, global_shape)."""
    dim = getattr(param, "tp_shard_dim", None)
    global_shape = tuple(getattr(param, "global_shape", tuple(param.shape)))
    stored = list(global_shape)
    if name in VOCAB_PARAMS and stored[0] >= vocab_size:
        stored[0] = vocab_size
    return ParamInfo(name, tuple(param.shape), tuple(stored), dim, tp_rank)


def flat_range_rects(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split flat elements [start, end) of a contiguous tensor of `shape` into rectangles.

    Returns (offsets, sizes, flat_start) per rectangle, in flat order. At most 2 x ndim - 1 rectangles.
    """
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,), start)]
    inner = 1
    for d in shape[1:]:
        inner *= d
    first_row, last_row = start // inner, (end - 1) // inner
    out = []

    def sub(row: int, lo: int, hi: int):
        for offs, sizes, flat in flat_range_rects(shape[1:], lo, hi):
            out.append(((row,) + offs, (1,) + sizes, row * inner + flat))

    if first_row == last_row:
        if start % inner == 0 and end - start == inner:
            return [((first_row,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:]), start)]
        sub(first_row, start - first_row * inner, end - first_row * inner)
        return out
    row = first_row
    if start % inner:
        sub(row, start % inner, inner)
        row += 1
    full_end = end // inner  # rows [row, full_end) are complete
    if full_end > row:
        out.append(((row,) + (0,) * (len(shape) - 1), (full_end - row,) + tuple(shape[1:]), row * inner))
    if end % inner:
        sub(full_end, 0, end % inner)
    return out


def pieces_for(key: str, info: ParamInfo, flat: torch.Tensor, local_start: int) -> list[Piece]:
    """Pieces of `flat`, which holds flat elements [local_start, local_start + numel) of the local shard."""
    pieces = []
    for offs, sizes, flat_start in flat_range_rects(info.local_shape, local_start, local_start + flat.numel()):
        numel = 1
        for s in sizes:
            numel *= s
        view = flat[flat_start - local_start : flat_start - local_start + numel].view(sizes)
        glob = list(offs)
        if info.tp_shard_dim is not None:
            glob[info.tp_shard_dim] += info.tp_rank * info.local_shape[info.tp_shard_dim]
        # Clip to the stored shape (drops vocabulary padding rows); a rectangle fully in padding vanishes.
        for d, (o, s) in enumerate(zip(glob, sizes)):
            keep = min(o + s, info.stored_shape[d]) - o
            if keep <= 0:
                view = None
                break
            if keep < s:
                view = view.narrow(d, 0, keep)
        if view is not None:
            pieces.append(Piece(key, view, tuple(glob), info.stored_shape))
    return pieces


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or for a contiguous CPU view into a larger buffer (a slice of a flat parameter or optimizer
    buffer) the same memory as a tensor whose storage is exactly its bytes: no copy.

    DCP's writer clones every tensor whose storage is larger than the tensor (torch.save would otherwise
    write the whole storage): for views of flat buffers that is a full extra copy of the model state per save
    (~0.9 s of a 3.3 s save of 192 MiB, bench/bench_checkpoint.py). A GPU tensor is copied to the host
    compactly anyway. The byte view goes through NumPy (torch.from_numpy wraps exactly the array's bytes),
    as uint8 so that any dtype, bf16 included, takes this path."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes or t.numel() == 0:
        return t
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


def exchange_chunk_lists(pieces: list[Piece], group=None) -> list:
    """The collective part of to_state_dict: every rank's (rank, [(key, offsets, shape, global shape, dtype,
    device)]) of its pieces, in rank order."""
    mine = [
        (p.key, p.offsets, tuple(p.tensor.shape), p.global_shape, str(p.tensor.dtype), str(p.tensor.device))
        for p in pieces
    ]
    gathered: list = [None] * comm.world_size(group)
    comm.all_gather_object(gathered, (comm.rank(), mine), group=group)
    return gathered


def to_state_dict(pieces: Iterable[Piece], group=None) -> dict[str, ShardedTensor]:
    """Wrap pieces as ShardedTensors whose global metadata lists every rank's chunks of each key.

    One all_gather_object exchanges the chunk lists, so every ShardedTensor is validated for full coverage
    without overlap (a layout bug fails loudly here instead of writing a silently wrong checkpoint).
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    pieces = list(pieces)
    rank = comm.rank()
    gathered = exchange_chunk_lists(pieces, group)
    if comm.moves_no_data():
        # The rehearsal's fake backend (training/rehearse/runner.py): the exchange is issued and recorded, but
        # every rank's entry is this rank's list, which the global check below would refuse; this rank's pieces
        # are wrapped as a resume's destinations are (local chunks, the global size).
        return to_load_state_dict(pieces)
    by_key: dict[str, list[ShardMetadata]] = {}
    local_keys = {p.key for p in pieces}
    for r, entries in gathered:
        for key, offs, sizes, _glob, _dtype, device in entries:
            if key in local_keys:
                dev = "cpu" if device == "cpu" else device
                by_key.setdefault(key, []).append(ShardMetadata(list(offs), list(sizes), f"rank:{r}/{dev}"))
    out: dict[str, ShardedTensor] = {}
    grouped: dict[str, list[Piece]] = {}
    for p in pieces:
        grouped.setdefault(p.key, []).append(p)
    for key, plist in grouped.items():
        shards_md = by_key[key]
        local = []
        for p in plist:
            md = next(m for m in shards_md if m.placement.rank() == rank and tuple(m.shard_offsets) == p.offsets)
            local.append(Shard(p.tensor, md))
        # ShardedTensor checks every local shard against these properties: an async save's staging buffers
        # are pinned for a GPU source (training/checkpoint/staging.py), so say what the buffers are.
        props = TensorProperties(dtype=plist[0].tensor.dtype, pin_memory=plist[0].tensor.is_pinned())
        meta = ShardedTensorMetadata(shards_md, torch.Size(plist[0].global_shape), props)
        out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta, process_group=group)
    return out


def to_load_state_dict(pieces: Iterable[Piece]) -> dict[str, torch.Tensor]:
    """Destinations for dcp.load: each key's local pieces, as a ShardedTensor (no collective).

    When loading, replicas overlap (every dp rank wants the same weights), which ShardedTensor's global
    validation rejects; DCP's load planner reads only the local shards and the global size, so the global
    metadata here is a placeholder naming this rank. A key whose only piece is the whole tensor stays plain.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    rank = comm.rank() if comm.is_initialized() else 0
    grouped: dict[str, list[Piece]] = {}
    for p in pieces:
        grouped.setdefault(p.key, []).append(p)
    out: dict[str, torch.Tensor] = {}
    for key, plist in grouped.items():
        first = plist[0]
        if len(plist) == 1 and tuple(first.tensor.shape) == first.global_shape:
            out[key] = first.tensor
            continue
        device = "cpu" if first.tensor.device.type == "cpu" else str(first.tensor.device)
        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{rank}/{device}"])
        st = ShardedTensorBase.__new__(
            ShardedTensor,
            spec,
            *first.global_shape,
            dtype=first.tensor.dtype,
            layout=torch.strided,
            pin_memory=False,
            requires_grad=False,
        )
        st._local_shards = [
            Shard(p.tensor, ShardMetadata(list(p.offsets), list(p.tensor.shape), f"rank:{rank}/{device}"))
            for p in plist
        ]
        st._prepare_init(process_group=None, init_rrefs=False)  # what the public constructors set up
        out[key] = st
    return out
