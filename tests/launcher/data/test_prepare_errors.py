"""`meshrun action=prepare`'s edges (launcher/prepare): a vocabulary of 65,500 or more is written as int32 (ids
above 65,535 would wrap in uint16), an output that cannot be created is a clear error, and a prepare killed at its
last step leaves only temporary names, which neither pass for a dataset nor block the next prepare. Files are read
back with tests/helpers/megatron_format.py, written from the format's description, not with meshrun's reader."""

from __future__ import annotations

import os
import subprocess
import sys

import helpers.megatron_format as mf
import numpy as np
import pytest
from helpers import ROOT

import launcher.data.prepare as lp
from launcher.data.prepare.config import PrepareConfig
from training.data import DataError

EOD = "<|endoftext|>"


def _word_tokenizer(path, size: int) -> dict:
    """A word-level tokenizer.json of exactly `size` ids (EOD and [UNK] included); returns word -> id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOD: 0, "[UNK]": 1}
    vocab.update({f"w{i}": i for i in range(2, size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOD])
    tok.save(str(path))
    assert tok.get_vocab_size() == size
    return vocab


@pytest.mark.parametrize("size,dtype", [(65_499, np.uint16), (65_500, np.int32), (70_000, np.int32)])
def test_vocabulary_from_65500_is_written_as_int32(tmp_path, size, dtype):
    vocab = _word_tokenizer(tmp_path / "tok.json", size)
    words = [f"w{size - 1}", "w2", f"w{size // 2}", f"w{size - 7}", "w65535" if size > 65_536 else "w3"]
    (tmp_path / "t.txt").write_text(" ".join(words) + "\n")
    desc = lp.prepare(
        PrepareConfig(
            inputs=[str(tmp_path / "t.txt")],
            output=str(tmp_path / "out" / "ds"),
            tokenizer=str(tmp_path / "tok.json"),
            progress=False,
            workers=1,
        )
    )
    data = mf.read(str(tmp_path / "out" / "ds"))
    assert data["dtype"] == dtype and desc["dtype"] == np.dtype(dtype).name, (data["dtype"], desc)
    (seq,) = data["sequences"]
    assert seq.tolist() == [vocab[w] for w in words] + [vocab[EOD]]  # the largest id survives, no wrap


def test_an_output_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "t.txt").write_text("text\n")
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(DataError, match=r"prepare\.output: cannot create .*afile.*choose a writable folder"):
        lp.prepare(
            PrepareConfig(
                inputs=[str(tmp_path / "t.txt")],
                output=str(tmp_path / "afile" / "sub" / "ds"),
                progress=False,
                workers=1,
            )
        )
    assert sorted(os.listdir(tmp_path)) == ["afile", "t.txt"]


# A prepare SIGKILLed in its last step: after the data files are complete, when the first one is renamed into place.
_KILLED = """
import os, signal, sys
import launcher.data.prepare as lp
from launcher.data.prepare.config import PrepareConfig
from training.data.indexed import IndexedWriter
IndexedWriter.commit = lambda self: os.kill(os.getpid(), signal.SIGKILL)
lp.prepare(PrepareConfig(inputs=[sys.argv[1]], output=sys.argv[2], progress=False, workers=1, valid_fraction=0.0))
"""


def test_leftovers_of_a_killed_prepare_are_no_dataset_and_block_nothing(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("hello world\n" * 20)
    out = tmp_path / "out" / "ds"
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, str(src), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert p.returncode == -9, p.stderr[-2000:]
    left = sorted(os.listdir(out.parent))
    assert left and all(".tmp-" in n for n in left), left  # nothing under a final name
    with pytest.raises(FileNotFoundError):  # no index under the final name
        mf.read(str(out))
    desc = lp.prepare(
        PrepareConfig(inputs=[str(src)], output=str(out), progress=False, workers=1, valid_fraction=0.0)
    )  # not refused as "already holds a dataset"
    (seq,) = mf.read(str(out))["sequences"]
    assert bytes(seq[:-1].astype(np.uint8)).decode() == "hello world\n" * 20 and desc["documents"] == 1
