"""Indexed datasets: Megatron interoperability both ways, exact samples, blending, start-up checks.

The format is checked with tests/helpers/megatron_format.py, a reader and writer written from the format's
description, not with meshrun's code.
"""

from __future__ import annotations

import json
import os
import struct

import helpers.megatron_format as mf
import numpy as np
import pytest

from launcher.data.prepare import prepare
from launcher.data.prepare.config import PrepareConfig
from training.contract.config import Config
from training.contract.tokenizer import load_tokenizer
from training.data import BatchSampler, DataError, make_eval_source, make_source
from training.data.blend import BlendedSource, Permutation
from training.data.indexed import open_dataset

DOCS = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld — ünïcode ✓\n" * 3,
    "print('a')\n" * 40,
    "class A:\n    pass\n",
    "x = [i * i for i in range(10)]\n" * 5,
    "# a comment\n",
]


def _corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(DOCS[:4]):
        (src / f"f{i}.py").write_text(d, encoding="utf-8")
    with open(tmp_path / "more.jsonl", "w", encoding="utf-8") as f:
        for d in DOCS[4:]:
            f.write(json.dumps({"id": 1, "text": d}) + "\n")
    return [str(src), str(tmp_path / "more.jsonl")]


def _prepare(tmp_path, tokenizer="bytes", **kw) -> str:
    out = str(tmp_path / "out" / "ds")
    pc = PrepareConfig(
        inputs=_corpus(tmp_path),
        output=out,
        tokenizer=tokenizer,
        workers=2,
        progress=False,
        valid_fraction=kw.pop("valid_fraction", 0.0),
        **kw,
    )
    prepare(pc)
    return out


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_prepared_files_are_megatron_format_and_decode_to_the_documents(tmp_path, tokenizer):
    out = _prepare(tmp_path, tokenizer, vocab_size=300)
    got = mf.read(out)
    assert got["version"] == 1 and got["dtype"] == np.uint16
    assert list(got["doc_idx"]) == list(range(len(DOCS) + 1))  # one sequence per document
    tok = load_tokenizer(out)  # the dataset's own tokenizer, through its description
    assert tok.vocab_size == (257 if tokenizer == "bytes" else 300)
    for seq, doc in zip(got["sequences"], DOCS):
        assert int(seq[-1]) == tok.eod_id and tok.eod_id not in seq[:-1].tolist()
        assert tok.decode(seq[:-1].tolist()) == doc
    desc = json.load(open(out + ".json"))
    assert desc["documents"] == len(DOCS) and desc["tokens"] == sum(len(s) for s in got["sequences"])
    assert [os.path.basename(s["path"]) for s in desc["sources"]] == ["f0.py", "f1.py", "f2.py", "f3.py", "more.jsonl"]
    assert all(len(s["sha256"]) == 64 for s in desc["sources"])
    assert not [f for f in os.listdir(os.path.dirname(out)) if ".tmp" in f]


def test_validation_split_holds_out_whole_documents(tmp_path):
    out = _prepare(tmp_path, valid_fraction=0.5)
    train, valid = mf.read(out), mf.read(out + ".valid")
    tok = load_tokenizer("bytes")
    decoded = sorted(tok.decode(s[:-1].tolist()) for s in train["sequences"] + valid["sequences"])
    assert decoded == sorted(DOCS) and len(valid["sequences"]) >= 1 and len(train["sequences"]) >= 1
    assert json.load(open(out + ".json"))["valid_prefix"] == "ds.valid"


def _write_blocks(tmp_path, name, first, n_docs=50, doc_len=37, dtype=np.uint16):
    """Documents of consecutive ids starting at `first` (each dataset's ids tell it apart)."""
    prefix = str(tmp_path / name)
    docs = [list(range(first + d * doc_len, first + (d + 1) * doc_len)) for d in range(n_docs)]
    mf.write(prefix, docs, dtype)
    return prefix, np.concatenate([np.asarray(d) for d in docs])


def _cfg(prefixes, seq=16, **data) -> Config:
    cfg = Config()
    cfg.data.kind = "indexed"
    cfg.data.prefixes = list(prefixes)
    cfg.model.seq_length = seq
    cfg.model.vocab_size = 70000
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_foreign_megatron_files_give_the_exact_windows(tmp_path, dtype):
    prefix, flat = _write_blocks(tmp_path, "foreign", 3, dtype=dtype)
    cfg = _cfg([prefix])
    source = make_source(cfg, str(tmp_path / "run"))
    sampler = BatchSampler(source, global_batch=8, micro_batch=4, dp=1, dp_rank=0)
    seq, windows = 16, (len(flat) - 1) // 16
    starts = []
    for consumed in range(0, windows - windows % 8, 8):
        for tokens, targets in sampler.micro_batches(consumed):
            for row_t, row_y in zip(tokens.numpy(), targets.numpy()):
                start = int(np.searchsorted(flat, row_t[0]))  # ids are increasing: the position is the id's
                assert start % seq == 0
                assert np.array_equal(row_t, flat[start : start + seq])
                assert np.array_equal(row_y, flat[start + 1 : start + seq + 1])
                starts.append(start)
    assert len(set(starts)) == len(starts)  # within an epoch no window comes twice
    # The one-time scan was cached beside the dataset and describes it; opening again checks, not rescans.
    desc = json.load(open(prefix + ".json"))
    assert desc["scanned"] and desc["min_vocab_size"] == int(flat.max()) + 1
    mtime = os.path.getmtime(prefix + ".json")
    open_dataset(prefix)
    assert os.path.getmtime(prefix + ".json") == mtime


def test_samples_are_layout_independent_and_resume_exactly(tmp_path):
    prefix, _ = _write_blocks(tmp_path, "a", 0)
    source = make_source(_cfg([prefix]), "")
    one = BatchSampler(source, 8, 2, 1, 0)
    four = [BatchSampler(make_source(_cfg([prefix]), ""), 8, 2, 4, r) for r in range(4)]
    for consumed in (0, 8, 64, 800):  # also past the first epoch
        full = np.concatenate([t.numpy() for t, _ in one.micro_batches(consumed)])
        split = np.concatenate([t.numpy() for r in range(4) for t, _ in four[r].micro_batches(consumed)])
        assert np.array_equal(full, split)


def test_blend_matches_weights_within_one_percent(tmp_path):
    prefixes = [_write_blocks(tmp_path, f"d{i}", 10000 * i, n_docs=20 + 10 * i)[0] for i in range(3)]
    weights = [0.5, 0.3, 0.2]
    source = make_source(_cfg(prefixes, weights=weights), "")
    counts = np.zeros(3)
    for i in range(10_000):
        counts[int(source.sample(i)[0]) // 10000] += 1
    share = counts / counts.sum()
    for s, w in zip(share, weights):
        assert abs(s - w) <= 0.01 * w, (share, weights)
    # Without weights: each dataset's share of the tokens (20, 30 and 40 documents of 37 tokens: 2/9, 3/9, 4/9),
    # counted in the samples drawn.
    plain = make_source(_cfg(prefixes), "")
    counts = np.zeros(3)
    for i in range(9_000):
        counts[int(plain.sample(i)[0]) // 10000] += 1
    tokens = np.array([20 * 37, 30 * 37, 40 * 37])
    for s, w in zip(counts / counts.sum(), tokens / tokens.sum()):
        assert abs(s - w) <= 0.01 * w, (counts, tokens)


def test_permutation_is_a_bijection():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        perm = Permutation(n, 12345)
        assert sorted(perm(i) for i in range(n)) == list(range(n))
    assert [Permutation(1000, 1)(i) for i in range(10)] != [Permutation(1000, 2)(i) for i in range(10)]


def test_blended_schedule_is_within_one_sample_of_every_share():
    src = BlendedSource([], [0.7, 0.2, 0.1], block=1000)
    seen = np.zeros(3)
    for i in range(3000):
        d, j = src.locate(i)
        assert j == seen[d]  # each dataset's samples in order, none skipped
        seen[d] += 1
        assert np.all(np.abs(seen - (i + 1) * np.array([0.7, 0.2, 0.1])) <= 1.0 + 1e-9)


def test_eval_source_reads_the_held_out_split(tmp_path):
    out = _prepare(tmp_path, valid_fraction=0.5)
    cfg = _cfg([out], seq=8)
    cfg.train.eval_every = 1
    held_out = mf.read(out + ".valid")["flat"]
    row = np.asarray(make_eval_source(cfg).sample(0), dtype=np.uint16)
    assert _at(held_out, row)
    # ... and is no training sample: not in the training split's tokens, not among the samples training draws.
    train_flat = mf.read(out)["flat"]
    assert len(train_flat) > 4 * len(row) and not _at(train_flat, row)
    train = make_source(cfg, "")
    drawn = [np.asarray(train.sample(i), dtype=np.uint16) for i in range(len(train_flat) // len(row) * 2)]
    assert drawn and all(d.shape == row.shape for d in drawn)
    assert not any(np.array_equal(d, row) for d in drawn)


def _at(flat: np.ndarray, row: np.ndarray) -> bool:
    """Whether row occurs in flat at some token position."""
    windows = np.lib.stride_tricks.sliding_window_view(flat, len(row))
    return bool((windows == row).all(axis=1).any())


# ---- what is wrong with a dataset is named, with the fix ---------------------------------------------------
def test_truncated_token_file_is_a_clear_error(tmp_path):
    prefix, _ = _write_blocks(tmp_path, "t", 0)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 10)
    with pytest.raises(DataError, match=r"t\.bin.*truncated or was written with another dtype"):
        open_dataset(prefix)


def test_index_with_another_dtype_is_a_clear_error(tmp_path):
    prefix, _ = _write_blocks(tmp_path, "t", 0)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(17)
        f.write(struct.pack("<B", 4))  # says int32; the tokens are uint16
    with pytest.raises(DataError, match="another dtype"):
        open_dataset(prefix)


def test_files_that_no_longer_match_their_description_are_a_clear_error(tmp_path):
    out = _prepare(tmp_path)
    with open(out + ".bin", "r+b") as f:
        f.seek(4)
        f.write(b"\x07\x00")  # same size, other content
    with pytest.raises(DataError, match=r"ds\.bin.*changed after it was described.*prepare the dataset again"):
        open_dataset(out)


def test_truncated_index_is_a_clear_error(tmp_path):
    prefix, _ = _write_blocks(tmp_path, "t", 0)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"t\.idx.*truncated"):
        open_dataset(prefix)


def test_weights_and_vocabulary_errors(tmp_path):
    prefix, _ = _write_blocks(tmp_path, "w", 0)
    with pytest.raises(DataError, match="data.weights has 2 entries for 1"):
        make_source(_cfg([prefix], weights=[1.0, 2.0]), "")
    cfg = _cfg([prefix])
    cfg.model.vocab_size = 100
    with pytest.raises(DataError, match="model.vocab_size=100 is smaller.*set model.vocab_size=1850"):
        make_source(cfg, "")
    from launcher.data.datasets import data_errors

    keys = [k for k, _, _ in data_errors(cfg)]
    assert "model.vocab_size" in keys
    cfg.model.vocab_size = 2000
    cfg.data.weights = [1.0, 1.0]
    assert [k for k, _, _ in data_errors(cfg)] == ["data.weights"]


def test_eval_without_a_held_out_split_is_a_clear_error(tmp_path):
    prefix, _ = _write_blocks(tmp_path, "nv", 0)
    cfg = _cfg([prefix])
    cfg.train.eval_every = 5
    with pytest.raises(DataError, match="no validation split.*data.valid_prefixes"):
        make_eval_source(cfg)
