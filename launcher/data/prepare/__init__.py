"""`meshrun action=prepare`: text files, directories or JSON Lines -> a Megatron-compatible indexed dataset.

    meshrun action=prepare prepare.inputs=[corpus/] prepare.output=data/corpus prepare.tokenizer=bpe

writes data/corpus.{bin,idx} (training split), data/corpus.valid.{bin,idx} (held-out documents),
data/corpus.tokenizer.json (a trained or given tokenizer) and, last, data/corpus.json and corpus.valid.json
(the descriptions training checks the files against). Every file is written under a temporary name and
renamed only when all of them are complete; on an error the temporaries are removed and the exit code is 2.

Parallelism: a pool of worker processes (launcher/data/prepare/worker.py) tokenizes work items that this
process reads (launcher/data/prepare/reader.py), at most 2 per worker in flight, written back in input order:
memory is bounded by the chunk size and the worker count, never by the input. No torch here.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from launcher.data.prepare.config import PrepareConfig
from launcher.data.prepare.progress import Progress
from launcher.data.prepare.reader import Inputs, Reader, list_inputs
from training.contract.config import Config
from training.contract.exit_codes import EXIT_INVALID, EXIT_OK
from training.contract.rundir.files import rename_into_place
from training.contract.tokenizer import BYTES, Tokenizer, TokenizerError, load_tokenizer, train_bpe
from training.data.indexed import IndexedDataset, IndexedWriter, describe, dtype_for_vocab, write_json_atomic
from training.data.sources import DataError

CHUNK_BYTES = 1 << 20


class _Split:
    """One output split: its writer and the length of a document still open across work items."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.writer = IndexedWriter(prefix, dtype)
        self.pending = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray, first_open: bool, last_open: bool) -> None:
        self.writer.add_tokens(flat)
        lengths = lengths.copy()
        if first_open and lengths.size:
            lengths[0] += self.pending
            self.pending = 0
        if last_open and lengths.size:
            self.pending = int(lengths[-1])
            lengths = lengths[:-1]
        self.writer.add_lengths(lengths)


def _bpe_texts(inputs: Inputs, pc: PrepareConfig) -> collections.abc.Iterator[str]:
    """The documents the BPE trainer reads (the first prepare.bpe_max_bytes of the input), streamed."""
    from launcher.data.prepare.worker import item_documents

    limit = pc.bpe_max_bytes if pc.bpe_max_bytes > 0 else pc.max_bytes
    if pc.max_bytes > 0 and limit > 0:
        limit = min(limit, pc.max_bytes)
    for item in Reader(inputs, CHUNK_BYTES, pc.text_key, 0.0, limit).items():
        yield from item_documents(item)[0]


def _tokenizer(pc: PrepareConfig, inputs: Inputs, tmp_json: str) -> Tokenizer:
    """The tokenizer: bytes, a BPE trained here (saved to `tmp_json`), or a given tokenizer.json."""
    spec = pc.tokenizer
    if spec == BYTES:
        return load_tokenizer(BYTES)
    if spec == "bpe":
        if pc.vocab_size < 257 + 1:
            raise DataError(
                f"prepare.vocab_size={pc.vocab_size}: a byte-level BPE needs more than its 256 byte "
                f"tokens and the end-of-document token; use prepare.vocab_size>=512"
            )
        t0 = time.perf_counter()
        hf = train_bpe(_bpe_texts(inputs, pc), pc.vocab_size)
        hf.save(tmp_json)
        print(
            f"prepare: trained a byte-level BPE of {hf.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        return load_tokenizer(tmp_json)
    if not os.path.exists(spec):
        raise DataError(
            f"prepare.tokenizer={spec!r}: no such file; give bytes, bpe, or the path of a Hugging "
            f"Face tokenizer.json (nothing is downloaded)"
        )
    tok = load_tokenizer(spec, pc.eod_token)
    shutil.copyfile(tok.name, tmp_json)
    return tok


def _check(pc: PrepareConfig) -> None:
    if not pc.output:
        raise DataError("prepare.output is empty; give the dataset prefix, e.g. prepare.output=data/corpus")
    existing = [
        pc.output + s
        for s in (".json", ".bin", ".idx", ".tokenizer.json", ".valid.json")
        if os.path.lexists(pc.output + s)
    ]
    if existing and not pc.overwrite:
        raise DataError(
            f"prepare.output={pc.output} already holds a dataset ({', '.join(existing)}): runs that "
            f"trained on it would generate and export with the new tokenizer. Choose another "
            f"prepare.output, or replace it with prepare.overwrite=true"
        )
    if not 0.0 <= pc.valid_fraction < 1.0:
        raise DataError(f"prepare.valid_fraction={pc.valid_fraction} must be in [0, 1); e.g. 0.01")
    if pc.workers < 0:
        raise DataError(f"prepare.workers={pc.workers} must be >= 0 (0: one per CPU)")
    out_dir = os.path.dirname(os.path.abspath(pc.output))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise DataError(f"prepare.output: cannot create {out_dir} ({exc.strerror}); choose a writable folder") from exc


SKIPPED_SHOWN = 10
"""Skipped files named on stderr; the rest are counted."""


def report_skipped(inputs: Inputs) -> None:
    """Files of the input directories that are not read, by name (the first SKIPPED_SHOWN) and by suffix."""
    skipped = inputs.skipped_suffix
    if not skipped:
        return
    by_suffix: dict[str, int] = {}
    for f in skipped:
        suffix = os.path.splitext(f)[1] or "(none)"
        by_suffix[suffix] = by_suffix.get(suffix, 0) + 1
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_suffix.items(), key=lambda kv: -kv[1]))
    names = ", ".join(skipped[:SKIPPED_SHOWN]) + (
        f", ... ({len(skipped) - SKIPPED_SHOWN} more)" if len(skipped) > SKIPPED_SHOWN else ""
    )
    print(
        f"prepare: skipped {len(skipped)} files whose suffix is not read ({kinds}): {names}; "
        f"prepare.suffixes=[...] lists the suffixes to read",
        file=sys.stderr,
    )


def prepare(pc: PrepareConfig) -> dict:
    """Write the dataset; returns the training split's description. Raises DataError / TokenizerError."""
    _check(pc)
    started = time.perf_counter()
    output = os.path.abspath(pc.output)
    inputs = list_inputs(pc.inputs, pc.suffixes)
    report_skipped(inputs)
    tok_final = output + ".tokenizer.json"
    tok_tmp = tok_final + f".tmp-{os.getpid()}"
    splits: list[_Split] = []
    try:
        tok = _tokenizer(pc, inputs, tok_tmp)
        dtype = dtype_for_vocab(tok.vocab_size)
        splits = [_Split(output, dtype), _Split(output + ".valid", dtype)]
        reader = Reader(inputs, CHUNK_BYTES, pc.text_key, pc.valid_fraction, pc.max_bytes)
        documents = _tokenize(pc, inputs, reader, splits, tok, dtype)
        train, valid = _training_split_first(splits, output, documents)
        if train.writer.tokens == 0:
            raise DataError("prepare: the inputs hold no text; give non-empty files")
        # Complete: describe the finished files under their temporary names, then rename the data files, the
        # tokenizer and last the descriptions (a description's presence says its dataset is complete).
        tok_file = os.path.basename(tok_final) if pc.tokenizer != BYTES else None
        desc, valid_desc = _describe(pc, tok, tok_file, inputs, reader, train, valid, os.path.basename(output))
        _commit(train, valid, desc, valid_desc, tok_tmp if tok_file else None, tok_final, output)
    except BaseException:
        for s in splits:
            s.writer.abort()
        if os.path.exists(tok_tmp):
            os.unlink(tok_tmp)
        raise
    _report(pc, time.perf_counter() - started, desc, valid, tok, tok_final, len(reader.sources), output)
    return desc


def _tokenize(
    pc: PrepareConfig, inputs: Inputs, reader: Reader, splits: list[_Split], tok: Tokenizer, dtype: np.dtype
) -> int:
    """Every document read, tokenized and written into its split (the writers closed after); returns how many."""
    total = inputs.total_bytes if pc.max_bytes <= 0 else min(inputs.total_bytes, pc.max_bytes)
    workers = pc.workers or os.cpu_count() or 1
    bar = Progress(total, pc.progress)
    documents = _run_pool(reader, splits, tok, dtype, workers, bar, pc.eod_token)
    bar.close()
    for s in splits:
        s.writer.close()
    return documents


def _training_split_first(splits: list[_Split], output: str, documents: int) -> tuple[_Split, _Split]:
    """(train, valid). When every document hashed into the held-out split (a tiny input), they are the training
    data instead and none is held out: the two writers swap prefixes."""
    train, valid = splits
    if train.writer.documents == 0:
        print(
            f"prepare: warning: all {documents} documents fell into the validation split; they are the "
            f"training data instead and no validation split is written",
            file=sys.stderr,
        )
        valid.writer.prefix, train.writer.prefix = output, output + ".valid"
        train, valid = valid, train
    return train, valid


def _describe(
    pc: PrepareConfig,
    tok: Tokenizer,
    tok_file: str | None,
    inputs: Inputs,
    reader: Reader,
    train: _Split,
    valid: _Split,
    name: str,
) -> tuple[dict, dict | None]:
    """The descriptions of the training split and of the held-out one (None, its writer aborted, when it holds no
    document), read from the finished files under their temporary names."""
    kind = "bpe" if pc.tokenizer == "bpe" else ("bytes" if pc.tokenizer == BYTES else "file")
    tok_desc = dict(tok.describe(), file=tok_file, kind=kind)
    if tok_file:
        tok_desc["name"] = tok_file
    common = {
        "tokenizer": tok_desc,
        "min_vocab_size": tok.vocab_size,
        "contiguous": True,
        "created_by": "meshrun action=prepare",
        "valid_fraction": pc.valid_fraction,
        "text_key": pc.text_key,
    }
    has_valid = valid.writer.documents > 0
    valid_desc = None
    if has_valid:
        valid_desc = describe(
            valid.writer.tmp_prefix,
            IndexedDataset(valid.writer.tmp_prefix),
            dict(common, split="valid", train_prefix=name),
        )
    else:
        valid.writer.abort()
    sources = [
        {"path": os.path.abspath(s.path), "bytes": s.bytes, "sha256": s.sha256, "documents": s.documents}
        for s in reader.sources
    ]
    desc = describe(
        train.writer.tmp_prefix,
        IndexedDataset(train.writer.tmp_prefix),
        dict(
            common,
            split="train",
            valid_prefix=name + ".valid" if has_valid else None,
            valid_documents=valid.writer.documents,
            valid_tokens=valid.writer.tokens,
            sources=sources,
            skipped_empty_files=inputs.skipped_empty,
            skipped_suffix_files=len(inputs.skipped_suffix),
        ),
    )
    return desc, valid_desc


def _commit(
    train: _Split,
    valid: _Split,
    desc: dict,
    valid_desc: dict | None,
    tok_tmp: str | None,
    tok_final: str,
    output: str,
) -> None:
    """Rename the data files, the tokenizer (tok_tmp: None when none is written) and last the descriptions."""
    train.writer.commit()
    if valid_desc is not None:
        valid.writer.commit()
    if tok_tmp:
        rename_into_place(tok_tmp, tok_final)
    if valid_desc is not None:
        write_json_atomic(valid.prefix + ".json", valid_desc)
    write_json_atomic(output + ".json", desc)


def _report(
    pc: PrepareConfig,
    elapsed: float,
    desc: dict,
    valid: _Split,
    tok: Tokenizer,
    tok_final: str,
    files: int,
    output: str,
) -> None:
    """What was written, and how fast, on stderr; a warning when no document was held out."""
    if pc.valid_fraction > 0 and valid.writer.documents == 0:
        print(
            f"prepare: warning: no document was held out (prepare.valid_fraction={pc.valid_fraction:g} of "
            f"{desc['documents']} documents, chosen by hash): train.eval_every has no held-out split of this "
            f"dataset; raise prepare.valid_fraction, add documents, or give data.valid_prefixes",
            file=sys.stderr,
        )
    total_tokens = desc["tokens"] + valid.writer.tokens
    print(
        f"prepare: {desc['documents']} + {valid.writer.documents} held-out documents, {total_tokens:,} tokens "
        f"({tok.name if tok.name == BYTES else os.path.basename(tok_final)}, vocabulary {tok.vocab_size}, "
        f"{desc['dtype']}) from {files} files in {elapsed:.1f} s "
        f"({total_tokens / max(elapsed, 1e-9):,.0f} tokens/s) -> {output}.bin/.idx/.json",
        file=sys.stderr,
    )


def _run_pool(
    reader: Reader, splits: list[_Split], tok: Tokenizer, dtype: np.dtype, workers: int, bar: Progress, eod_token: str
) -> int:
    """Tokenize the reader's items on `workers` processes, at most 2 per worker in flight, in input order."""
    from launcher.data.prepare import worker

    spec = tok.name
    # A process pool that notices a dead worker (BrokenProcessPool) instead of waiting forever for its result,
    # as multiprocessing.Pool does; fresh interpreters (spawn): no inherited tokenizer thread pools.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=worker.init,
        initargs=(spec, eod_token, dtype.name),
    )
    inflight: collections.deque = collections.deque()
    documents = 0
    try:
        items = reader.items()
        exhausted = False
        while True:
            while not exhausted and len(inflight) < 2 * workers:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                inflight.append(pool.submit(worker.process, item))
            if not inflight:
                break
            try:
                result = inflight.popleft().result()
            except BrokenProcessPool as exc:
                raise DataError(
                    f"a prepare worker process died ({exc}); nothing was written. Run again; if it "
                    f"recurs, lower prepare.workers or check the machine's memory (dmesg)"
                ) from None
            for s, key in zip(splits, ("train", "valid")):
                s.add(*result[key])
            documents += result["documents"]
            bar.update(result["bytes"], sum(s.writer.tokens for s in splits))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return documents


def run_prepare(cfg: Config, run_dir: str | None = None) -> int:
    """The action: prepare, and turn a user's error into exit code 2 with its message."""
    try:
        prepare(cfg.prepare)
    except (DataError, TokenizerError) as exc:
        print(f"meshrun prepare: error: {exc}", file=sys.stderr)
        print("meshrun prepare: nothing was written (temporary files removed).", file=sys.stderr)
        raise SystemExit(EXIT_INVALID) from None
    return EXIT_OK
