"""Deterministic, layout-independent sampling; the byte corpus; clear errors for bad data settings."""

from __future__ import annotations

import pytest
import torch

from training.contract.config import Config
from training.data import BatchSampler, DataError, build_corpus, make_source, validate_data_config


def _cfg(kind="text", **data) -> Config:
    cfg = Config()
    cfg.data.kind = kind
    cfg.model.seq_length = 16
    cfg.data.max_bytes = 20_000
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_dp2_slices_concatenate_to_dp1_batches(kind, tmp_path):
    cfg = _cfg(kind)
    source = make_source(cfg, str(tmp_path))
    one = BatchSampler(source, global_batch=8, micro_batch=2, dp=1, dp_rank=0)
    two = [BatchSampler(source, global_batch=8, micro_batch=2, dp=2, dp_rank=r) for r in range(2)]
    consumed = 0
    for _ in range(3):
        full = torch.cat([t for t, _ in one.micro_batches(consumed)])
        split = torch.cat([t for r in range(2) for t, _ in two[r].micro_batches(consumed)])
        assert torch.equal(full, split)
        consumed += 8
    # Targets are the inputs shifted by one token.
    t, y = one.micro_batches(0)[0]
    assert torch.equal(t[:, 1:], y[:, :-1])


def test_batches_depend_only_on_seed_and_position(tmp_path):
    cfg = _cfg("text")
    a = BatchSampler(make_source(cfg, str(tmp_path / "a")), 4, 4, 1, 0).micro_batches(40)[0][0]
    b = BatchSampler(make_source(cfg, str(tmp_path / "b")), 4, 4, 1, 0).micro_batches(40)[0][0]
    assert torch.equal(a, b)
    cfg.train.seed += 1
    c = BatchSampler(make_source(cfg, str(tmp_path / "c")), 4, 4, 1, 0).micro_batches(40)[0][0]
    assert not torch.equal(a, c)


def test_default_corpus_is_the_stdlib_sources(tmp_path):
    info = build_corpus(_cfg("text"), str(tmp_path))
    assert info.num_bytes == 20_000 and info.num_files >= 1
    assert b"import" in open(info.path, "rb").read()


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist.*data.paths"):
        make_source(_cfg("text", paths=[str(tmp_path / "nope")]), str(tmp_path))


def test_empty_files_are_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        make_source(_cfg("text", paths=[str(tmp_path / "empty.txt")]), str(tmp_path / "run"))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no text files"):
        make_source(_cfg("text", paths=[str(tmp_path / "d")]), str(tmp_path / "run"))


def test_seq_longer_than_data_is_a_clear_error(tmp_path):
    (tmp_path / "small.txt").write_text("x" * 10)
    with pytest.raises(DataError, match="seq_length=16 is longer than the data"):
        make_source(_cfg("text", paths=[str(tmp_path / "small.txt")]), str(tmp_path / "run"))


def test_vocab_smaller_than_bytes_is_a_clear_error():
    cfg = _cfg("text")
    cfg.model.vocab_size = 100
    with pytest.raises(DataError, match="vocab_size>=256"):
        validate_data_config(cfg)


def test_global_batch_must_split_over_dp():
    with pytest.raises(DataError, match="global_batch"):
        BatchSampler(None, global_batch=6, micro_batch=2, dp=2, dp_rank=0)


def _trainer_data_error(cfg_dict: dict, run_dir: str) -> str:
    from training.contract.config import config_from_dict
    from training.data import DataError
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    cfg = config_from_dict(cfg_dict)
    mesh = ProcessMesh.from_env(1, 1, 1, 2, timeout_s=cfg.train.dist_timeout_s)
    try:
        Trainer(cfg, run_dir, mesh)
    except DataError as exc:
        return str(exc)
    finally:
        mesh.destroy()
    return "no error"


def test_a_data_error_on_rank_0_reaches_every_rank_at_once(tmp_path):
    """Rank 0 builds the corpus; its DataError reaches the other ranks at once (all exit 2), instead of
    leaving them to wait out the collective timeout and fail."""
    import time

    from helpers.dist import run_distributed

    from training.contract.config import Config, config_to_dict

    cfg = Config()
    cfg.data.paths = [str(tmp_path / "missing.txt")]  # bypasses the launcher's check, as a Slurm node would
    cfg.train.dist_timeout_s = 60
    start = time.monotonic()
    out = run_distributed(_trainer_data_error, 2, args=(config_to_dict(cfg), str(tmp_path)), timeout_s=50)
    assert time.monotonic() - start < 50
    assert "missing.txt" in out[0] and "does not exist" in out[0]
    assert "rank 0 could not build the text corpus" in out[1]
