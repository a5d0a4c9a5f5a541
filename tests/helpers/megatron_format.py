"""A reader and a writer of Megatron-LM's MMIDIDX (version 1) indexed dataset, written for the tests from the
format's description, independent of meshrun's own code (training/data/indexed.py):

NAME.idx, little-endian: b"MMIDIDX\\x00\\x00"; <Q version = 1; <B dtype code (1 uint8, 2 int8, 3 int16, 4 int32,
5 int64, 6 float64, 7 float32, 8 uint16); <Q sequence count S; <Q document count D (= documents + 1); int32[S]
sequence lengths; int64[S] byte offsets into NAME.bin; int64[D] document index (first sequence of each document,
then S). NAME.bin: the sequences' tokens back to back.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def write(prefix: str, documents: Sequence[Sequence[int]], dtype=np.uint16) -> None:
    code = {np.dtype(v): k for k, v in CODES.items()}[np.dtype(dtype)]
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * np.dtype(dtype).itemsize
    with open(prefix + ".bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(documents)) + struct.pack("<Q", len(documents) + 1))
        f.write(lengths.tobytes())
        f.write(offsets.astype(np.int64).tobytes())
        f.write(np.arange(len(documents) + 1, dtype=np.int64).tobytes())


def read(prefix: str) -> dict:
    """{"dtype", "sequences": [arrays], "doc_idx": array, "version"} from the files, checked."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, s, d = struct.unpack("<QBQQ", raw[9:34])
    pos = 34
    lengths = np.frombuffer(raw, np.int32, s, pos)
    pos += 4 * s
    offsets = np.frombuffer(raw, np.int64, s, pos)
    pos += 8 * s
    doc_idx = np.frombuffer(raw, np.int64, d, pos)
    assert pos + 8 * d == len(raw), "the index has trailing or missing bytes"
    dtype = np.dtype(CODES[code])
    data = open(prefix + ".bin", "rb").read()
    seqs: list[np.ndarray] = [np.frombuffer(data, dtype, int(n), int(o)) for n, o in zip(lengths, offsets)]
    return {
        "version": version,
        "dtype": dtype,
        "sequences": seqs,
        "doc_idx": doc_idx,
        "flat": np.frombuffer(data, dtype),
    }
