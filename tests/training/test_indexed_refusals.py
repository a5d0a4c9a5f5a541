"""Indexed datasets meshrun must refuse, each with the file and the fix named (training/data/indexed.py), built
byte by byte with the tests' own writer of the format (tests/helpers/megatron_format.py): a bad magic, another
version, a float token dtype, a missing NAME.bin, a foreign NAME.json; and a read-only dataset folder, which
is used (scanned in memory) with nothing written into it."""

from __future__ import annotations

import gc
import json
import os
import stat
import struct

import helpers.megatron_format as mf
import numpy as np
import pytest

from training.data import DataError
from training.data.indexed import open_dataset

DOCS = [list(range(d * 10, d * 10 + 7)) for d in range(5)]


def _dataset(tmp_path, dtype=np.uint16) -> str:
    prefix = str(tmp_path / "ds")
    mf.write(prefix, DOCS, dtype)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_magic_is_refused_with_the_fix(tmp_path):
    prefix = _dataset(tmp_path)
    _patch(prefix + ".idx", 0, b"NOTMMIDX")
    with pytest.raises(DataError, match=r"ds\.idx: not a Megatron MMIDIDX index.*action=prepare"):
        open_dataset(prefix)


def test_another_index_version_is_refused_naming_both(tmp_path):
    prefix = _dataset(tmp_path)
    _patch(prefix + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"ds\.idx: index version 2, meshrun reads version 1"):
        open_dataset(prefix)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_tokens_are_refused(tmp_path, dtype):
    prefix = _dataset(tmp_path, dtype)
    with pytest.raises(DataError, match=r"ds\.idx: token dtype code \d is not an integer dtype"):
        open_dataset(prefix)


def test_missing_bin_is_refused_naming_the_pair(tmp_path):
    prefix = _dataset(tmp_path)
    os.unlink(prefix + ".bin")
    with pytest.raises(DataError, match=r"ds\.bin: missing .*NAME\.bin and NAME\.idx belong together"):
        open_dataset(prefix)


def test_a_foreign_description_is_refused_and_left_alone(tmp_path):
    prefix = _dataset(tmp_path)
    foreign = {"format": "somebody-else", "name": "not ours"}
    with open(prefix + ".json", "w") as f:
        json.dump(foreign, f)
    with pytest.raises(DataError, match=r"ds\.json: not a meshrun dataset description.*move it away"):
        open_dataset(prefix)
    assert json.load(open(prefix + ".json")) == foreign  # never overwritten


def test_read_only_folder_is_read_without_writing(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    prefix = _dataset(folder)
    if os.geteuid() != 0:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    else:
        # Root writes into a folder whatever its mode (the CI here runs as root, where this test was skipped,
        # tests audit §5): a read-only bind mount of the folder is read-only for root too.
        if os.system(f"mount --bind '{folder}' '{folder}' 2>/dev/null") != 0:
            pytest.skip("a read-only bind mount (root's read-only folder) needs the right to mount")
        if os.system(f"mount -o remount,bind,ro '{folder}' 2>/dev/null") != 0:
            os.system(f"umount '{folder}'")
            pytest.skip("a read-only bind mount (root's read-only folder) needs the right to mount")
        with pytest.raises(OSError):
            open(folder / "probe", "w").close()  # the premise: nothing can be written there
    ds = None
    try:
        ds, desc = open_dataset(prefix)
        assert sorted(os.listdir(folder)) == ["ds.bin", "ds.idx"]  # no description cached
        assert desc["min_vocab_size"] == max(max(d) for d in DOCS) + 1
    finally:
        if os.geteuid() != 0:
            folder.chmod(stat.S_IRWXU)
        else:
            # the dataset maps its files: unmapped first, or the mount is busy and stays behind pytest's tmp dirs
            del ds
            gc.collect()
            if os.system(f"umount '{folder}' 2>/dev/null") != 0:
                os.system(f"umount -l '{folder}'")
    assert not os.path.ismount(folder) or os.geteuid() != 0
