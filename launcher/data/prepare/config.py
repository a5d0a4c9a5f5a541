"""The prepare.* keys of `meshrun action=prepare` (launcher/data/prepare/__init__.py): the command line's own,
composed by launcher/cli/options.py's AppConfig, never in the ranks' config.json."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrepareConfig:
    """`meshrun action=prepare`: tokenize text into a Megatron-compatible indexed dataset."""

    inputs: list[str] = field(default_factory=list)
    """Text files, JSON Lines files (*.jsonl) or directories of them; empty: the Python standard library's sources."""
    output: str = "data/stdlib"
    """Dataset prefix DIR/NAME: writes NAME.bin, NAME.idx, NAME.json (+ NAME.valid.*, NAME.tokenizer.json)."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes + end-of-document) | bpe (train a byte-level BPE on the inputs) | a tokenizer.json path."""
    vocab_size: int = 4096
    """tokenizer=bpe: vocabulary of the trained BPE (special tokens included)."""
    overwrite: bool = False
    """Replace an existing dataset at prepare.output (its .bin/.idx/.json and tokenizer). Off: an existing
    output is refused (exit 2), since runs that trained on it would decode with the new tokenizer."""
    text_key: str = "text"
    """JSON Lines: the field that holds each document's text."""
    eod_token: str = ""
    """End-of-document token of a given tokenizer.json; empty: <|endoftext|>, <|end_of_text|>, </s>, ... as found."""
    valid_fraction: float = 0.01
    """Share of documents held out for validation, chosen by a hash of each document's text (deterministic)."""
    workers: int = 0
    """Tokenizing worker processes; 0: one per CPU."""
    max_bytes: int = 0
    """Read at most this many bytes of input (whole documents); 0: everything."""
    bpe_max_bytes: int = 50_000_000
    """tokenizer=bpe: bytes of input the BPE trainer reads at most (from the start); 0: everything."""
    progress: bool = True
    """Progress bar (tokens/s, ETA) on stderr."""
    suffixes: list[str] = field(default_factory=list)
    """File suffixes read from directories in prepare.inputs (e.g. [.txt,.c,.jsonl]; .jsonl files are JSON Lines);
    empty: .py .txt .md .rst .jsonl .parquet .arrow (Parquet / Arrow: one document per row). Files with other
    suffixes are skipped and listed on stderr."""
