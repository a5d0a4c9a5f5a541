"""The engine: layouts reproduce the single-process run; memory equals the plan.

A tiny GPT (2 layers, h=32) on the byte corpus, global batch 8 in micro-batches of 2. Every layout runs
the real Trainer (model, optimizer, data, loop) on gloo processes and is compared with the same Trainer
in one process.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed

from training.contract.config import Config, config_from_dict, config_to_dict

STEPS = 20


def _cfg(tp=1, dp=1, sp=False, zero=0, precision="fp32", recompute="none", steps=STEPS, micro_batch=2) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp, cfg.parallel.zero = tp, dp, sp, zero
    cfg.parallel.micro_batch, cfg.parallel.global_batch, cfg.parallel.recompute = micro_batch, 8, recompute
    cfg.parallel.bucket_mb = 0.01  # several buckets even for this tiny model
    cfg.cluster.gpus_per_node = tp * dp
    cfg.train.steps, cfg.train.precision, cfg.train.warmup_steps = steps, precision, 3
    cfg.train.progress = False
    cfg.data.kind, cfg.data.max_bytes = "text", 60_000
    return cfg


def _full_grads(trainer, mesh, sp) -> dict:
    """Every parameter's dp-reduced grad, gathered over tp into its full (global) shape."""
    opt = trainer.optimizer
    out = {}
    for name, p, view in zip(opt.names, opt.params, opt.grads.views):
        g = view.detach().float().clone()
        if getattr(p, "sequence_parallel", False) and sp and mesh.tp > 1:
            dist.all_reduce(g, group=mesh.tp_group)
        if mesh.dp > 1:
            dist.all_reduce(g, group=mesh.dp_group)
            g /= mesh.dp
        dim = getattr(p, "tp_shard_dim", None)
        if dim is not None and mesh.tp > 1:
            parts = [torch.empty_like(g) for _ in range(mesh.tp)]
            dist.all_gather(parts, g, group=mesh.tp_group)
            g = torch.cat(parts, dim=dim)
        out[name] = g.numpy()  # numpy, not torch: tensors cannot outlive the rank through the result queue
    return out


def saved_activation_bytes(trainer) -> int:
    """Bytes autograd saves for backward in one micro-batch's forward (parameters excluded, each tensor once)."""
    from training.observe.saved_bytes import saved_activation_bytes as measure

    modes = [c.training for c in trainer.chunks]
    total = measure(trainer)
    for c, mode in zip(trainer.chunks, modes):
        c.micro_step = 0
        c.train(mode)
    return total


def _train(cfg_dict: dict, run_dir: str, mesh, with_grads: bool = True):
    """One layout: grads of step 1 (before any update), then the whole run from scratch."""
    from training.run.loop import Trainer

    cfg = config_from_dict(cfg_dict)
    p = cfg.parallel
    trainer = Trainer(cfg, run_dir, mesh, checkpointing=False)
    grads = None
    activations = saved_activation_bytes(trainer)
    if with_grads:
        trainer.optimizer.zero_grad()
        trainer.schedule.forward_backward(trainer.sampler.micro_batches(0))
        grads = _full_grads(trainer, mesh, p.sp)
        trainer.optimizer.zero_grad()
        for c in trainer.chunks:
            c.micro_step = 0  # the dropout key sequence starts over
    trainer.run()
    result = {
        "losses": trainer.losses,
        "memory": trainer.optimizer.memory_report(),
        "grads": grads,
        "activations": activations,
    }
    return result if mesh.rank == 0 else {"memory": result["memory"], "activations": activations}


_REFERENCE = {}


def _reference(precision="fp32", recompute="none", steps=STEPS, with_grads=True, micro_batch=2):
    """The same Trainer in this (pytest's) process, once per configuration and module."""
    from training.parallel.mesh import ProcessMesh

    key = (precision, recompute, steps, with_grads, micro_batch)
    if key not in _REFERENCE:
        torch.set_num_threads(1)
        cfg = _cfg(precision=precision, recompute=recompute, steps=steps, micro_batch=micro_batch)
        _REFERENCE[key] = _train(config_to_dict(cfg), tempfile.mkdtemp(), ProcessMesh.single(), with_grads)
    return _REFERENCE[key]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# Micro-batches per rank: 2 (tp2 layouts: gradient accumulation) and 2 (tp4, micro_batch 4).
LAYOUTS = {
    "tp2_sp_dp2_zero1": dict(tp=2, dp=2, sp=True, zero=1),
    "tp2_dp2": dict(tp=2, dp=2),
    "tp4": dict(tp=4, micro_batch=4),
}
# The bf16 case: tp2 sp dp2 zero1, 10 steps in micro-batches of 4.
BF16 = dict(tp=2, dp=2, sp=True, zero=1, precision="bf16", steps=10, micro_batch=4)


def _four_ranks(base: str) -> dict:
    """Every 4-rank case in one spawn: each mesh's groups are built beside the previous one's (the default group
    stays, nothing is torn down between them)."""
    from training.parallel.mesh import ProcessMesh

    cases = {name: (_cfg(**kw), True) for name, kw in LAYOUTS.items()}
    cases["bf16"] = (_cfg(**BF16), False)
    out, mesh = {}, None
    for name, (cfg, with_grads) in cases.items():
        p = cfg.parallel
        mesh = ProcessMesh.from_env(p.tp, p.pp, p.cp, p.dp)
        out[name] = _train(config_to_dict(cfg), os.path.join(base, name), mesh, with_grads)
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_distributed(_four_ranks, 4, args=(str(tmp_path_factory.mktemp("engine")),), timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_reproduces_single_process(four, layout):
    from launcher.plan.estimate import make_plan

    ref = _reference()
    cfg = _cfg(**LAYOUTS[layout])
    results = [r[layout] for r in four]
    got = results[0]
    assert len(got["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must actually train"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert _rel(a, b) < 1e-5, f"step {step + 1}: loss {a} vs single-process {b}"
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in got["grads"].items():
        g, r = torch.from_numpy(g), torch.from_numpy(ref["grads"][name])
        assert g.shape == r.shape, name
        err = float((g - r).norm() / r.norm().clamp_min(1e-12))
        assert err < 1e-5, f"grad of {name} differs by {err:.2e} (relative norm)"
    # Model-state memory of every rank equals plan.json's numbers exactly.
    plan = make_plan(cfg).memory_bytes
    for rank, res in enumerate(results):
        assert res["memory"] == {k: plan[k] for k in ("weights", "grads", "optimizer")}, rank
        # Activation bytes saved for backward (saved-tensor hooks) within 10 % of the plan.
        assert abs(res["activations"] - plan["activations"]) <= 0.10 * plan["activations"], (
            rank,
            res["activations"],
            plan["activations"],
        )


@pytest.mark.slow
def test_sp_stores_less_activation_than_tp_alone(four):
    assert four[0]["tp2_sp_dp2_zero1"]["activations"] < four[0]["tp2_dp2"]["activations"], (
        "TP+SP must store less than TP alone"
    )


@pytest.mark.slow
def test_bf16_layout_matches_bf16_single_process_and_tracks_fp32(four):
    """bf16 makes two claims, with two tolerances.

    1. The layout only changes where bf16 partial sums are rounded (TP all-reduces of partial outputs,
       the batch split over dp; grads and masters stay fp32), so tp2 sp dp2 zero1 in bf16 stays within
       1e-3 of the one-process bf16 run (measured: 1e-4 after 10 steps).
    2. Against fp32: each op rounds at 2^-9 relative, so the first steps agree to about 1e-3; after that
       the bf16 weights (rounded from the fp32 masters every step) take a slightly different path and the
       two trajectories drift apart as the model learns: after 10 steps at lr 3e-3 by a few percent
       (measured 3.4 %), bounded here by 6 %. fp32 masters and main grads keep the drift from compounding
       in the weights themselves; the loss must still fall.
    """
    ref = _reference()
    got = four[0]["bf16"]["losses"]
    single = _reference(precision="bf16", steps=10, with_grads=False, micro_batch=4)["losses"]
    assert max(_rel(a, b) for a, b in zip(got, single)) < 1e-3, (got, single)
    assert max(_rel(a, b) for a, b in zip(got[:5], ref["losses"][:5])) < 2e-3, (got, ref["losses"])
    assert max(_rel(a, b) for a, b in zip(got, ref["losses"])) < 6e-2, (got, ref["losses"])
    assert got[-1] < got[0] - 0.5


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_losses(recompute):
    base = _reference(steps=5, with_grads=False)
    got = _reference(recompute=recompute, steps=5, with_grads=False)
    for a, b in zip(got["losses"], base["losses"]):
        assert _rel(a, b) < 1e-6, (a, b)
