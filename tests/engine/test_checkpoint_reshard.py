"""Checkpoint resharding with a hand-made tp-sharded model and the real DistributedOptimizer.

Every tensor's global value is a known function of (name, position), so after saving with one layout and
loading with another, each rank's local weights and Adam states must equal the slice that layout expects,
exactly; vocabulary padding rows (which depend on tp) must stay zero.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dist_harness import run_distributed
from training.checkpoint import CheckpointManager, storage
from training.config import Config
from training.mesh import ProcessMesh
from training.optim import DistributedOptimizer

V, H, F = 11, 4, 8
# name -> (global shape before vocab padding, tp_shard_dim)
PARAMS = {
    "embedding.word.weight": ((V, H), 0),
    "layers.0.fc1.weight": ((F, H), 0),
    "layers.0.fc1.bias": ((F,), 0),
    "layers.0.fc2.weight": ((H, F), 1),
    "layers.0.norm.weight": ((H,), None),
}


def _global(name: str, kind: str) -> torch.Tensor:
    shape, _ = PARAMS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name + kind)))
    return torch.randn(shape, generator=g)


def _local(full: torch.Tensor, name: str, tp: int, tp_rank: int) -> torch.Tensor:
    _, dim = PARAMS[name]
    if dim is None:
        return full.clone()
    if name == "embedding.word.weight":
        padded = -(-V // tp) * tp
        full = torch.cat([full, torch.zeros(padded - V, H)])
    return full.chunk(tp, dim)[tp_rank].clone()


class StandInModel(torch.nn.Module):
    def __init__(self, tp: int, tp_rank: int):
        super().__init__()
        self.names = list(PARAMS)
        self.ps = torch.nn.ParameterList()
        for name in self.names:
            p = torch.nn.Parameter(torch.zeros_like(_local(_global(name, "w"), name, tp, tp_rank)))
            p.tp_shard_dim = PARAMS[name][1]
            shape = list(PARAMS[name][0])
            if name == "embedding.word.weight":
                shape[0] = -(-V // tp) * tp
            p.global_shape = tuple(shape)
            self.ps.append(p)

    def named_parameters(self, *a, **k):
        return list(zip(self.names, self.ps))


def _cfg(tp, dp, zero) -> Config:
    cfg = Config()
    cfg.model.vocab_size = V
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.zero = tp, dp, zero
    cfg.train.keep_last = 2
    return cfg


def _mesh(tp, dp):
    """The real mesh for a tp x dp layout; one process without a spawned job gets the single mesh.

    Inside one spawned world every call creates a new set of groups (the process group itself is
    initialised once), so one world can load several layouts in turn.
    """
    if tp * dp == 1:
        return ProcessMesh.single()
    return ProcessMesh.from_env(tp=tp, pp=1, cp=1, dp=dp, backend="gloo", timeout_s=120)


def _build(tp, dp, zero):
    mesh = _mesh(tp, dp)
    cfg = _cfg(tp, dp, zero)
    model = StandInModel(tp, mesh.tp_rank)
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    return mesh, cfg, model, opt


def _expected_flat(opt, kind, tp, tp_rank):
    """The optimizer's flat shard of state `kind` as the global functions say."""
    flat = torch.cat([_local(_global(n, kind), n, tp, tp_rank).reshape(-1) for n in opt.names])
    flat = torch.cat([flat, torch.zeros(opt.shard_size * (opt.dp if opt.zero else 1) - flat.numel())])
    return flat[opt.shard_lo: opt.shard_lo + opt.shard_size]


def _save_worker(run_dir, tp, dp, zero):
    mesh, cfg, model, opt = _build(tp, dp, zero)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_local(_global(n, "w"), n, tp, mesh.tp_rank))
    opt.exp_avg.copy_(_expected_flat(opt, "m", tp, mesh.tp_rank))
    opt.exp_avg_sq.copy_(_expected_flat(opt, "v", tp, mesh.tp_rank))
    opt.step_count = 7
    ckpt = CheckpointManager(run_dir, mesh, cfg)
    ckpt.save(5, [model], opt, {"consumed_samples": 40, "note": "x"}, reason="test")
    mesh.destroy()


def _load_check(run_dir, tp, dp, zero) -> ProcessMesh:
    mesh, cfg, model, opt = _build(tp, dp, zero)
    extra = {"consumed_samples": 0}
    got = CheckpointManager(run_dir, mesh, cfg).maybe_resume([model], opt, extra)
    assert got == (5, 40) and extra["note"] == "x" and opt.step_count == 7
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), _local(_global(n, "w"), n, tp, mesh.tp_rank)), n
    # Padding of the flat buffer is not a parameter: compare only real positions.
    real = [(s.shard_start, s.shard_end) for s in opt.segments]
    for buf, kind in ((opt.exp_avg, "m"), (opt.exp_avg_sq, "v")):
        want = _expected_flat(opt, kind, tp, mesh.tp_rank)
        for a, b in real:
            assert torch.equal(buf[a:b], want[a:b]), (kind, a, b)
    return mesh


def _load_worker(run_dir, layouts):
    for tp, dp, zero in layouts:  # one spawn for all world-4 layouts: process start-up dominates
        mesh = _load_check(run_dir, tp, dp, zero)
    mesh.destroy()  # destroys the one process group, and with it every layout's groups


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    run_distributed(_save_worker, 4, args=(run_dir, 2, 2, 1), timeout_s=180)
    return run_dir


def test_saved_checkpoint_is_committed_and_verifies(saved):
    ck = storage.checkpoints_dir(saved)
    assert storage.read_latest(saved) == 5 and storage.list_steps(saved) == [5]
    assert storage.verify(storage.step_dir(saved, 5)).ok
    assert not [n for n in os.listdir(ck) if n.startswith(".tmp")]
    with open(os.path.join(storage.step_dir(saved, 5), storage.STATE)) as f:
        state = json.load(f)
    assert state["layout"]["tp"] == 2 and state["consumed_samples"] == 40


def test_load_single_process_tp1_zero0(saved):
    _load_check(saved, 1, 1, 0)


def test_load_other_layouts_tp4_dp4_zero0(saved):
    run_distributed(_load_worker, 4, args=(saved, [(4, 1, 1), (1, 4, 1), (2, 2, 0)]), timeout_s=300)
