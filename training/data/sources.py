"""Training data with layout-independent, deterministic sampling.

The run consumes one endless stream of sample indices: position i of the stream is sample
`order(i)`, a function of (seed, i) only. Global batch of step t is stream positions
[consumed, consumed + global_batch); data-parallel rank r takes its contiguous slice of that and
micro-batch k of the slice. So dp=2 sees exactly the samples of dp=1, split, and the resume point
is just `consumed_samples` (a resumed run with another dp loses or repeats nothing).

Kinds: `synthetic` (random tokens drawn from the seed and the sample index), `text` (files
tokenized to bytes, concatenated once into a uint8 file in the run dir, then memory-mapped) and
`indexed` (Megatron-compatible datasets that `meshrun action=prepare` writes: training/data/indexed.py,
blended by training/data/blend.py). torch is imported only where batches become tensors, so the
launcher can use the numpy parts (it must not import torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from training.contract.config import Config
from training.contract.rundir.files import atomic_path
from training.contract.rundir.paths import RunPaths

if TYPE_CHECKING:  # annotations only: the module itself stays importable without torch
    import torch

BYTE_VOCAB = 256
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


class DataError(ValueError):
    """Invalid data settings a user can fix; the message names the fix. Ranks exit with code 2."""


@dataclass
class CorpusInfo:
    """The cached byte corpus of a text run."""

    path: str
    """uint8 file in run_dir/data holding the concatenated files."""
    num_bytes: int
    """Tokens (bytes) in the corpus."""
    num_files: int
    """Files that went into it."""


def default_corpus_root() -> str:
    """The Python standard library's sources: present on every machine that runs Python."""
    return sysconfig.get_paths()["stdlib"]


def list_text_files(paths: list[str]) -> list[str]:
    """Files named by `paths` (files, or directories searched recursively), sorted for determinism."""
    roots = list(paths) or [default_corpus_root()]
    files: list[str] = []
    for root in roots:
        if not os.path.exists(root):
            raise DataError(
                f"data.paths: {root!r} does not exist; give existing text files or directories "
                f"(data.paths=[dir1,file2]) or leave data.paths empty for the Python standard library's sources"
            )
        if os.path.isdir(root):
            found = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                # Skip installed packages so the default corpus is the same on every machine.
                dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
                found += [os.path.join(dirpath, f) for f in filenames if f.endswith(TEXT_SUFFIXES)]
            if not found:
                raise DataError(
                    f"data.paths: directory {root!r} holds no text files ({', '.join(TEXT_SUFFIXES)}); "
                    f"point data.paths at text files"
                )
            files += sorted(found)
        else:
            files.append(root)
    return files


def build_corpus(cfg: Config, run_dir: str) -> CorpusInfo:
    """Tokenize (bytes) and concatenate the text files once into run_dir/data/corpus-<key>.u8.

    Safe to call from several processes: the file is written under a temporary name and renamed,
    and its name encodes the inputs, so an existing file is reused only when it matches.
    """
    files = list_text_files(cfg.data.paths)
    key = hashlib.sha256(json.dumps([files, cfg.data.max_bytes]).encode()).hexdigest()[:16]
    out_dir = RunPaths(run_dir).data
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"corpus-{key}.u8")
    if os.path.exists(path) and os.path.getsize(path) > 0:
        return CorpusInfo(path, os.path.getsize(path), len(files))
    total = 0
    with atomic_path(path) as tmp:  # a failed copy leaves nothing under the corpus's name
        with open(tmp, "wb") as out:
            for name in files:
                if total >= cfg.data.max_bytes:
                    break
                try:
                    with open(name, "rb") as f:
                        chunk = f.read(cfg.data.max_bytes - total)
                except OSError as exc:
                    raise DataError(
                        f"data.paths: cannot read {name!r} ({exc}); fix its permissions or remove it"
                    ) from exc
                out.write(chunk)
                total += len(chunk)
        if total == 0:
            raise DataError(
                f"data.paths: the text files are empty ({len(files)} files, 0 bytes); point data.paths at non-empty text"
            )
    return CorpusInfo(path, total, len(files))


class SampleSource:
    """Maps a sample index to (seq + 1) tokens: inputs are [:-1], targets [1:]."""

    num_samples: int

    def sample(self, index: int) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError


class SyntheticSource(SampleSource):
    """Random tokens drawn from (seed, index): an unbounded, reproducible stream."""

    def __init__(self, vocab: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab, seq, seed
        self.num_samples = 1 << 62

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index, 7])
        return rng.integers(0, self.vocab, self.seq + 1, dtype=np.int64)


class TextSource(SampleSource):
    """Non-overlapping windows of seq + 1 bytes of the memory-mapped corpus, in a seeded order per epoch."""

    def __init__(self, corpus: CorpusInfo, seq: int, seed: int):
        self.tokens = np.memmap(corpus.path, dtype=np.uint8, mode="r")
        self.seq, self.seed = seq, seed
        # Windows start every `seq` bytes and take seq + 1 (the last target overlaps the next window).
        self.windows = (len(self.tokens) - 1) // seq
        if self.windows < 1:
            raise DataError(
                f"model.seq_length={seq} is longer than the data ({len(self.tokens)} bytes); "
                f"use a shorter model.seq_length or more text (data.paths, data.max_bytes)"
            )
        self.num_samples = 1 << 62
        self._epoch, self._perm = -1, None

    def sample(self, index: int) -> np.ndarray:
        epoch, pos = divmod(index, self.windows)
        if epoch != self._epoch:
            # A fresh permutation per epoch, from (seed, epoch) only.
            self._perm = np.random.default_rng([self.seed, epoch, 11]).permutation(self.windows)
            self._epoch = epoch
        start = int(self._perm[pos]) * self.seq
        return np.asarray(self.tokens[start : start + self.seq + 1], dtype=np.int64)


def validate_data_config(cfg: Config) -> None:
    """Errors a user can cause, raised before any work: names the key to change."""
    if cfg.data.kind not in ("synthetic", "text", "indexed"):
        raise DataError(f"data.kind={cfg.data.kind!r} is unknown; use data=synthetic, data=text or data=indexed")
    if cfg.data.kind == "text" and cfg.model.vocab_size < BYTE_VOCAB:
        raise DataError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB} tokens; "
            f"set model.vocab_size>={BYTE_VOCAB} or use data=synthetic"
        )
    if cfg.data.kind == "text" and cfg.data.max_bytes <= cfg.model.seq_length:
        raise DataError(
            f"data.max_bytes={cfg.data.max_bytes} is not more than model.seq_length={cfg.model.seq_length}; "
            f"raise data.max_bytes"
        )
    if cfg.data.kind == "indexed" and not cfg.data.prefixes:
        raise DataError(
            "data=indexed needs data.prefixes=[DIR/NAME,...]: datasets written by "
            "`meshrun action=prepare` (or Megatron-LM's preprocess_data.py)"
        )
    if cfg.data.kind == "indexed" and cfg.data.weights and len(cfg.data.weights) != len(cfg.data.prefixes):
        raise DataError(
            f"data.weights has {len(cfg.data.weights)} entries for {len(cfg.data.prefixes)} "
            f"data.prefixes; give one weight per prefix, or none (weights by token count)"
        )
    if cfg.train.eval_every > 0 and cfg.data.kind == "text":
        raise DataError(
            "train.eval_every needs held-out data, which data=text has not; use data=indexed "
            "(`meshrun action=prepare` holds out a validation split) or train.eval_every=0"
        )


class BatchSampler:
    """Cuts the global batch of a step into this data-parallel rank's micro-batches."""

    def __init__(self, source: SampleSource, global_batch: int, micro_batch: int, dp: int, dp_rank: int):
        if global_batch % (micro_batch * dp) != 0:
            raise DataError(
                f"parallel.global_batch={global_batch} is not a multiple of micro_batch x dp = {micro_batch} x {dp}; "
                f"change parallel.global_batch"
            )
        self.source, self.global_batch, self.micro_batch = source, global_batch, micro_batch
        self.dp, self.dp_rank = dp, dp_rank
        self.per_rank = global_batch // dp
        self.num_micro = self.per_rank // micro_batch

    def sample_indices(self, consumed_samples: int) -> list[list[int]]:
        """Stream positions of this rank's micro-batches for the step starting at `consumed_samples`."""
        first = consumed_samples + self.dp_rank * self.per_rank
        return [
            list(range(first + k * self.micro_batch, first + (k + 1) * self.micro_batch)) for k in range(self.num_micro)
        ]

    def micro_batches(self, consumed_samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, targets) pairs, each (micro_batch, seq) int64, for the step at `consumed_samples`."""
        import torch

        out = []
        for idx in self.sample_indices(consumed_samples):
            rows = np.stack([self.source.sample(i) for i in idx])
            t = torch.from_numpy(rows)
            out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return out
