"""The one place that turns a tokenizer name, file or dataset into something that encodes and decodes.

    tok = load_tokenizer("bytes")                 # 256 byte values + end-of-document 256
    tok = load_tokenizer("path/to/tokenizer.json") # any Hugging Face tokenizer file (GPT-2's, Llama-3's, ...)
    tok = load_tokenizer("data/stdlib")            # a dataset prefix: the tokenizer `meshrun action=prepare` used
    tok.encode("text") -> List[int];  tok.decode(ids) -> str;  tok.vocab_size;  tok.eod_id

Offline only: nothing is downloaded; a name that is neither `bytes`, a file, a directory holding
tokenizer.json, nor a dataset prefix is a TokenizerError (a user error: exit 2). No torch here (the launcher
imports this module).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

BYTES = "bytes"
BYTE_VOCAB = 257
"""The byte tokenizer's vocabulary: the 256 byte values, then the end-of-document token."""
BYTE_EOD = 256

# End-of-document tokens of well-known tokenizer files, in the order they are looked for: GPT-2 and its
# descendants, Llama-3, Llama-2 / SentencePiece conversions, Gemma and others.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names the file and the fix."""


class Tokenizer:
    """What meshrun needs of a tokenizer."""

    name: str
    """`bytes`, or the path of the tokenizer.json file."""
    vocab_size: int
    """Token ids are < vocab_size (special tokens included)."""
    eod_id: int
    """The end-of-document token appended to every document."""

    def encode(self, text: str) -> list[int]:  # pragma: no cover - interface
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> dict:
        """Identity for a dataset's description JSON."""
        return {"name": self.name, "vocab_size": self.vocab_size, "eod_id": self.eod_id}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0..255; 256 ends a document. Lossless for any text."""

    def __init__(self) -> None:
        self.name, self.vocab_size, self.eod_id = BYTES, BYTE_VOCAB, BYTE_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json."""

    def __init__(self, path: str, eod_token: str = "") -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:  # a runtime dependency (pyproject.toml); said plainly if missing
            raise TokenizerError("the Hugging Face `tokenizers` package is missing; pip install tokenizers") from exc
        try:
            self.hf = _HF.from_file(path)
        except Exception as exc:  # tokenizers raises its own Exception types for bad JSON / unknown models
            raise TokenizerError(
                f"{path}: not a loadable Hugging Face tokenizer.json ({str(exc).splitlines()[0][:200]}); "
                f"give a tokenizer.json saved by `tokenizers` or `transformers`, or prepare.tokenizer=bytes|bpe"
            ) from exc
        self.name = os.path.abspath(path)
        self.vocab_size = int(self.hf.get_vocab_size(with_added_tokens=True))
        self.eod_id = self._find_eod(path, eod_token)
        self._fast = getattr(self.hf, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets computed

    def _find_eod(self, path: str, eod_token: str) -> int:
        names = (eod_token,) if eod_token else EOD_CANDIDATES
        for name in names:
            token_id = self.hf.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        if eod_token:
            raise TokenizerError(
                f"{path}: has no token {eod_token!r}; set prepare.eod_token to one of its special tokens"
            )
        raise TokenizerError(
            f"{path}: has none of the end-of-document tokens {', '.join(EOD_CANDIDATES)}; "
            f"name its end-of-document token with prepare.eod_token=TOKEN"
        )

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast(list(texts), add_special_tokens=False)]
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        out = super().describe()
        out["eod_token"] = self.hf.id_to_token(self.eod_id)
        with open(self.name, "rb") as f:
            out["sha256"] = hashlib.sha256(f.read()).hexdigest()
        return out


def train_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = "<|endoftext|>"):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained on `texts`; returns the `tokenizers` object.

    The trainer keeps word counts, not the text, so its memory follows the distinct words of the input."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod_token],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def description_path(prefix: str) -> str:
    """NAME.json: the description `meshrun action=prepare` writes beside NAME.bin / NAME.idx."""
    return prefix + ".json"


def dataset_tokenizer_spec(prefix: str) -> tuple[str, str] | None:
    """(`bytes` or the tokenizer.json path, its end-of-document token) a dataset was prepared with, or None."""
    try:
        with open(description_path(prefix)) as f:
            desc = json.load(f)
    except (OSError, ValueError):
        return None
    tok = desc.get("tokenizer") or {}
    if tok.get("file"):  # stored beside the dataset, named relative to it so the folder can move
        return os.path.join(os.path.dirname(os.path.abspath(prefix)), tok["file"]), tok.get("eod_token", "")
    return (tok["name"], "") if tok.get("name") else None


def _recorded_sha256(prefix: str) -> str | None:
    try:
        with open(description_path(prefix)) as f:
            return ((json.load(f) or {}).get("tokenizer") or {}).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path_or_name: str, eod_token: str = "", _via: str | None = None) -> Tokenizer:
    """`bytes`, a tokenizer.json file, a directory holding one, or a dataset prefix (its NAME.json names it;
    the tokenizer file must have the sha256 the description recorded)."""
    spec = str(path_or_name)
    if spec == BYTES:
        return ByteTokenizer()
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return HFTokenizer(os.path.join(spec, "tokenizer.json"), eod_token)
    if os.path.isfile(spec) and not spec.endswith((".bin", ".idx")):
        return HFTokenizer(spec, eod_token)
    if os.path.isfile(description_path(spec)):
        if _via is not None:  # a description naming a dataset (itself, or another one) as its tokenizer
            raise TokenizerError(
                f"{description_path(_via)} names {spec!r} as its tokenizer, which is a dataset, not "
                f"a tokenizer file; prepare the dataset again (action=prepare) or restore its "
                f"tokenizer.json"
            )
        inner = dataset_tokenizer_spec(spec)
        if inner is None:
            raise TokenizerError(
                f"{description_path(spec)}: names no tokenizer (a dataset meshrun did not prepare); "
                f"give the tokenizer file itself"
            )
        tok = load_tokenizer(inner[0], eod_token or inner[1], _via=spec)
        recorded = _recorded_sha256(spec)
        actual = tok.describe().get("sha256")
        if recorded and actual and recorded != actual:
            raise TokenizerError(
                f"{inner[0]} is not the tokenizer {description_path(spec)} was prepared with "
                f"(sha256 {actual[:12]}..., recorded {recorded[:12]}...): its token ids would "
                f"decode to other text. Restore that tokenizer file, or prepare the dataset again"
            )
        return tok
    raise TokenizerError(
        f"{spec!r}: no such tokenizer file, directory with tokenizer.json, or dataset prefix "
        f"(nothing is downloaded); give `bytes`, a path to a tokenizer.json, or a prepared dataset"
    )
