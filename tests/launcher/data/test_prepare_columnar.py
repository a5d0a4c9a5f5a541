"""`meshrun action=prepare` on Parquet, Arrow and Hugging Face save_to_disk inputs: the same text gives exactly
the same dataset (tokens, documents, held-out split) as the same text in JSON Lines, through the same reader
chunks, worker pool and split; wrong columns are clear errors."""

from __future__ import annotations

import json
import os

import helpers.megatron_format as mf
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

import launcher.data.prepare as lp
from launcher.data.prepare.config import PrepareConfig
from training.data import DataError

# Multilingual, multi-line, empty-ish and long documents: what must survive every container unchanged.
DOCS = [
    f"doc {i}: {'é' * (i % 5)}ünïcode {i * 7919 % 1000}\n" + "    body line\n" * (i % 9) + ("x" * (i * 37 % 700))
    for i in range(300)
] + ["", " ", "last\n"]


def _pc(tmp_path, inputs, name, **kw) -> PrepareConfig:
    kw.setdefault("workers", 1)
    kw.setdefault("valid_fraction", 0.2)
    return PrepareConfig(
        inputs=[str(i) for i in inputs], output=str(tmp_path / "out" / name), progress=False, text_key="content", **kw
    )


def _table(docs):
    return pa.table({"id": list(range(len(docs))), "content": docs, "score": [0.5] * len(docs)})


def _save_to_disk_layout(path, docs, shards=2):
    """A directory in the layout `datasets`' Dataset.save_to_disk writes: Arrow *stream* files named
    data-0000i-of-0000n.arrow, listed in order by state.json's _data_files, beside dataset_info.json."""
    os.makedirs(path)
    per = -(-len(docs) // shards)
    files = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        table = _table(docs[k * per : (k + 1) * per])
        with pa.OSFile(os.path.join(path, name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=40)
        files.append({"filename": name})
    with open(os.path.join(path, "state.json"), "w") as f:
        json.dump(
            {
                "_data_files": files,
                "_fingerprint": "0",
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            },
            f,
        )
    with open(os.path.join(path, "dataset_info.json"), "w") as f:
        json.dump(
            {
                "features": {
                    "id": {"dtype": "int64", "_type": "Value"},
                    "content": {"dtype": "string", "_type": "Value"},
                }
            },
            f,
        )


def _dataset(tmp_path, name):
    out = {}
    for split in ("", ".valid"):
        got = mf.read(str(tmp_path / "out" / (name + split)))
        out[split] = [s.tolist() for s in got["sequences"]]
    return out


def test_parquet_arrow_and_save_to_disk_give_the_jsonl_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(lp, "CHUNK_BYTES", 8192)  # many work items per file, several per worker in flight
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(_table(DOCS), parquet, row_group_size=50)  # several row groups
    arrow_file = tmp_path / "docs.arrow"  # the IPC file format (random access)
    with pa.OSFile(str(arrow_file), "wb") as sink, pa.ipc.new_file(sink, _table(DOCS).schema) as w:
        w.write_table(_table(DOCS), max_chunksize=64)
    saved = tmp_path / "saved"
    _save_to_disk_layout(str(saved), DOCS)
    # A DatasetDict (dataset_dict.json naming its splits, each a save_to_disk directory): the splits in order.
    dd = tmp_path / "dd"
    _save_to_disk_layout(str(dd / "train"), DOCS[:200], shards=1)
    _save_to_disk_layout(str(dd / "test"), DOCS[200:], shards=3)
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    # A folder mixing them is walked in name order like any other: the columnar files count as inputs.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(_table(DOCS[:150]), mixed / "a.parquet")
    (mixed / "b.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCS[150:]))

    inputs = {
        "jsonl": [jsonl],
        "parquet": [parquet],
        "arrow": [arrow_file],
        "saved": [saved],
        "dict": [dd],
        "mixed": [mixed],
    }
    workers = {"parquet": 2}  # the pool with several items in flight, results written in input order
    try:
        import datasets  # noqa: F401 - only to check the layout above against the real writer when installed

        real = tmp_path / "real"
        datasets.Dataset.from_dict({"content": DOCS, "id": list(range(len(DOCS)))}).save_to_disk(
            str(real), num_shards=2
        )
        inputs["real_save_to_disk"] = [real]
    except ImportError:
        pass
    descs = {}
    for name, paths in inputs.items():
        descs[name] = lp.prepare(_pc(tmp_path, paths, name, tokenizer="bytes", workers=workers.get(name, 1)))
    ref = _dataset(tmp_path, "jsonl")
    assert len(ref[""]) + len(ref[".valid"]) == len(DOCS) and len(ref[".valid"]) > 20
    for name in inputs:
        got = _dataset(tmp_path, name)
        assert got == ref, name
        assert descs[name]["documents"] == descs["jsonl"]["documents"]
        assert descs[name]["tokens"] == descs["jsonl"]["tokens"]
    # The bytes tokenizer's tokens are the UTF-8 bytes: the texts came through unchanged.
    texts = sorted(bytes(s[:-1]).decode() for split in ref.values() for s in split)
    assert texts == sorted(DOCS)
    # Each file is a described source: its size, SHA-256 of the file as stored and its documents.
    src = descs["saved"]["sources"]
    assert [os.path.basename(s["path"]) for s in src] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert sum(s["documents"] for s in src) == len(DOCS)

    # The BPE trainer reads the same documents from either container (the same tokenizer follows).
    def bpe_docs(path):
        pc = _pc(tmp_path, [path], "unused")
        return list(lp._bpe_texts(lp.list_inputs(pc.inputs), pc))

    assert bpe_docs(parquet) == bpe_docs(jsonl) == DOCS
    # max_bytes stops after the document that reaches it, as for JSON Lines.
    small = lp.prepare(_pc(tmp_path, [parquet], "small", max_bytes=2000, valid_fraction=0.0))
    assert 0 < small["documents"] < len(DOCS)
    assert small["tokens"] - small["documents"] >= 2000


@pytest.mark.parametrize(
    "case,match",
    [
        ("no_column", r"no column 'content'.*prepare.text_key.*columns here: id, text"),
        ("not_text", r"column 'content' is int64, not text"),
        ("null", r"row 1 of column 'content' is null"),
        ("damaged", r"not a readable Parquet file"),
        ("bad_state", r"save_to_disk directory .* lacks"),
    ],
)
def test_bad_columnar_inputs_are_clear_errors_and_leave_nothing(tmp_path, case, match):
    path = tmp_path / "in.parquet"
    if case == "no_column":
        pq.write_table(pa.table({"id": [1], "text": ["a"]}), path)
    elif case == "not_text":
        pq.write_table(pa.table({"content": [1, 2]}), path)
    elif case == "null":
        pq.write_table(pa.table({"content": ["a", None]}), path)
    elif case == "damaged":
        path.write_bytes(b"PAR1 this is not parquet")
    else:
        path = tmp_path / "saved"
        path.mkdir()
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    with pytest.raises(DataError, match=match):
        lp.prepare(_pc(tmp_path, [path], "bad", workers=1))
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
