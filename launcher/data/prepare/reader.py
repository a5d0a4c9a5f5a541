"""The parent's side of prepare: find the input files and cut them into work items of about one chunk.

Reading streams: one chunk per item and a bounded number of items in flight (launcher/data/prepare/__init__.py),
so memory does not grow with the input. Small text files are grouped (one document each); a text file
larger than a chunk is one document sent in pieces, each cut just after a newline that a non-space follows
(where GPT-2 and Llama-3 style pre-tokenizers split anyway, and never inside a UTF-8 character); JSON
Lines are sent as blocks of whole lines. Each file's SHA-256 is computed on the way (the description's
sources).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from launcher.data.prepare import columnar
from launcher.data.prepare.columnar import COLUMNAR_SUFFIXES, is_columnar
from launcher.data.prepare.worker import HEAD_BYTES, held_out
from training.data.sources import TEXT_SUFFIXES, DataError, default_corpus_root

JSONL_SUFFIXES = (".jsonl",)
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", ".git")


@dataclass
class Source:
    """One input file as the description records it."""

    path: str
    bytes: int
    sha256: str = ""
    documents: int = 0


@dataclass
class Inputs:
    """The files to read, in order, and what was skipped."""

    files: list[str] = field(default_factory=list)
    skipped_empty: int = 0
    skipped_suffix: list[str] = field(default_factory=list)
    """Files inside the given directories whose suffix is not read (prepare.suffixes); listed, never silent."""

    @property
    def total_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)


def is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES)


def read_suffixes(suffixes: list[str] | None = None) -> tuple[str, ...]:
    """The suffixes read from directories: prepare.suffixes (a leading dot added where missing), else the
    defaults (TEXT_SUFFIXES, .jsonl, and .parquet / .arrow: launcher/data/prepare/columnar.py)."""
    if suffixes:
        return tuple(x if x.startswith(".") else "." + x for x in (str(v).strip() for v in suffixes) if x)
    return TEXT_SUFFIXES + JSONL_SUFFIXES + COLUMNAR_SUFFIXES


def list_inputs(paths: list[str], suffixes: list[str] | None = None) -> Inputs:
    """Files named by `paths` (directories searched recursively, sorted); empty files named directly are
    errors, empty files inside directories are skipped (the standard library has empty __init__.py files), as
    are files whose suffix is not read (recorded in skipped_suffix)."""
    roots = list(paths) or [default_corpus_root()]
    known = read_suffixes(suffixes)
    out = Inputs()
    for root in roots:
        if not os.path.exists(root):
            raise DataError(
                f"prepare.inputs: {root!r} does not exist; give existing text or JSON Lines files or "
                f"directories (prepare.inputs=[dir1,file2.jsonl]), or none for the Python standard "
                f"library's sources"
            )
        if columnar.is_saved_dataset(root):  # a Hugging Face save_to_disk directory: its Arrow files in order
            out.files += columnar.saved_dataset_files(root)
        elif os.path.isdir(root):
            found = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
                for f in sorted(filenames):
                    (found if f.endswith(known) else out.skipped_suffix).append(os.path.join(dirpath, f))
            usable = [f for f in found if os.path.getsize(f) > 0]
            out.skipped_empty += len(found) - len(usable)
            if not usable:
                raise DataError(
                    f"prepare.inputs: directory {root!r} holds no non-empty text or JSON Lines files "
                    f"(suffixes read: {', '.join(known)}); point prepare.inputs at files, or list the suffixes to read "
                    f"(prepare.suffixes=[.txt,.c])"
                )
            out.files += usable
        else:
            if os.path.getsize(root) == 0:
                raise DataError(f"prepare.inputs: {root!r} is empty; remove it from prepare.inputs or give it text")
            out.files.append(root)
    return out


def _safe_cut(data: bytes) -> int:
    """The last position in `data` just after a newline followed by a non-space byte (0: none)."""
    pos = len(data) - 1
    while True:
        pos = data.rfind(b"\n", 0, pos)
        if pos < 0 or pos + 1 >= len(data):
            return 0
        if data[pos + 1 : pos + 2] not in (b" ", b"\t", b"\r", b"\n", b"\x0b", b"\x0c"):
            return pos + 1


class Reader:
    """Work items in input order; records each file's size, SHA-256 and documents in `sources`."""

    def __init__(self, inputs: Inputs, chunk: int, text_key: str, valid_fraction: float, max_bytes: int = 0):
        self.inputs, self.chunk = inputs, chunk
        self.budget = float(max_bytes) if max_bytes > 0 else float("inf")
        self.base = {"valid_fraction": valid_fraction, "text_key": text_key}
        self.sources: list[Source] = []
        self.seq = 0
        self._batch: list = []
        self._batch_bytes = 0

    def _item(self, **fields) -> dict:
        item = dict(self.base, seq=self.seq, **fields)
        self.seq += 1
        return item

    def _flush(self) -> Iterator[dict]:
        if self._batch:
            yield self._item(kind="files", files=self._batch, nbytes=self._batch_bytes)
            self._batch, self._batch_bytes = [], 0

    def items(self) -> Iterator[dict]:
        for path in self.inputs.files:
            if self.budget <= 0:
                break
            src = Source(path, os.path.getsize(path))
            self.sources.append(src)
            h = hashlib.sha256()
            if is_jsonl(path):
                yield from self._flush()
                yield from self._jsonl(path, src, h)
            elif is_columnar(path):
                yield from self._flush()
                yield from self._columnar(path, src, h)
            elif src.bytes <= self.chunk:
                with open(path, "rb") as f:
                    data = f.read()
                h.update(data)
                self._batch.append((path, data))
                self._batch_bytes += len(data)
                src.documents = 1
                self.budget -= len(data)
                if self._batch_bytes >= self.chunk:
                    yield from self._flush()
            else:
                yield from self._flush()
                yield from self._pieces(path, src, h)
            src.sha256 = h.hexdigest()
        yield from self._flush()

    def _pieces(self, path: str, src: Source, h) -> Iterator[dict]:
        """A large text file: one document, in pieces cut at safe line starts."""
        first, carry, offset, valid = True, b"", 0, False
        with open(path, "rb") as f:
            while True:
                block = f.read(self.chunk)
                data = carry + block
                cut = (_safe_cut(data) or len(data)) if block else len(data)
                piece, carry = data[:cut], data[cut:]
                if first:
                    valid = held_out(piece[:HEAD_BYTES], self.base["valid_fraction"])
                last = not block and not carry
                if piece or last:
                    h.update(piece)
                    yield self._item(
                        kind="piece",
                        path=path,
                        data=piece,
                        offset=offset,
                        first=first,
                        last=last,
                        valid=valid,
                        nbytes=len(piece),
                    )
                    offset += len(piece)
                    first = False
                if last:
                    break
        src.documents = 1
        self.budget -= src.bytes

    def _jsonl(self, path: str, src: Source, h) -> Iterator[dict]:
        """Blocks of whole JSON Lines; with a byte budget, stops after the line that reaches it."""
        line, offset, carry = 1, 0, b""
        with open(path, "rb") as f:
            while True:
                block = f.read(self.chunk)
                data = carry + block
                stop = not block
                if block:
                    cut = data.rfind(b"\n") + 1
                    if cut == 0:  # a line longer than a chunk: read on
                        carry = data
                        continue
                else:
                    cut = len(data)
                if cut > self.budget:
                    nl = data.find(b"\n", max(0, int(self.budget) - 1))
                    cut, stop = (nl + 1 if nl >= 0 else len(data)), True
                piece, carry = data[:cut], data[cut:]
                if piece:
                    h.update(piece)
                    src.documents += sum(1 for ln in piece.split(b"\n") if ln.strip())
                    yield self._item(kind="jsonl", path=path, data=piece, offset=offset, line=line, nbytes=len(piece))
                    line += piece.count(b"\n")
                    offset += len(piece)
                    self.budget -= len(piece)
                if stop:
                    break
        src.bytes = offset

    def _columnar(self, path: str, src: Source, h) -> Iterator[dict]:
        """Parquet / Arrow rows, one document each (launcher/data/prepare/columnar.py), in items of about one chunk
        of text; with a byte budget, stops after the document that reaches it. Progress counts the file's own
        bytes (compressed Parquet holds more text than its size) in proportion to the text sent."""
        with open(path, "rb") as f:  # the description's sha256 is of the file as stored
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        batch: list[str] = []
        size = 0
        rows_total, rows_sent, shown = max(1, columnar.row_count(path)), 0, 0

        def item() -> dict:
            nonlocal batch, size, rows_sent, shown
            rows_sent += len(batch)
            progress = src.bytes * rows_sent // rows_total  # the file's bytes, in proportion to its rows
            out = self._item(kind="docs", path=path, texts=batch, nbytes=progress - shown, text_bytes=size)
            shown = progress
            src.documents += len(batch)
            batch, size = [], 0
            return out

        for values in columnar.texts(path, self.base["text_key"]):
            for text in values:
                if self.budget <= 0:
                    break
                n = len(text.encode("utf-8"))
                batch.append(text)
                size += n
                self.budget -= n
                if size >= self.chunk:
                    yield item()
            if self.budget <= 0:
                break
        if batch:
            yield item()
