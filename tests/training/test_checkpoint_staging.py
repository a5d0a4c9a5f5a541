"""Asynchronous saves with the staging barrier (training/checkpoint/staging.py, CheckpointManager.wait_staged)
and the checkpoint writer's speed-ups (training/checkpoint/crc_writer.py).

The loop's contract: save(); the next step's forward and backward; wait_staged(); optimizer step. A save must
hold the state as it was at save(), bit for bit, even though the state changes right after the barrier;
host buffers are reused from one save to the next; a failed host copy fails the save at wait() (on every
rank), never at the barrier.
"""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import pytest
import torch
from helpers.checkpoint import StandInModel, stand_in_cfg, stand_in_mesh
from helpers.dist import run_distributed

from training.checkpoint import CheckpointError, CheckpointManager, crc_writer, storage
from training.checkpoint.staging import HostStager
from training.optim import DistributedOptimizer


def _build(run_dir, tp=1, dp=1, zero=0, async_save=True):
    mesh = stand_in_mesh(tp, dp)
    cfg = stand_in_cfg(tp, dp, zero)
    cfg.train.async_save = async_save
    model = StandInModel(tp, mesh.tp_rank)
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    return mesh, cfg, model, opt, CheckpointManager(run_dir, mesh, cfg)


def _randomise(model, opt, seed):
    """Distinct values everywhere (a constant would hide a piece copied to the wrong place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt.exp_avg.copy_(torch.randn(opt.exp_avg.shape, generator=g))
    opt.exp_avg_sq.copy_(torch.rand(opt.exp_avg_sq.shape, generator=g))


def _snapshot(model, opt):
    return [p.detach().clone() for _, p in model.named_parameters()] + [opt.exp_avg.clone(), opt.exp_avg_sq.clone()]


def _mutate(model, opt):
    """What the optimizer step does to the saved state: every parameter and moment changes, in place."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(1.0)
    opt.exp_avg.mul_(-2.0)
    opt.exp_avg_sq.add_(3.0)


def _assert_resumes_to(run_dir, step, expected, resume="auto"):
    mesh, cfg, model, opt, ck = _build(run_dir, async_save=False)
    cfg.train.resume = resume
    got = ck.maybe_resume([model], opt, {"consumed_samples": 0})
    assert got == (step, 8 * step)
    real = [(s.shard_start, s.shard_end) for s in opt.segments]  # the flat buffers' padding is not state
    loaded = _snapshot(model, opt)
    for i, (a, b) in enumerate(zip(loaded, expected)):
        if i >= len(loaded) - 2:
            for lo, hi in real:
                assert torch.equal(a[lo:hi], b[lo:hi]), (i, lo, hi)
        else:
            assert torch.equal(a, b), i


def test_snapshot_is_bit_exact_when_the_state_changes_right_after_the_barrier(tmp_path, monkeypatch):
    run = str(tmp_path)
    _, _, model, opt, ck = _build(run)
    copy = HostStager.copy
    release, done = threading.Event(), threading.Event()

    def held_copy(self):  # a copy still running when save() returns: only the barrier keeps it exact
        release.wait(timeout=60)  # held until the test lets it go (a save that waited for it would wait 60 s)
        copy(self)
        done.set()

    monkeypatch.setattr(HostStager, "copy", held_copy)
    ck.wait_staged()  # the loop's barrier of the step before the save: nothing pending, returns at once
    expected = {}
    for step in (1, 2):
        _randomise(model, opt, seed=step)
        expected[step] = _snapshot(model, opt)
        release.clear()
        done.clear()
        stats = ck.save(step, [model], opt, {"consumed_samples": 8 * step})
        assert not done.is_set()  # save() returned with the copy still to run
        release.set()  # the copy goes on in the background now
        waited = ck.wait_staged()
        assert done.is_set()  # the barrier returned once the copy had finished
        _mutate(model, opt)  # the optimizer step, right after the barrier
        assert ck.wait() is stats
        assert stats.blocked_s >= waited >= 0 and stats.total_s >= stats.blocked_s
        assert storage.verify(storage.step_dir(run, step)).ok
    _assert_resumes_to(run, 2, expected[2])
    _assert_resumes_to(run, 1, expected[1], resume="1")


def test_host_buffers_are_reused_across_saves(tmp_path):
    _, _, model, opt, ck = _build(str(tmp_path))
    ck.wait_staged()
    ptrs = []
    for step in (1, 2, 3):
        ck.save(step, [model], opt, {"consumed_samples": step})
        ck.wait_staged()
        ck.wait()
        ptrs.append(sorted(b.data_ptr() for b in ck._stager._buffers.values()))
    assert ptrs[0] == ptrs[1] == ptrs[2] and ptrs[0]
    state_bytes = sum(p.numel() * 4 for _, p in model.named_parameters()) * 3  # weights, m, v
    assert ck._stager.nbytes == state_bytes


def test_without_a_barrier_save_copies_before_it_returns(tmp_path):
    """A caller that never calls wait_staged may change the state as soon as save() returns."""
    run = str(tmp_path)
    _, _, model, opt, ck = _build(run)
    _randomise(model, opt, seed=5)
    expected = _snapshot(model, opt)
    ck.save(1, [model], opt, {"consumed_samples": 8})
    _mutate(model, opt)
    ck.wait()
    _assert_resumes_to(run, 1, expected)


def test_a_failed_host_copy_fails_the_save_at_wait_not_at_the_barrier(tmp_path, monkeypatch):
    run = str(tmp_path)
    _, _, model, opt, ck = _build(run)
    ck.wait_staged()
    _randomise(model, opt, seed=1)
    expected = _snapshot(model, opt)
    ck.save(1, [model], opt, {"consumed_samples": 8})
    ck.wait()

    def broken_copy(self):
        self._error = MemoryError("no host memory")

    monkeypatch.setattr(HostStager, "copy", broken_copy)
    ck.save(2, [model], opt, {"consumed_samples": 16})
    ck.wait_staged()  # returns: the failure belongs to the save, not to the training step
    _mutate(model, opt)
    with pytest.raises(
        CheckpointError, match="step_2.*copying the state to host memory failed.*MemoryError.*step_1\\) is untouched"
    ):
        ck.wait()
    assert storage.list_steps(run) == [1] and storage.read_latest(run) == 1
    assert not [n for n in os.listdir(storage.checkpoints_dir(run)) if n.startswith(".tmp")]
    _assert_resumes_to(run, 1, expected)


def _two_rank_save(run_dir, fail_rank):
    """dp=2 zero=1 (each rank saves its own optimizer shard) over the mesh's background gloo group."""
    mesh, cfg, model, opt, ck = _build(run_dir, dp=2, zero=1)
    ck.wait_staged()
    _randomise(model, opt, seed=11 + mesh.dp_rank)
    expected = _snapshot(model, opt)
    ck.save(1, [model], opt, {"consumed_samples": 8})
    ck.wait_staged()
    _mutate(model, opt)
    ck.wait()
    if mesh.dp_rank == fail_rank:
        ck._stager.copy = lambda: setattr(ck._stager, "_error", MemoryError("no host memory"))
    ck.save(2, [model], opt, {"consumed_samples": 16})
    ck.wait_staged()
    _mutate(model, opt)
    try:
        ck.wait()
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return [t.numpy() for t in expected], error  # plain arrays: tensors cannot outlive the spawned rank


def _resume(run_dir):
    mesh = stand_in_mesh(1, 2)  # new groups in the same world: a fresh manager, optimizer and model
    cfg = stand_in_cfg(1, 2, 1)
    model = StandInModel(1, 0)
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    got = CheckpointManager(run_dir, mesh, cfg).maybe_resume([model], opt, {"consumed_samples": 0})
    out = (got, [t.numpy() for t in _snapshot(model, opt)], [(s.shard_start, s.shard_end) for s in opt.segments])
    return out, mesh


def _save_then_resume(run_dir, fail_rank):
    """Both halves in one spawn (a launch is the expensive part); every rank has returned from the failed save
    before any rank starts to resume."""
    import torch.distributed as dist

    saved = _two_rank_save(run_dir, fail_rank)
    dist.barrier()
    resumed, mesh = _resume(run_dir)
    mesh.destroy()  # the one process group, and with it every mesh's groups
    return saved, resumed


def test_two_ranks_snapshot_and_a_failed_copy_on_one_rank(tmp_path):
    run = str(tmp_path)
    both = run_distributed(_save_then_resume, 2, args=(run, 1), timeout_s=240)
    results = [saved for saved, _ in both]
    for _, error in results:  # both ranks learn of rank 1's failure; nobody hangs in a collective
        assert error and "copying the state to host memory failed" in error and "step_1) is untouched" in error
    assert storage.list_steps(run) == [1]
    resumed = [r for _, r in both]
    for rank, (got, loaded, real) in enumerate(resumed):
        assert got == (1, 8)
        expected = results[rank][0]
        # Weights are replicated over dp: dp rank 0 wrote them. Optimizer shards: each rank its own.
        for a, b in zip(loaded[:-2], results[0][0][:-2]):
            assert np.array_equal(a, b)
        for a, b in zip(loaded[-2:], expected[-2:]):
            for lo, hi in real:
                assert np.array_equal(a[lo:hi], b[lo:hi])


# ----- the writer ----------------------------------------------------------------------------------
def test_crc_of_large_and_small_writes_matches_the_file(tmp_path):
    fs = crc_writer._CrcFileSystem()
    path = tmp_path / "f.bin"
    big = torch.randn(3 * crc_writer.HELPER_MIN_BYTES // 4).view(torch.uint8).numpy()
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"header")
        stream.write(memoryview(big))  # through the helper thread, with writeback started
        stream.write(b"tail")
    data = path.read_bytes()
    assert fs.sums["f.bin"] == [len(data), zlib.crc32(data)]


def test_zip_record_crc_is_off_only_while_writing_and_restored():
    from torch.utils.serialization import config

    assert config.save.compute_crc32
    with crc_writer.no_zip_record_crc():
        with crc_writer.no_zip_record_crc():  # concurrent writers nest
            assert not config.save.compute_crc32
        assert not config.save.compute_crc32
    assert config.save.compute_crc32


def _pinned_staging_save_and_resume(run_dir):
    """One gloo rank (a process group makes the manager build ShardedTensors, as every engine run does, world
    size 1 included). A CPU-only torch cannot pin memory (that needs the CUDA driver), so the staging buffers
    say they are pinned: the property ShardedTensor checks against the declared tensor properties."""
    import training.checkpoint.staging as staging
    from training.parallel.mesh import ProcessMesh

    pinned = set()
    real_empty, real_is_pinned = torch.empty, torch.Tensor.is_pinned

    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        pinned.add(t.data_ptr())
        return t

    torch.Tensor.is_pinned = lambda t, *a: t.data_ptr() in pinned or real_is_pinned(t, *a)
    staging.torch.empty = empty
    mesh = ProcessMesh.from_env(tp=1, pp=1, cp=1, dp=1, backend="gloo", timeout_s=120)
    cfg = stand_in_cfg(1, 1, 0)
    cfg.train.async_save = True
    model = StandInModel(1, 0)
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    ck = CheckpointManager(run_dir, mesh, cfg)
    _randomise(model, opt, seed=11)
    expected = _snapshot(model, opt)
    ck.save(1, [model], opt, {"consumed_samples": 8})
    ck.wait_staged()
    all_pinned = bool(ck._stager._buffers) and all(b.is_pinned() for b in ck._stager._buffers.values())
    _mutate(model, opt)
    ck.wait()
    staging.torch.empty = real_empty
    model2 = StandInModel(1, 0)
    opt2 = DistributedOptimizer(model2.named_parameters(), cfg, mesh)
    got = CheckpointManager(run_dir, mesh, cfg).maybe_resume([model2], opt2, {"consumed_samples": 0})
    loaded = [t.numpy() for t in _snapshot(model2, opt2)]
    mesh.destroy()
    return all_pinned, got, loaded, [t.numpy() for t in expected]


def test_async_save_over_pinned_staging_buffers_resumes_bit_exact(tmp_path):
    """On a GPU the staging buffers are pinned (HostStager.prepare), and every async save raised in
    ShardedTensor while layout.to_state_dict declared them unpinned."""
    all_pinned, got, loaded, expected = run_distributed(_pinned_staging_save_and_resume, 1, args=(str(tmp_path),))[0]
    assert all_pinned and got == (1, 8)
    for a, b in zip(loaded, expected):
        assert np.array_equal(a, b)
