"""Layout-independent parameter initialisation and stable seeds.

Each parameter's FULL tensor is generated on the CPU from a generator seeded by (seed, parameter
name), then sliced to this rank's shard along `tp_shard_dim`; so tp=4 starts from exactly the
weights of tp=1, and a parameter's values do not depend on which pipeline stage holds it.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn


def stable_seed(*parts) -> int:
    """A 63-bit seed from any printable parts, identical across processes and runs (unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def full_init(name: str, global_shape, seed: int, init_std: float, num_layers: int, vocab_size: int) -> torch.Tensor:
    """The full fp32 tensor of parameter `name` (contract names, e.g. layers.3.attn.qkv.weight).

    Biases 0, norm weights 1; weights N(0, init_std), output projections of a residual branch
    (attn.proj, mlp.fc2) N(0, init_std / sqrt(2 L)) as in GPT-2 / Megatron; vocabulary padding rows 0.
    """
    shape = tuple(global_shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name.split(".")[-2]:
        return torch.ones(shape)
    std = init_std
    if (
        name.endswith("attn.proj.weight")
        or name.endswith("mlp.fc2.weight")
        or (".mlp.experts." in name and name.endswith(".fc2.weight"))
    ):  # an MoE expert's output projection
        std = init_std / math.sqrt(2.0 * num_layers)
    g = torch.Generator().manual_seed(stable_seed(seed, name))
    full = torch.empty(shape).normal_(0.0, std, generator=g)
    if name in ("embedding.word.weight", "output.weight") and shape[0] > vocab_size:
        full[vocab_size:] = 0.0
    return full


def shard(full: torch.Tensor, tp_shard_dim, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's contiguous slice of a full tensor (the whole tensor when replicated)."""
    if tp_shard_dim is None or tp == 1:
        return full
    return full.chunk(tp, dim=tp_shard_dim)[tp_rank]


@torch.no_grad()
def init_parameters(
    module: nn.Module, seed: int, init_std: float, num_layers: int, vocab_size: int, tp: int, tp_rank: int
) -> None:
    """Initialise every parameter of `module` from its contract name (see module doc)."""
    for name, p in module.named_parameters():
        if p.device.type == "meta":  # a rehearsal's parameters carry no values: only the shard's shape is checked
            local = shard(torch.empty(tuple(p.global_shape), device="meta"), p.tp_shard_dim, tp, tp_rank)
            assert local.shape == p.shape, (name, tuple(local.shape), tuple(p.shape))
            continue
        full = full_init(name, p.global_shape, seed, init_std, num_layers, vocab_size)
        local = shard(full, p.tp_shard_dim, tp, tp_rank)
        assert local.shape == p.shape, (name, tuple(local.shape), tuple(p.shape))
        p.copy_(local)
