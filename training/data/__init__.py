"""Training data: sample sources, the batch sampler, Megatron-compatible indexed datasets and blending.

- sources.py: the deterministic, layout-independent stream (BatchSampler), synthetic and byte-text sources;
- indexed.py: the MMIDIDX .bin/.idx format (reader, streaming writer) and NAME.json descriptions;
- blend.py: windows packed across documents, keyed shuffles without tables, weighted blending;
- factory.py: the run's sources from its config (make_source, make_eval_source).
No torch at import time (the launcher validates and prepares data through this package).
"""

from training.data.factory import make_eval_source, make_source
from training.data.sources import (
    BYTE_VOCAB,
    TEXT_SUFFIXES,
    BatchSampler,
    CorpusInfo,
    DataError,
    SampleSource,
    SyntheticSource,
    TextSource,
    build_corpus,
    default_corpus_root,
    list_text_files,
    validate_data_config,
)

__all__ = [
    "BYTE_VOCAB",
    "TEXT_SUFFIXES",
    "BatchSampler",
    "CorpusInfo",
    "DataError",
    "SampleSource",
    "SyntheticSource",
    "TextSource",
    "build_corpus",
    "default_corpus_root",
    "list_text_files",
    "make_eval_source",
    "make_source",
    "validate_data_config",
]
