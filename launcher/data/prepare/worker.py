"""What one tokenizing worker process does with one work item (launcher/data/prepare/reader.py makes them).

A work item is a chunk of input bytes the parent read: whole small text files (one document each), a piece
of a large text file (one document split at line starts, so the pieces decode on their own), or a block of
whole JSON Lines (one document per line). The worker decodes (strict UTF-8), picks each document's split
(`held_out`), tokenizes, appends the end-of-document token to each finished document, and returns the tokens
of each split back to back with the document lengths, in the dataset's dtype (small to send back).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from training.data.sources import DataError

HEAD_BYTES = 1 << 16

_TOK = None
_DTYPE: np.dtype | None = None


def held_out(head: bytes, fraction: float) -> bool:
    """Whether a document belongs to the validation split: a hash of its first 64 KiB of UTF-8 text, so the
    choice depends on the document alone (not on the worker count, input order or chunking)."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(head[:HEAD_BYTES], digest_size=8).digest(), "little")
    return h < fraction * 2.0**64


def init(tokenizer_spec: str, eod_token: str, dtype: str) -> None:
    """Pool initializer: one tokenizer per process, encoding on this process's one thread (the pool is the
    parallelism; the Hugging Face library would otherwise start a thread per core in every worker)."""
    global _TOK, _DTYPE
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from training.contract.tokenizer import load_tokenizer

    _TOK = load_tokenizer(tokenizer_spec, eod_token)
    _DTYPE = np.dtype(dtype)


def decode_utf8(data: bytes, path: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: invalid UTF-8 at byte {offset + exc.start}; convert the file to UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8) or remove it from prepare.inputs"
        ) from None


def jsonl_texts(data: bytes, path: str, offset: int, line: int, key: str) -> list[str]:
    """The documents of a block of whole JSON Lines (blank lines skipped), each checked."""
    out = []
    pos = offset
    for n, raw in enumerate(data.split(b"\n")):
        if raw.strip():
            text = decode_utf8(raw, path, pos)
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise DataError(
                    f"{path}:{line + n}: not valid JSON ({exc}); fix the line or remove the file from "
                    f"prepare.inputs (JSON Lines: one object per line)"
                ) from None
            if not isinstance(obj, dict) or key not in obj:
                raise DataError(
                    f"{path}:{line + n}: no field {key!r}; set prepare.text_key to the field that holds "
                    f"the text (fields here: {', '.join(list(obj)[:8]) if isinstance(obj, dict) else '-'})"
                )
            if not isinstance(obj[key], str):
                raise DataError(
                    f"{path}:{line + n}: field {key!r} is {type(obj[key]).__name__}, not text; set "
                    f"prepare.text_key to the field that holds the text"
                )
            out.append(obj[key])
        pos += len(raw) + 1
    return out


def item_documents(item: dict) -> tuple[list[str], list[bool], bool, bool]:
    """(texts, held-out flag of each, first continues an open document, last stays open) of a work item."""
    kind, frac = item["kind"], item["valid_fraction"]
    if kind == "files":
        texts, flags = [], []
        for path, data in item["files"]:
            texts.append(decode_utf8(data, path, 0))
            flags.append(held_out(data, frac))
        return texts, flags, False, False
    if kind == "piece":
        text = decode_utf8(item["data"], item["path"], item["offset"])
        return [text], [item["valid"]], not item["first"], not item["last"]
    if kind == "docs":  # Parquet / Arrow rows: the texts themselves (launcher/data/prepare/columnar.py)
        texts = item["texts"]
        return texts, [held_out(t.encode("utf-8"), frac) for t in texts], False, False
    texts = jsonl_texts(item["data"], item["path"], item["offset"], item["line"], item["text_key"])
    return texts, [held_out(t.encode("utf-8"), frac) for t in texts], False, False


def _pack(ids: list[np.ndarray], finished: list[bool], eod: int, dtype: np.dtype):
    """Tokens back to back (end-of-document appended to finished documents) and per-document lengths."""
    parts, lengths = [], []
    eod_arr = np.array([eod], dtype=dtype)
    for arr, done in zip(ids, finished):
        parts.append(arr)
        n = arr.size
        if done:
            parts.append(eod_arr)
            n += 1
        lengths.append(n)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return flat, np.asarray(lengths, dtype=np.int64)


def encode(tok, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """Token ids of each text in the dataset's dtype (bytes: the UTF-8 bytes themselves, no Python lists)."""
    if tok.name == "bytes":
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]
    return [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)]


def process(item: dict) -> dict:
    """Tokenize one work item; returns each split's tokens, lengths and open ends, plus counts."""
    tok, dtype = _TOK, _DTYPE
    texts, flags, open_start, open_end = item_documents(item)
    ids = encode(tok, texts, dtype)
    out: dict = {"seq": item["seq"], "bytes": item["nbytes"], "documents": 0}
    for split, want in (("train", False), ("valid", True)):
        pick = [i for i, f in enumerate(flags) if f == want]
        finished = [not (open_end and i == len(texts) - 1) for i in pick]
        flat, lengths = _pack([ids[i] for i in pick], finished, tok.eod_id, dtype)
        first_open = bool(open_start and pick and pick[0] == 0)
        out[split] = (flat, lengths, first_open, bool(pick) and not finished[-1])
        out["documents"] += sum(finished)
    return out
