"""Samples from indexed datasets: windows packed across documents, shuffled without a table, blended by weight.

Window k of a dataset of T tokens is tokens [k s, k s + s + 1) of its token file (s = model.seq_length):
windows cross document boundaries (each document ends with the end-of-document token) and share one token
with the next, as the byte corpus does (training/data/sources.py). A dataset has W = (T - 1) // s windows.

Order: the dataset's j-th sample is window P_e(j mod W) of epoch e = j // W, where P_e is a keyed
permutation of [0, W) computed on the spot (a 4-round Feistel network over the next power of four, walked
until it lands inside [0, W)): nothing is built, cached or scanned at start-up, whatever the dataset's size,
and sample j depends on (seed, dataset position, split, j) only, never on the layout.

Blending: the global stream is cut into blocks of B = 65536 samples; in every block dataset d gets n_d of
them (the largest-remainder rounding of w_d B, so each share is within 1/B of its weight) at the positions
(k + 1/2) B / n_d, k < n_d, merged in order (the schedule Megatron-LM's blended dataset builds one sample at
a time: each dataset is always within one sample of its share). Sample i is then dataset d's sample
(i // B) n_d + (its rank among d's positions in the block). Constant time per sample, exact on resume.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np

from training.data.indexed import IndexedDataset, open_dataset
from training.data.sources import DataError, SampleSource

BLOCK = 1 << 16
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit mix."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def stable_key(*parts) -> int:
    """A 64-bit key from the parts' text (stable across Python processes, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class Permutation:
    """A keyed bijection of [0, n), evaluated per index (no table)."""

    ROUNDS = 4

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix64(key + r * 0x9E3779B97F4A7C15 & _M64) for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = self._encrypt(i)
        while x >= self.n:  # cycle-walking: the domain is < 4n, so this ends after a few steps
            x = self._encrypt(x)
        return x


class IndexedSource(SampleSource):
    """One dataset's samples: shuffled windows of seq + 1 tokens, epoch after epoch."""

    def __init__(self, ds: IndexedDataset, seq: int, key: int, name: str = ""):
        self.ds, self.seq, self.key = ds, seq, key
        self.windows = (ds.num_tokens - 1) // seq
        if self.windows < 1:
            raise DataError(
                f"{ds.prefix}: {ds.num_tokens} tokens cannot fill one sample of model.seq_length={seq} "
                f"+ 1 tokens; use a shorter model.seq_length or a larger dataset"
            )
        self.num_samples = 1 << 62
        self._perms: dict = {}

    def window(self, index: int) -> int:
        """The window the dataset's sample `index` reads."""
        epoch, pos = divmod(index, self.windows)
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 4:
                self._perms.clear()
            perm = self._perms[epoch] = Permutation(self.windows, stable_key(self.key, epoch))
        return perm(pos)

    def sample(self, index: int) -> np.ndarray:
        start = self.window(index) * self.seq
        return np.asarray(self.ds.tokens[start : start + self.seq + 1], dtype=np.int64)


def block_counts(weights: Sequence[float], block: int = BLOCK) -> list[int]:
    """Samples per dataset in a block: largest-remainder rounding of w_d * block (ties: earlier dataset)."""
    total = float(sum(weights))
    exact = [w / total * block for w in weights]
    counts = [int(np.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in order[: block - sum(counts)]:
        counts[d] += 1
    return counts


class BlendedSource(SampleSource):
    """Several sources mixed by weight; one source passes straight through."""

    def __init__(self, sources: Sequence[SampleSource], weights: Sequence[float], block: int = BLOCK):
        self.sources, self.block = list(sources), block
        self.counts = block_counts(weights, block)
        pos, ds, rank = [], [], []
        for d, n in enumerate(self.counts):
            k = np.arange(n, dtype=np.float64)
            pos.append((k + 0.5) * block / max(n, 1))
            ds.append(np.full(n, d, dtype=np.int32))
            rank.append(np.arange(n, dtype=np.int64))
        order = np.lexsort((np.concatenate(ds), np.concatenate(pos)))
        self.dataset_of = np.concatenate(ds)[order]
        self.rank_of = np.concatenate(rank)[order]
        self.num_samples = 1 << 62

    def locate(self, index: int) -> tuple[int, int]:
        """(dataset, that dataset's sample index) of the blended stream's sample `index`."""
        b, p = divmod(index, self.block)
        d = int(self.dataset_of[p])
        return d, b * self.counts[d] + int(self.rank_of[p])

    def sample(self, index: int) -> np.ndarray:
        d, j = self.locate(index)
        return self.sources[d].sample(j)


# ---- the run's sources -----------------------------------------------------------------------------------
def valid_prefixes(cfg, descriptions: Sequence[dict]) -> list[str]:
    """data.valid_prefixes, or each training prefix's held-out split (NAME.valid, written by prepare)."""
    if cfg.data.valid_prefixes:
        return list(cfg.data.valid_prefixes)
    out = []
    for prefix, desc in zip(cfg.data.prefixes, descriptions):
        name = (desc or {}).get("valid_prefix")
        if not name:
            raise DataError(
                f"train.eval_every={cfg.train.eval_every} needs held-out data but {prefix} has no "
                f"validation split; prepare it with prepare.valid_fraction>0, or give "
                f"data.valid_prefixes=[...] (or train.eval_every=0)"
            )
        out.append(os.path.join(os.path.dirname(prefix), name))
    return out


def open_all(prefixes: Sequence[str], may_describe: bool) -> list[tuple]:
    return [open_dataset(p, may_describe) for p in prefixes]


def check_vocab(cfg, prefixes: Sequence[str], descriptions: Sequence[dict]) -> None:
    for prefix, desc in zip(prefixes, descriptions):
        need = int(desc.get("min_vocab_size") or 0)
        if cfg.model.vocab_size < need:
            raise DataError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than {prefix}'s vocabulary "
                f"({need} tokens, {desc.get('tokenizer', {}) and 'its tokenizer' or 'its largest id + 1'}); "
                f"set model.vocab_size={need} or leave it unset (meshrun takes the tokenizer's)"
            )


def blend_weights(cfg, datasets: Sequence[IndexedDataset], weights: Sequence[float] | None) -> list[float]:
    """data.weights, or each dataset's share of the tokens when none are given."""
    if weights:
        if len(weights) != len(datasets):
            raise DataError(
                f"data.weights has {len(weights)} entries for {len(datasets)} data.prefixes; "
                f"give one weight per prefix (or none: weights by token count)"
            )
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"data.weights={list(weights)}: weights must be >= 0 with a positive sum")
        return [float(w) for w in weights]
    return [float(ds.num_tokens) for ds in datasets]


def make_indexed_source(cfg, split: str = "train", may_describe: bool = True) -> BlendedSource:
    """The blended sample source of the training prefixes or (split="valid") of their held-out data."""
    if not cfg.data.prefixes:
        raise DataError(
            "data=indexed needs data.prefixes=[DIR/NAME,...] (datasets written by "
            "`meshrun action=prepare` or Megatron-LM)"
        )
    opened = open_all(cfg.data.prefixes, may_describe)
    check_vocab(cfg, cfg.data.prefixes, [d for _, d in opened])
    weights = cfg.data.weights
    if split == "valid":
        explicit = bool(cfg.data.valid_prefixes)
        prefixes = valid_prefixes(cfg, [d for _, d in opened])
        opened = open_all(prefixes, may_describe)
        check_vocab(cfg, prefixes, [d for _, d in opened])
        weights = None if explicit else weights
    else:
        prefixes = list(cfg.data.prefixes)
    datasets = [ds for ds, _ in opened]
    w = blend_weights(cfg, datasets, weights)
    seq = cfg.model.seq_length
    sources = [
        IndexedSource(ds, seq, stable_key(cfg.train.seed, split, d), prefix)
        for d, (ds, prefix) in enumerate(zip(datasets, prefixes))
    ]
    return BlendedSource(sources, w)
