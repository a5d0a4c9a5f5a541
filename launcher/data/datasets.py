"""data=indexed on the launcher's side: absolute dataset paths and the model's vocabulary from the tokenizer.

Runs before validation (launcher/cli/app.py). Ranks may start in another working directory (Slurm), so the
prefixes are made absolute here, once, and config.json records them so. The model's vocabulary comes from
the datasets: unless `model.vocab_size` is given on the command line, it becomes the largest vocabulary of
the datasets' tokenizers (a dataset meshrun did not write: its largest token id + 1, from a one-time scan
cached beside it); a vocabulary given smaller than that is an error (data_errors below).
No torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from launcher.plan.cluster_facts import cluster_facts
from training.contract.config import Config

# training.data.indexed (and numpy with it) is imported only where data=indexed is read: every other launch,
# plan and sweep point validates without it.


def _prepare_fix(prefix: str) -> str:
    """A command that makes the dataset a prefix names (action=prepare's default input: the stdlib sources)."""
    import shlex

    return (
        f"meshrun action=prepare prepare.output={shlex.quote(prefix)} (from the standard library's sources), or "
        f"meshrun action=prepare prepare.inputs=[<your files>] prepare.output={shlex.quote(prefix)}, or "
        "data.prefixes=[<an existing prefix>]"
    )


def _given(overrides: Sequence[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def dataset_vocab(prefixes: Sequence[str], may_scan: bool) -> int | None:
    """The largest vocabulary the datasets need, or None when a description cannot be had (validation says why)."""
    from training.data.indexed import open_dataset, read_description
    from training.data.sources import DataError

    need = 0
    for prefix in prefixes:
        try:
            desc = read_description(prefix)
            if desc is None:
                if not may_scan:
                    return None
                desc = open_dataset(prefix, may_describe=True)[1]
        except (DataError, OSError):
            return None
        need = max(need, int(desc.get("min_vocab_size") or 0))
    return need or None


def _record_tokenizer(cfg: Config) -> None:
    """data.tokenizer_sha256: recorded at the run's first launch from the first dataset's description; a later
    launch whose dataset was prepared again with another tokenizer exits 2 (its ids would mean other text)."""
    if not cfg.data.prefixes:
        return
    from training.data.indexed import read_description
    from training.data.sources import DataError

    try:
        desc = read_description(cfg.data.prefixes[0]) or {}
    except (DataError, OSError):
        return  # validation names the unreadable dataset
    sha = str(((desc.get("tokenizer") or {}) if isinstance(desc, dict) else {}).get("sha256") or "")
    if not sha:
        return
    if not cfg.data.tokenizer_sha256:
        cfg.data.tokenizer_sha256 = sha
    elif cfg.data.tokenizer_sha256 != sha:
        from training.contract.exit_codes import EXIT_INVALID

        print(
            f"meshrun: {cfg.data.prefixes[0]} was prepared again with another tokenizer (sha256 {sha[:12]}...) "
            f"since this run started with {cfg.data.tokenizer_sha256[:12]}...: its token ids now mean other text. "
            f"Restore that dataset, or start a new run.dir on the new one; nothing was written.",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)


def resolve_indexed(cfg: Config, overrides: Sequence[str]) -> None:
    """Absolute prefixes; model.vocab_size from the datasets unless given on the command line."""
    d = cfg.data
    d.prefixes = [os.path.abspath(p) for p in d.prefixes]
    d.valid_prefixes = [os.path.abspath(p) for p in d.valid_prefixes]
    _record_tokenizer(cfg)
    if _given(overrides, "model.vocab_size"):
        return
    vocab = dataset_vocab(d.prefixes, may_scan=cluster_facts(cfg).ranks_here)
    if vocab is not None and vocab != cfg.model.vocab_size:
        print(
            f"meshrun: model.vocab_size={vocab} from the dataset's tokenizer (was {cfg.model.vocab_size})",
            file=sys.stderr,
        )
        cfg.model.vocab_size = vocab


def data_errors(cfg: Config) -> list[tuple]:
    """(key, message, fix) for every data problem a user can fix; launcher/launch/host_checks.py reports them."""
    t, d = cfg.train, cfg.data
    out = _eval_errors(cfg)
    if d.kind != "indexed":
        return out
    if not d.prefixes:
        out.append(
            (
                "data.prefixes",
                "data=indexed needs at least one dataset prefix",
                "data.prefixes=[DIR/NAME] (written by meshrun action=prepare)",
            )
        )
        return out
    out += _weight_errors(cfg)
    if not cluster_facts(cfg).ranks_here:
        return out  # the compute nodes may mount paths this host lacks: the ranks check and exit 2 themselves
    descs = _dataset_errors(cfg, out)
    out += _tokenizer_errors(descs)
    if t.eval_every > 0:
        out += _valid_split_errors(cfg, descs)
    return out


def _eval_errors(cfg: Config) -> list[tuple]:
    """The evaluation settings, and whether the data kind has a held-out split to evaluate on."""
    out: list[tuple] = []
    t, d = cfg.train, cfg.data
    if t.eval_every < 0:
        out.append(("train.eval_every", f"must be >= 0, got {t.eval_every}", "train.eval_every=0 (off) or N"))
    if t.eval_iters < 1:
        out.append(("train.eval_iters", f"must be >= 1, got {t.eval_iters}", "train.eval_iters=2"))
    if t.eval_every > 0 and d.kind == "text":
        out.append(
            (
                "train.eval_every",
                "data=text has no held-out split",
                "data=indexed (meshrun action=prepare holds out a validation split) or train.eval_every=0",
            )
        )
    return out


def _weight_errors(cfg: Config) -> list[tuple]:
    """The blend's weights: one per prefix, none negative, a positive sum."""
    d = cfg.data
    if d.weights and len(d.weights) != len(d.prefixes):
        return [
            (
                "data.weights",
                f"{len(d.weights)} weights for {len(d.prefixes)} prefixes",
                "one weight per prefix, or data.weights=[] (weights by token count)",
            )
        ]
    if d.weights and (any(w < 0 for w in d.weights) or sum(d.weights) <= 0):
        return [
            (
                "data.weights",
                f"{list(d.weights)}: weights must be >= 0 with a positive sum",
                f"data.weights=[{','.join(['1'] * len(d.prefixes))}]",
            )
        ]
    return []


def _dataset_errors(cfg: Config, out: list[tuple]) -> list[dict]:
    """Open every training dataset: what cannot be opened, a vocabulary or sequence length it does not fit, go to
    `out`; returns the descriptions of those that opened."""
    from training.data.indexed import open_dataset
    from training.data.sources import DataError

    descs = []
    for prefix in cfg.data.prefixes:
        try:
            ds, desc = open_dataset(prefix, may_describe=True)
        except DataError as exc:
            out.append(("data.prefixes", str(exc), _prepare_fix(prefix)))
            continue
        descs.append(desc)
        need = int(desc.get("min_vocab_size") or 0)
        if cfg.model.vocab_size < need:
            out.append(
                (
                    "model.vocab_size",
                    f"{cfg.model.vocab_size} is smaller than {prefix}'s vocabulary ({need})",
                    f"model.vocab_size={need}, or leave it unset (meshrun then takes the tokenizer's)",
                )
            )
        if (ds.num_tokens - 1) // cfg.model.seq_length < 1:
            out.append(
                (
                    "model.seq_length",
                    f"{prefix} holds {ds.num_tokens} tokens, fewer than one sample of {cfg.model.seq_length} + 1",
                    "a shorter model.seq_length or a larger dataset",
                )
            )
    return descs


def _tokenizer_errors(descs: list[dict]) -> list[tuple]:
    """A blend of datasets prepared with different tokenizers."""
    names = {
        (desc.get("tokenizer") or {}).get("sha256") or (desc.get("tokenizer") or {}).get("name")
        for desc in descs
        if desc.get("tokenizer")
    }
    if len(names) <= 1:
        return []
    return [
        (
            "data.prefixes",
            "the datasets were prepared with different tokenizers, so the same id means different text in each",
            "prepare every dataset of a blend with the same prepare.tokenizer",
        )
    ]


def _valid_split_errors(cfg: Config, descs: list[dict]) -> list[tuple]:
    """With evaluation on: the given validation datasets open, or else every training dataset has its split."""
    from training.data.indexed import open_dataset
    from training.data.sources import DataError

    out: list[tuple] = []
    d = cfg.data
    if d.valid_prefixes:
        for prefix in d.valid_prefixes:
            try:
                open_dataset(prefix, may_describe=True)
            except DataError as exc:
                out.append(("data.valid_prefixes", str(exc), _prepare_fix(prefix)))
        return out
    for prefix, desc in zip(d.prefixes, descs):
        if not desc.get("valid_prefix"):
            out.append(
                (
                    "train.eval_every",
                    f"{prefix} has no validation split",
                    "prepare it with prepare.valid_fraction>0, give data.valid_prefixes=[...], or train.eval_every=0",
                )
            )
    return out
