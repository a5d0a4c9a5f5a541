"""Checkpoint stand-ins shared by the checkpoint tests: a hand-made tp-sharded model whose every tensor is a known
function of (name, position) (tests/engine/test_checkpoint_reshard.py checks resharding with it), one-process
save/resume helpers on it (tests/training/test_checkpoint_storage.py, test_checkpoint_safety.py,
test_checkpoint_hostile_files.py), and the classic pickle payload and a manifest re-sealer for the trust tests."""

from __future__ import annotations

import json
import os

import torch

from training.checkpoint import CheckpointManager, storage
from training.contract.config import Config
from training.optim import DistributedOptimizer
from training.parallel.mesh import ProcessMesh

V, H, F = 11, 4, 8
# name -> (global shape before vocab padding, tp_shard_dim)
PARAMS = {
    "embedding.word.weight": ((V, H), 0),
    "layers.0.fc1.weight": ((F, H), 0),
    "layers.0.fc1.bias": ((F,), 0),
    "layers.0.fc2.weight": ((H, F), 1),
    "layers.0.norm.weight": ((H,), None),
}


def global_value(name: str, kind: str) -> torch.Tensor:
    shape, _ = PARAMS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name + kind)))
    return torch.randn(shape, generator=g)


def local_slice(full: torch.Tensor, name: str, tp: int, tp_rank: int) -> torch.Tensor:
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
            p = torch.nn.Parameter(torch.zeros_like(local_slice(global_value(name, "w"), name, tp, tp_rank)))
            p.tp_shard_dim = PARAMS[name][1]
            shape = list(PARAMS[name][0])
            if name == "embedding.word.weight":
                shape[0] = -(-V // tp) * tp
            p.global_shape = tuple(shape)
            self.ps.append(p)

    def named_parameters(self, *a, **k):
        return list(zip(self.names, self.ps))


def stand_in_cfg(tp, dp, zero) -> Config:
    cfg = Config()
    cfg.model.vocab_size = V
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.zero = tp, dp, zero
    cfg.train.keep_last = 2
    return cfg


def stand_in_mesh(tp, dp):
    """The real mesh for a tp x dp layout; one process without a spawned job gets the single mesh.

    Inside one spawned world every call creates a new set of groups (the process group itself is
    initialised once), so one world can load several layouts in turn.
    """
    if tp * dp == 1:
        return ProcessMesh.single()
    return ProcessMesh.from_env(tp=tp, pp=1, cp=1, dp=dp, backend="gloo", timeout_s=120)


def build(tp, dp, zero):
    mesh = stand_in_mesh(tp, dp)
    cfg = stand_in_cfg(tp, dp, zero)
    model = StandInModel(tp, mesh.tp_rank)
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    return mesh, cfg, model, opt


def expected_flat(opt, kind, tp, tp_rank):
    """The optimizer's flat shard of state `kind` as the global functions say."""
    flat = torch.cat([local_slice(global_value(n, kind), n, tp, tp_rank).reshape(-1) for n in opt.names])
    flat = torch.cat([flat, torch.zeros(opt.shard_size * (opt.dp if opt.zero else 1) - flat.numel())])
    return flat[opt.shard_lo : opt.shard_lo + opt.shard_size]


def save_worker(run_dir, tp, dp, zero, destroy=True):
    mesh, cfg, model, opt = build(tp, dp, zero)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(local_slice(global_value(n, "w"), n, tp, mesh.tp_rank))
    opt.exp_avg.copy_(expected_flat(opt, "m", tp, mesh.tp_rank))
    opt.exp_avg_sq.copy_(expected_flat(opt, "v", tp, mesh.tp_rank))
    opt.step_count = 7
    ckpt = CheckpointManager(run_dir, mesh, cfg)
    ckpt.save(5, [model], opt, {"consumed_samples": 40, "note": "x"}, reason="test")
    if destroy:  # else the spawned world keeps its process group for more layouts
        mesh.destroy()


def load_check(run_dir, tp, dp, zero) -> ProcessMesh:
    mesh, cfg, model, opt = build(tp, dp, zero)
    extra = {"consumed_samples": 0}
    got = CheckpointManager(run_dir, mesh, cfg).maybe_resume([model], opt, extra)
    assert got == (5, 40) and extra["note"] == "x" and opt.step_count == 7
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), local_slice(global_value(n, "w"), n, tp, mesh.tp_rank)), n
    # Padding of the flat buffer is not a parameter: compare only real positions.
    real = [(s.shard_start, s.shard_end) for s in opt.segments]
    for buf, kind in ((opt.exp_avg, "m"), (opt.exp_avg_sq, "v")):
        want = expected_flat(opt, kind, tp, mesh.tp_rank)
        for a, b in real:
            assert torch.equal(buf[a:b], want[a:b]), (kind, a, b)
    return mesh


def load_worker(run_dir, layouts):
    for tp, dp, zero in layouts:  # one spawn for all world-4 layouts: process start-up dominates
        mesh = load_check(run_dir, tp, dp, zero)
    mesh.destroy()  # destroys the one process group, and with it every layout's groups


def setup_run(run_dir, **train):
    cfg = stand_in_cfg(1, 1, 0)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    model = StandInModel(1, 0)
    mesh = ProcessMesh.single()
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    return cfg, model, opt, CheckpointManager(run_dir, mesh, cfg)


def fill(model, opt, value):
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.fill_(value)
    opt.exp_avg.fill_(value + 0.5)
    opt.step_count = int(value)


def save_steps(run_dir, steps, **train):
    cfg, model, opt, ck = setup_run(run_dir, **train)
    for s in steps:
        fill(model, opt, float(s))
        ck.save(s, [model], opt, {"consumed_samples": 8 * s})
    ck.wait()
    return ck


def resumed_value(run_dir, **train):
    cfg, model, opt, ck = setup_run(run_dir, **train)
    got = ck.maybe_resume([model], opt, {"consumed_samples": 0})
    if got is None:
        return None
    value = next(iter(model.parameters())).flatten()[0].item()
    assert opt.exp_avg[0].item() == value + 0.5 and opt.step_count == int(value)
    return got[0], value


class RunsCommand:
    """Unpickles to os.system(cmd): the classic pickle payload."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def reseal(directory: str) -> None:
    """Rewrite the manifest to match the files as they are now (what an attacker with write access does)."""
    path = os.path.join(directory, storage.MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"] = storage.build_manifest(directory)
    storage.write_json_durable(path, manifest)
