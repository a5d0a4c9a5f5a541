"""The optimizer's blocked update at the caller's intra-op thread count: the same bits at one thread as at two,
and a training step that never changes the thread count nor starts a thread (docs/PERFORMANCE.md, "The update's
threads, reverted": switching the count around the update cost the whole CPU step about 6 %)."""

from __future__ import annotations

import tempfile
import threading
import types

import torch

from training.contract.config import Config
from training.optim.adamw import ShardedAdamW
from training.parallel.mesh import ProcessMesh
from training.run.loop import Trainer


def _update(monkeypatch):
    g = torch.Generator().manual_seed(0)
    n = 1000
    segments = [types.SimpleNamespace(decay=True, shard_start=0, shard_end=600)]
    layout = types.SimpleNamespace(params=[torch.empty(1)], shard_size=n, segments=segments)
    opt = ShardedAdamW(layout, 0.9, 0.95, 1e-8, 0.1)
    monkeypatch.setattr(opt, "block_elements", lambda device: 97)  # 11 blocks, one of them partly decayed
    w = torch.randn(n, generator=g)
    for step in (1, 2, 3):
        opt.update(w, torch.randn(n, generator=g), lr=1e-2, step=step, grad_coef=0.5)
    assert opt.scratch_bytes() == 97 * 4  # one block's scratch, reused
    return w, opt.exp_avg, opt.exp_avg_sq


def test_update_is_bit_identical_at_one_and_two_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _update(monkeypatch)
        torch.set_num_threads(2)
        two = _update(monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_a_training_step_keeps_the_thread_count_and_starts_no_thread(monkeypatch):
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 4
    cfg.data.kind, cfg.train.progress, cfg.train.tensorboard = "synthetic", False, False
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single("cpu"), checkpointing=False)
        trainer.train_step()  # anything made once (buffers, scratch) exists from here on
        threads = threading.active_count()

        def refuse(n: int) -> None:
            raise AssertionError(f"torch.set_num_threads({n}) during a training step")

        monkeypatch.setattr(torch, "set_num_threads", refuse)
        losses = [trainer.train_step()[0] for _ in range(2)]
        monkeypatch.undo()
        assert all(loss == loss for loss in losses) and torch.get_num_threads() == 2
        assert threading.active_count() == threads
    finally:
        torch.set_num_threads(before)
