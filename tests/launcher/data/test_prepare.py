"""`meshrun action=prepare`: the command, streaming large files, deterministic split, bad input.

The prepare with worker processes is a real `meshrun` process; the plans and the refused prepare run in this
process through the console entry point (tests/helpers/cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import helpers.megatron_format as mf
import numpy as np
import pytest
from helpers import ROOT
from helpers.cli import run_cli

import launcher.data.prepare as lp
from launcher.data.prepare.config import PrepareConfig
from training.contract.tokenizer import TokenizerError, load_tokenizer
from training.data import DataError

MESHRUN = os.path.join(os.path.dirname(sys.executable), "meshrun")


def _pc(tmp_path, inputs, **kw) -> PrepareConfig:
    kw.setdefault("workers", 1)
    return PrepareConfig(inputs=[str(i) for i in inputs], output=str(tmp_path / "out" / "ds"), progress=False, **kw)


def _leftovers(tmp_path):
    out = tmp_path / "out"
    return sorted(os.listdir(out)) if out.exists() else []


def test_cli_prepares_then_plans_with_the_tokenizers_vocabulary(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (5 + i))
    out = tmp_path / "data" / "code"
    r = subprocess.run(
        [
            MESHRUN,
            "action=prepare",
            f"prepare.inputs=[{src}]",
            f"prepare.output={out}",
            "prepare.tokenizer=bpe",
            "prepare.vocab_size=320",
            "prepare.valid_fraction=0.2",
            "prepare.workers=2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr and "ETA" in r.stderr  # the progress line
    names = sorted(os.listdir(out.parent))
    assert names == [
        "code.bin",
        "code.idx",
        "code.json",
        "code.tokenizer.json",
        "code.valid.bin",
        "code.valid.idx",
        "code.valid.json",
    ]
    run_dir = tmp_path / "run"
    r = run_cli(
        "action=plan", "data=indexed", f"data.prefixes=[{out}]", f"run.dir={run_dir}", "train.eval_every=5", cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    cfg = json.load(open(run_dir / "config.json"))
    assert cfg["model"]["vocab_size"] == 320 and cfg["data"]["prefixes"] == [str(out)]
    # A model vocabulary smaller than the tokenizer's, and weights that do not match: exit 2, nothing launched.
    r = run_cli(
        "action=plan",
        "data=indexed",
        f"data.prefixes=[{out}]",
        "model.vocab_size=256",
        "data.weights=[1,2]",
        f"run.dir={tmp_path / 'run2'}",
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert "model.vocab_size: 256 is smaller" in r.stderr and "model.vocab_size=320" in r.stderr
    assert "data.weights: 2 weights for 1 prefixes" in r.stderr


def test_cli_bad_input_exits_2_naming_the_file(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    r = run_cli("action=prepare", f"prepare.inputs=[{bad}]", f"prepare.output={tmp_path}/o/x", cwd=ROOT)
    assert r.returncode == 2
    assert "latin1.txt: invalid UTF-8 at byte 3" in r.stderr and "convert the file to UTF-8" in r.stderr
    assert os.listdir(tmp_path / "o") == []


def test_a_large_file_is_streamed_in_pieces_as_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr(lp, "CHUNK_BYTES", 4096)  # pieces of ~4 KiB: the file travels in ~25
    text = "".join(f"line {i}: {'é' * (i % 7)} value = {i * 31 % 97}\n    indented {i}\n" for i in range(2500))
    big = tmp_path / "big.txt"
    big.write_text(text, encoding="utf-8")
    small = tmp_path / "small.txt"
    small.write_text("tail document\n")
    for tokenizer in ("bytes", "bpe"):
        lp.prepare(_pc(tmp_path, [big, small], tokenizer=tokenizer, vocab_size=400, workers=2, overwrite=True))
        got = mf.read(str(tmp_path / "out" / "ds"))
        tok = load_tokenizer(str(tmp_path / "out" / "ds"))
        assert len(got["sequences"]) == 2
        assert tok.decode(got["sequences"][0][:-1].tolist()) == text
        assert tok.decode(got["sequences"][1][:-1].tolist()) == "tail document\n"
        if tokenizer == "bytes":
            assert np.array_equal(got["sequences"][0][:-1], np.frombuffer(text.encode(), np.uint8))


def test_split_is_deterministic_by_document(tmp_path):
    docs = [f"document number {i}\n" + "x = 1\n" * (i % 5) for i in range(200)]
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    b.write_text("".join(json.dumps({"text": d}) + "\n" for d in reversed(docs)))
    held = []
    for path, workers in ((a, 1), (b, 2)):
        lp.prepare(_pc(tmp_path, [path], valid_fraction=0.2, workers=workers, overwrite=True))
        valid = mf.read(str(tmp_path / "out" / "ds.valid"))
        held.append(sorted(bytes(s[:-1].astype(np.uint8)).decode() for s in valid["sequences"]))
    assert held[0] == held[1]
    assert 20 <= len(held[0]) <= 60  # about 20 % of 200


def test_max_bytes_stops_at_a_document_boundary(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": "y" * 100}) + "\n" for _ in range(100)))
    desc = lp.prepare(_pc(tmp_path, [f], max_bytes=1000))
    assert 9 <= desc["documents"] <= 10 and desc["tokens"] == desc["documents"] * 101


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", r"nope\.txt.*does not exist"),
        ("empty", r"empty\.txt.*is empty"),
        ("no_field", r"d\.jsonl:2: no field 'text'.*prepare.text_key"),
        ("bad_json", r"d\.jsonl:1: not valid JSON"),
        ("empty_dir", r"holds no non-empty text"),
    ],
)
def test_bad_inputs_are_clear_errors_and_leave_nothing(tmp_path, case, match):
    path = tmp_path / {"missing": "nope.txt", "empty": "empty.txt", "empty_dir": "dir"}.get(case, "d.jsonl")
    if case == "empty":
        path.write_text("")
    elif case == "no_field":
        path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    elif case == "bad_json":
        path.write_text("{not json\n")
    elif case == "empty_dir":
        path.mkdir()
        (path / "e.py").write_text("")
    with pytest.raises(DataError, match=match):
        lp.prepare(_pc(tmp_path, [path]))
    assert [f for f in _leftovers(tmp_path) if not f.startswith(".")] == []


def test_a_tokenizer_file_that_does_not_load_is_a_clear_error(tmp_path):
    (tmp_path / "t.txt").write_text("text\n")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a loadable Hugging Face tokenizer"):
        lp.prepare(_pc(tmp_path, [tmp_path / "t.txt"], tokenizer=str(bad)))
    assert _leftovers(tmp_path) == []


def test_a_given_tokenizer_json_is_used_and_copied(tmp_path):
    from training.contract.tokenizer import train_bpe

    (tmp_path / "t.txt").write_text("alpha beta gamma\n" * 50)
    hf = train_bpe(["alpha beta gamma delta\n" * 20], 300)
    hf.save(str(tmp_path / "given.json"))
    desc = lp.prepare(_pc(tmp_path, [tmp_path / "t.txt"], tokenizer=str(tmp_path / "given.json")))
    assert desc["tokenizer"]["kind"] == "file" and desc["tokenizer"]["vocab_size"] == hf.get_vocab_size()
    tok = load_tokenizer(str(tmp_path / "out" / "ds"))
    assert tok.decode(mf.read(str(tmp_path / "out" / "ds"))["sequences"][0][:-1].tolist()) == "alpha beta gamma\n" * 50


def test_prepare_and_data_modules_import_no_torch():
    code = (
        "import sys; import launcher.data.prepare, launcher.data.prepare.worker, launcher.data.datasets, training.data.blend, "
        "training.contract.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
