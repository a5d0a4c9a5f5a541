"""The sample sources of a run, built from its config: synthetic, byte text or blended indexed datasets.
Apart from the source types (sources.py) and the blend (blend.py), which both import the types: no circle."""

from __future__ import annotations

from training.contract.config import Config
from training.data.blend import make_indexed_source
from training.data.sources import (
    CorpusInfo,
    SampleSource,
    SyntheticSource,
    TextSource,
    build_corpus,
    validate_data_config,
)


def make_source(cfg: Config, run_dir: str, corpus: CorpusInfo | None = None, may_describe: bool = True) -> SampleSource:
    """The sample source of this run (builds the text corpus unless given; opens indexed datasets)."""
    validate_data_config(cfg)
    if cfg.data.kind == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
    if cfg.data.kind == "indexed":
        return make_indexed_source(cfg, "train", may_describe)
    return TextSource(corpus or build_corpus(cfg, run_dir), cfg.model.seq_length, cfg.train.seed)


def make_eval_source(cfg: Config, may_describe: bool = True) -> SampleSource:
    """The held-out source of train.eval_every: the indexed datasets' validation split, or for synthetic
    data a stream of another seed."""
    validate_data_config(cfg)
    if cfg.data.kind == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed ^ 0x5EED)
    return make_indexed_source(cfg, "valid", may_describe)
