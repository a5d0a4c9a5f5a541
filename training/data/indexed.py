"""Megatron-LM's indexed dataset (MMIDIDX, version 1): NAME.bin holds the tokens, NAME.idx the index.

NAME.idx, little-endian, in this order (Megatron-LM's megatron/core/datasets/indexed_dataset.py writes it so):
    9 bytes  b"MMIDIDX\\x00\\x00"
    <Q       version, 1
    <B       dtype code of the tokens: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q       sequence count S
    <Q       document count D (the length of the document index below: documents + 1)
    int32[S] tokens per sequence
    int64[S] byte offset of each sequence in NAME.bin
    int64[D] sequence index where each document starts, then S (so document j is sequences [d[j], d[j+1]))
NAME.bin is the sequences' tokens back to back, in that dtype. meshrun writes one sequence per document,
each ending with the end-of-document token, in uint16 when the vocabulary is below 65500 (Megatron's rule),
else int32.

Beside them meshrun keeps NAME.json, the dataset's *description*: what it holds (documents, tokens, dtype,
tokenizer, sources) and each file's size and fingerprint (blake2b of its size, first and last MiB), which
every start checks in constant time, so a changed, truncated or swapped file is an error instead of a silent
mix. A dataset written by other tools gets its description from one scan (contiguity of the sequences, the
largest token id), cached the same way, so no later start scans it again.

numpy only (the launcher's `action=prepare` writes through this module and must not import torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from training.contract.rundir.files import rename_into_place, write_atomic
from training.data.sources import DataError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF = {np.dtype(v).name: k for k, v in DTYPE_CODES.items()}
TOKEN_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16")  # float codes hold no token ids
FINGERPRINT_SPAN = 1 << 20
DESCRIPTION_FORMAT = "meshrun-indexed-1"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with room to spare (Megatron-LM's cut-off, 65500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def description_path(prefix: str) -> str:
    return prefix + ".json"


def fingerprint(path: str) -> str:
    """blake2b of the size, the first and the last MiB: constant time, catches truncation and rewrites."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_SPAN))
        if size > FINGERPRINT_SPAN:
            f.seek(max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN))
            h.update(f.read(FINGERPRINT_SPAN))
    return h.hexdigest()


def file_facts(prefix: str) -> dict:
    """Sizes and fingerprints of NAME.bin and NAME.idx, as the description records them."""
    return {
        ext: {"bytes": os.path.getsize(p), "fingerprint": fingerprint(p)}
        for ext, p in (("bin", bin_path(prefix)), ("idx", idx_path(prefix)))
    }


# ---- reading ---------------------------------------------------------------------------------------
@dataclass
class IndexHeader:
    """The fixed fields at the start of NAME.idx."""

    dtype: np.dtype
    sequences: int
    doc_index_len: int
    """Megatron's "document count": the document index's length, documents + 1."""


def read_header(prefix: str) -> IndexHeader:
    """NAME.idx's header, checked: magic, version, dtype code and the file's exact length."""
    path = idx_path(prefix)
    fix = "prepare it again with `meshrun action=prepare` (or Megatron-LM's preprocess_data.py)"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as exc:
        raise DataError(
            f"{path}: cannot read the index ({exc.strerror}); check data.prefixes "
            f"(each prefix names NAME for NAME.bin and NAME.idx)"
        ) from exc
    if len(head) < HEADER_BYTES or head[: len(HEADER)] != HEADER:
        raise DataError(f"{path}: not a Megatron MMIDIDX index (bad header); {fix}")
    version, code, sequences, doc_len = struct.unpack("<QBQQ", head[len(HEADER) :])
    if version != VERSION:
        raise DataError(f"{path}: index version {version}, meshrun reads version {VERSION}; {fix}")
    if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).name not in TOKEN_DTYPES:
        raise DataError(f"{path}: token dtype code {code} is not an integer dtype; {fix}")
    want = HEADER_BYTES + sequences * (4 + 8) + doc_len * 8
    if size != want:
        raise DataError(
            f"{path}: {size} bytes, but its header ({sequences} sequences, {doc_len - 1} documents) "
            f"needs {want}: the index is truncated or damaged; {fix}"
        )
    return IndexHeader(np.dtype(DTYPE_CODES[code]), int(sequences), int(doc_len))


class IndexedDataset:
    """NAME.bin + NAME.idx, memory-mapped: opening reads the header only, whatever the dataset's size."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.header = head = read_header(prefix)
        self.dtype = head.dtype
        path = idx_path(prefix)
        self.sizes = np.memmap(path, np.int32, "r", HEADER_BYTES, (head.sequences,))
        self.pointers = np.memmap(path, np.int64, "r", HEADER_BYTES + 4 * head.sequences, (head.sequences,))
        self.doc_idx = np.memmap(path, np.int64, "r", HEADER_BYTES + 12 * head.sequences, (head.doc_index_len,))
        bpath = bin_path(prefix)
        try:
            nbytes = os.path.getsize(bpath)
        except OSError as exc:
            raise DataError(
                f"{bpath}: missing ({exc.strerror}); NAME.bin and NAME.idx belong together: prepare the dataset again"
            ) from exc
        item = self.dtype.itemsize
        end = int(self.pointers[-1]) + int(self.sizes[-1]) * item if head.sequences else 0
        if nbytes != end:
            raise DataError(
                f"{bpath}: {nbytes} bytes, but {path} places its last token at byte {end} "
                f"({self.dtype.name}): the token file is truncated or was written with another dtype; "
                f"prepare the dataset again"
            )
        self.num_tokens = nbytes // item
        self.tokens = np.memmap(bpath, self.dtype, "r") if nbytes else np.zeros(0, self.dtype)

    @property
    def num_sequences(self) -> int:
        return self.header.sequences

    @property
    def num_documents(self) -> int:
        return max(0, self.header.doc_index_len - 1)

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]

    def document(self, j: int) -> np.ndarray:
        """The tokens of document j (its sequences, concatenated)."""
        a, b = int(self.doc_idx[j]), int(self.doc_idx[j + 1])
        return np.concatenate([self.sequence(i) for i in range(a, b)]) if b > a else np.zeros(0, self.dtype)


# ---- writing ---------------------------------------------------------------------------------------
class IndexedWriter:
    """Streams documents into NAME.bin / NAME.idx under temporary names; `commit()` renames them.

    Memory stays constant: tokens go straight to the file and the sequence lengths to a temporary side
    file, from which `close()` streams the index (lengths, offsets, document index) in chunks."""

    CHUNK = 1 << 20

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        # A temporary prefix, so the finished pair can be opened and described before it is renamed.
        self.tmp_prefix = f"{prefix}.tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = bin_path(self.tmp_prefix), idx_path(self.tmp_prefix)
        self.tmp_sizes = self.tmp_prefix + ".sizes"
        self._bin = open(self.tmp_bin, "wb")
        self._sizes = open(self.tmp_sizes, "wb")
        self.documents = 0
        self.tokens = 0
        self.max_token = -1
        self._closed = False

    def add_tokens(self, flat: np.ndarray) -> None:
        """Tokens appended to the token file (documents are delimited by `add_lengths`)."""
        arr = np.asarray(flat)
        if arr.size:
            self.max_token = max(self.max_token, int(arr.max()))
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self.tokens += int(arr.size)

    def add_lengths(self, lengths) -> None:
        """Ends documents of these lengths (in tokens, counted from the previous end)."""
        arr = np.asarray(lengths, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise DataError(
                f"{self.prefix}: a document of {int(arr.max())} tokens does not fit the index's int32 "
                f"lengths; split it into smaller documents"
            )
        self._sizes.write(arr.astype(np.int32).tobytes())
        self.documents += int(arr.size)

    def add_document(self, tokens: np.ndarray) -> None:
        """One document as one sequence (the caller appended the end-of-document token)."""
        arr = np.asarray(tokens)
        self.add_tokens(arr)
        self.add_lengths([arr.size])

    def add_documents(self, flat: np.ndarray, lengths) -> None:
        """Many documents at once: their tokens back to back and each one's length."""
        self.add_tokens(flat)
        self.add_lengths(lengths)

    def close(self) -> None:
        """Finish NAME.bin and write NAME.idx (still under their temporary names)."""
        if self._closed:
            return
        self._bin.close()
        self._sizes.close()
        n, item = self.documents, self.dtype.itemsize
        with open(self.tmp_idx, "wb") as out:
            out.write(HEADER)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", CODE_OF[self.dtype.name]))
            out.write(struct.pack("<Q", n))
            out.write(struct.pack("<Q", n + 1))
            sizes = np.memmap(self.tmp_sizes, np.int32, "r") if n else np.zeros(0, np.int32)
            for a in range(0, n, self.CHUNK):
                out.write(np.asarray(sizes[a : a + self.CHUNK]).tobytes())
            offset = 0
            for a in range(0, n, self.CHUNK):
                part = np.asarray(sizes[a : a + self.CHUNK], dtype=np.int64) * item
                pointers = np.cumsum(part) - part + offset
                out.write(pointers.astype(np.int64).tobytes())
                offset += int(part.sum())
            for a in range(0, n + 1, self.CHUNK):
                out.write(np.arange(a, min(a + self.CHUNK, n + 1), dtype=np.int64).tobytes())
            del sizes
        os.unlink(self.tmp_sizes)
        self._closed = True

    def commit(self) -> None:
        """Rename the finished files to NAME.bin and NAME.idx."""
        self.close()
        rename_into_place(self.tmp_bin, bin_path(self.prefix))
        rename_into_place(self.tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Remove every temporary file (after an error)."""
        for f in (self._bin, self._sizes):
            try:
                f.close()
            except OSError:
                pass
        for p in (self.tmp_bin, self.tmp_idx, self.tmp_sizes):
            if os.path.exists(p):
                os.unlink(p)


# ---- descriptions ------------------------------------------------------------------------------------
def write_json_atomic(path: str, data: dict) -> None:
    # A dataset's directory may be a link (data/ on a scratch file system): outside run.dir, followed.
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", check_links=False)


def read_description(prefix: str) -> dict | None:
    """NAME.json, or None when there is none."""
    path = description_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            desc = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{path}: unreadable description ({exc}); delete it (meshrun rescans the dataset) "
            f"or prepare the dataset again"
        ) from exc
    if not isinstance(desc, dict) or desc.get("format") != DESCRIPTION_FORMAT:
        raise DataError(
            f"{path}: not a meshrun dataset description (format {desc.get('format')!r}); "
            f"move it away or prepare the dataset again"
        )
    return desc


def scan(ds: IndexedDataset) -> dict:
    """What one pass over a dataset meshrun did not write tells: contiguity and the largest token id."""
    item = ds.dtype.itemsize
    contiguous, top, offset = True, -1, 0
    step = 1 << 22
    for a in range(0, ds.num_sequences, step):
        sizes = np.asarray(ds.sizes[a : a + step], dtype=np.int64) * item
        want = np.cumsum(sizes) - sizes + offset
        if not np.array_equal(want, np.asarray(ds.pointers[a : a + step])):
            contiguous = False
            break
        offset += int(sizes.sum())
    for a in range(0, ds.num_tokens, 1 << 26):
        part = ds.tokens[a : a + (1 << 26)]
        if part.size:
            top = max(top, int(part.max()))
    return {"contiguous": contiguous, "max_token": top}


def describe(prefix: str, ds: IndexedDataset, extra: dict | None = None) -> dict:
    """The description of a dataset: counts, dtype, file facts, plus `extra` (tokenizer, sources, split)."""
    desc = {
        "format": DESCRIPTION_FORMAT,
        "megatron_format": "MMIDIDX version 1",
        "dtype": ds.dtype.name,
        "documents": ds.num_documents,
        "sequences": ds.num_sequences,
        "tokens": ds.num_tokens,
        "files": file_facts(prefix),
    }
    desc.update(extra or {})
    return desc


def check_against_description(prefix: str, ds: IndexedDataset, desc: dict) -> None:
    """Constant time: the files are still the ones NAME.json describes."""
    path = description_path(prefix)
    fix = (
        "prepare the dataset again with `meshrun action=prepare` (or, for files meshrun did not write, "
        f"delete {os.path.basename(path)} and meshrun rescans them)"
    )
    if desc.get("dtype") != ds.dtype.name:
        raise DataError(
            f"{idx_path(prefix)}: tokens are {ds.dtype.name} but {path} describes {desc.get('dtype')}: "
            f"the index was written with another dtype; {fix}"
        )
    for key, have in (("documents", ds.num_documents), ("sequences", ds.num_sequences), ("tokens", ds.num_tokens)):
        if desc.get(key) != have:
            raise DataError(
                f"{prefix}: holds {have} {key}, {path} describes {desc.get(key)}: the files changed "
                f"after they were described; {fix}"
            )
    facts = file_facts(prefix)
    for ext, fact in facts.items():
        want = (desc.get("files") or {}).get(ext) or {}
        if fact != want:
            raise DataError(
                f"{prefix}.{ext}: {fact['bytes']} bytes (fingerprint {fact['fingerprint'][:12]}) but "
                f"{path} describes {want.get('bytes')} bytes (fingerprint "
                f"{str(want.get('fingerprint'))[:12]}): the file changed after it was described; {fix}"
            )


def open_dataset(prefix: str, may_describe: bool = True) -> tuple[IndexedDataset, dict]:
    """The dataset and its description, checked against each other in constant time.

    A dataset without NAME.json (written by Megatron-LM or the like) is scanned once and its description
    cached beside it when `may_describe` (one process does it: rank 0, or the launcher); otherwise (or when
    the folder is read-only) it is scanned in memory and used."""
    ds = IndexedDataset(prefix)
    desc = read_description(prefix)
    if desc is None:
        found = scan(ds)
        desc = describe(
            prefix,
            ds,
            {
                "scanned": True,
                "contiguous": found["contiguous"],
                "min_vocab_size": found["max_token"] + 1,
                "tokenizer": None,
            },
        )
        if may_describe:
            try:
                write_json_atomic(description_path(prefix), desc)
            except OSError:
                pass  # a read-only dataset folder: the scan is repeated per start, nothing else changes
    else:
        check_against_description(prefix, ds, desc)
    if not desc.get("contiguous", True):
        raise DataError(
            f"{prefix}: its sequences are not stored back to back in {bin_path(prefix)}; meshrun reads "
            f"datasets laid out as Megatron-LM's builder writes them: rewrite it with "
            f"`meshrun action=prepare` or Megatron-LM's preprocess_data.py"
        )
    return ds, desc
