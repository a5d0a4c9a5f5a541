"""The tokenizer a run trained with, for export (its files) and generate (a text prompt). No torch.

data=indexed: the tokenizer `meshrun action=prepare` recorded for the first dataset prefix (training/contract/tokenizer.py);
data=text: UTF-8 bytes; data=synthetic: none (token ids only).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any


def run_tokenizer(cfg):
    """The run's tokenizer (training/contract/tokenizer.py's interface: encode, decode, vocab_size, eod_id), or None."""
    from training.contract.tokenizer import load_tokenizer

    kind = str(cfg.data.kind)
    if kind == "text":
        return load_tokenizer("bytes")
    prefixes = list(getattr(cfg.data, "prefixes", []) or [])
    if kind == "indexed" and prefixes:
        tok = load_tokenizer(prefixes[0])  # checked against the sha256 its dataset's description recorded
        recorded = str(getattr(cfg.data, "tokenizer_sha256", "") or "")
        actual = tok.describe().get("sha256") if hasattr(tok, "describe") else None
        if recorded and actual and actual != recorded:
            from training.contract.tokenizer import TokenizerError

            raise TokenizerError(
                f"{prefixes[0]} was prepared again with another tokenizer (sha256 {actual[:12]}...) "
                f"after this run trained with {recorded[:12]}...: its ids would decode to other text. "
                f"Restore the dataset the run trained on (its tokenizer.json)"
            )
        return tok
    return None


def write_tokenizer_files(cfg, directory: str) -> dict[str, Any]:
    """Copy the run's tokenizer.json into `directory` with a tokenizer_config.json transformers' AutoTokenizer
    reads; returns the token ids config.json should name ({} when the run has no tokenizer file)."""
    tok = run_tokenizer(cfg)
    if tok is None:
        return {}
    # data=text trains on raw bytes without an end-of-document token: name one only when the model has it.
    ids = (
        {"eos_token_id": int(tok.eod_id), "bos_token_id": int(tok.eod_id)}
        if str(cfg.data.kind) == "indexed" and int(tok.eod_id) < cfg.model.vocab_size
        else {}
    )
    path = getattr(tok, "name", "")
    if not (isinstance(path, str) and os.path.isfile(path)):
        return ids  # the byte tokenizer: no file to ship (token ids are the UTF-8 bytes)
    shutil.copyfile(path, os.path.join(directory, "tokenizer.json"))
    eod = ""
    try:
        eod = tok.hf.id_to_token(int(tok.eod_id)) or ""
    except Exception:  # noqa: BLE001 - a tokenizer object without the tokenizers handle: leave tokens unnamed
        pass
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(cfg.model.seq_length)}
    if eod:
        config.update({"eos_token": eod, "bos_token": eod})
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return ids


def tokenizer_or_none(cfg) -> object | None:
    """run_tokenizer, with a missing tokenizer file reported as None (generate then asks for prompt_tokens)."""
    try:
        return run_tokenizer(cfg)
    except (ImportError, ValueError, OSError):
        return None
