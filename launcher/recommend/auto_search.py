"""What parallel=auto searches (launcher/recommend/auto.py chooses from it; `action=recommend` ranks the same
layouts under parallel=auto): the command line's pinned parallel.* keys and the default global batch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from training.contract.config import Config

GLOBAL_BATCH_TOKENS = 2**20
"""Tokens per optimizer step when parallel.global_batch is not given: about a million, as Megatron-LM's and
Llama 3's published recipes for 8B-70B models use (128 sequences of 8192 tokens)."""


def pinned_keys(overrides: Sequence[str]) -> list[str]:
    """The parallel.* keys the command line sets ('parallel.tp=8' -> 'tp'); a group choice pins none."""
    keys = []
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~").strip()
        if key.startswith("parallel.") and key.count(".") == 1:
            keys.append(key.split(".", 1)[1])
    return keys


def default_global_batch(cfg: Config) -> int:
    """GLOBAL_BATCH_TOKENS in sequences, a power of two (dp degrees of power-of-two clusters divide it)."""
    return 2 ** max(0, round(math.log2(max(1, GLOBAL_BATCH_TOKENS // cfg.model.seq_length))))


def searched_config(cfg: Config, overrides: Sequence[str]) -> Config:
    """cfg as parallel=auto searches it: auto off, the default global batch unless the command line gives one."""
    par = replace(cfg.parallel, auto=False)
    if "global_batch" not in pinned_keys(overrides):
        par = replace(par, global_batch=default_global_batch(cfg))
    return replace(cfg, parallel=par)
