"""Mixture of experts in the engine (training/model/moe.py, parallel.ep): layouts reproduce one process; checkpoints.

A tiny MoE GPT (2 layers, h=32, 4 swiglu experts of width 32, top-2, dropless, aux loss on) trains with the
real Trainer in one process (the reference, in this pytest process) and on 4 gloo ranks in ONE spawn that
runs every multi-process case in turn:
- ep2 x dp4 (zero=1: expert optimizer state sharded over the expert-dp group of 2), ep2 x tp2 (sp, zero=1),
  ep2 x pp2 (1f1b, full recompute, zero=2), ep4 x dp4 (gelu experts, capacity factor 1 with tokens dropped,
  zero=2): every step's loss, global grad norm and every parameter's reduced
  gradient (assembled over tp / pp / ep / ZeRO shards) equal the reference's within 1e-5;
- bit-exact resume at ep2 x dp4 (a run stopped at step 2 and resumed gives the continuous run's losses
  exactly), and the same step-2 checkpoint resumed at ep1 x dp4: weights and Adam moments, assembled by name,
  equal the saved ones exactly and the losses go on within 1e-5; resumed at tp2 x dp2 x ep2 (sp) too;
- bf16 at ep2 x dp4 tracks the single-process bf16 run;
- each case's memory_report() against its stage's plan.json memory_bytes, the expert optimizer state sharded
  over the expert-dp group.
In-process: capacity drops counted and the dropped assignments contribute nothing; MoE metrics rows; layout
rules refuse what the engine cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from helpers.dist import run_distributed

from training.contract.config import Config, config_from_dict, config_to_dict

STEPS = 3
TOL = 1e-5


def _cfg(
    tp=1, pp=1, dp=1, ep=1, zero=0, steps=STEPS, precision="fp32", recompute="none", checkpoint_every=0, **model
) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size, m.activation = 4, 2, 32, "swiglu"
    for k, v in model.items():
        setattr(m, k, v)
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.ep, p.sp, p.zero, p.recompute = tp, pp, dp, ep, tp > 1, zero, recompute
    p.micro_batch, p.global_batch, p.bucket_mb = 2, 8, 0.01  # several grad buckets even for this model
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * dp, 1.0  # a fixed peak: no matmul timing
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.precision, t.dist_timeout_s = steps, 1, False, precision, 60
    t.checkpoint_every = checkpoint_every
    t.grad_clip = 0.0  # the grads stay as reduced (clipping scales them in place); the norm is still compared
    t.lr, t.min_lr = 1e-3, 1e-4
    t.keep_last, t.log_every, t.tensorboard = 3, 100, False  # no per-step metrics collectives in the spawn
    cfg.data.kind = "synthetic"
    return cfg


def _full_grads(opt, mesh) -> dict[str, np.ndarray]:
    """Every parameter's reduced grad on this rank (dense and expert parts), gathered over ZeRO and tp."""
    import torch.distributed as dist

    from training.parallel.collectives import all_gather_single

    out = {}
    for o in (opt, opt.experts):
        if o is None:
            continue
        lay = o.layout
        shard = o.grads.shard().detach().float().contiguous()
        full = shard
        if lay.zero >= 1 and lay.dp > 1:
            full = torch.empty(lay.dp * shard.numel())
            all_gather_single(full, shard, group=o.dp_group)
        for name, p, off in zip(lay.names, lay.params, lay.offsets):
            g = full[off : off + p.numel()].view(p.shape)
            dim = getattr(p, "tp_shard_dim", None)
            if dim is not None and mesh.tp > 1:
                parts = [torch.empty_like(g) for _ in range(mesh.tp)]
                dist.all_gather(parts, g.contiguous(), group=mesh.tp_group)
                g = torch.cat(parts, dim)
            out[name] = g.numpy().copy()
    return out


def _named_state(trainer) -> dict[str, dict[str, Any]]:
    """This rank's weights and optimizer-state pieces by parameter name (tp = 1: local = global)."""
    out: dict[str, dict[str, Any]] = {}
    for shard in trainer.optimizer.state_dict()["params"]:
        entry = out.setdefault(shard.name, {"weight": shard.param.detach().float().numpy().copy(), "pieces": []})
        entry["pieces"].append(
            (shard.param_start, {k: v.detach().float().numpy().copy() for k, v in shard.tensors.items()})
        )
    return out


def _train(cfg: Config, run_dir: str, mesh, grads: bool = False, capture_resume: bool = False) -> dict[str, Any]:
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh, checkpointing=capture_resume or cfg.train.checkpoint_every > 0)
    saved: dict[str, Any] = {}
    per_step: list[dict[str, np.ndarray]] = []
    norms: list[float] = []
    opt = trainer.optimizer
    real_step = opt.step

    def step(lr, loss_finite=True, defer_param_gather=False):
        res = real_step(lr, loss_finite, defer_param_gather)
        norms.append(res.grad_norm)
        if grads:
            per_step.append(_full_grads(opt, mesh))
        if cfg.train.checkpoint_every and opt.step_count == cfg.train.checkpoint_every:
            saved["state"] = _named_state(trainer)  # what the checkpoint of this step holds
        return res

    opt.step = step
    resumed: dict[str, Any] = {}
    if capture_resume:
        real = trainer._resume

        def _resume():
            real()
            resumed["state"] = _named_state(trainer)

        trainer._resume = _resume
    trainer.run()
    return {
        "losses": list(trainer.losses),
        "norms": norms,
        "grads": per_step,
        "resumed": resumed,
        "saved": saved.get("state"),
        "memory": opt.memory_report(),
        "expert_memory": opt.experts.memory_report() if opt.experts is not None else None,
        "stage": mesh.pp_rank,
        "edp": mesh.dp // mesh.ep,
    }


def _four_ranks(base: str, cases: dict[str, dict]) -> dict[str, Any]:
    """Every 4-rank case in one spawn: the equivalence layouts, then resumes of ep2_dp4's step-2 checkpoint."""
    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh

    out: dict[str, Any] = {}
    for name, cfg_dict in cases.items():
        cfg = config_from_dict(cfg_dict)
        p = cfg.parallel
        mesh = ProcessMesh.from_env(p.tp, p.pp, p.cp, p.dp, timeout_s=60, ep=p.ep)
        out[name] = _train(cfg, os.path.join(base, name), mesh, grads=cfg.train.precision == "fp32")
    # ep2_dp4 saved step 2 (checkpoint_every=2): resume it at ep2 (bit-exact) and, from a copy, at ep1 x dp4.
    src = os.path.join(base, "ep2_dp4")
    if dist.get_rank() == 0:
        for copy in ("resume_ep2", "resume_ep1", "resume_tp2_dp2"):
            shutil.copytree(src, os.path.join(base, copy))
    dist.barrier()
    for name, ep, tp in (("resume_ep2", 2, 1), ("resume_ep1", 1, 1), ("resume_tp2_dp2", 2, 2)):
        cfg = config_from_dict(cases["ep2_dp4"])
        cfg.parallel.ep, cfg.train.resume, cfg.train.checkpoint_every = ep, "2", 0
        cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp = tp, 4 // tp, tp > 1
        mesh = ProcessMesh.from_env(tp, 1, 1, 4 // tp, timeout_s=60, ep=ep)
        out[name] = _train(cfg, os.path.join(base, name), mesh, capture_resume=True)
    mesh.destroy()
    return out


def _assemble(rank_states: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, np.ndarray]]:
    """Full weights and optimizer states by name from every rank's pieces; each element covered exactly."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for states in rank_states:
        for name, entry in states.items():
            full = out.setdefault(name, {"weight": entry["weight"].reshape(-1)})
            np.testing.assert_array_equal(full["weight"], entry["weight"].reshape(-1), err_msg=name)
            for start, tensors in entry["pieces"]:
                for k, v in tensors.items():
                    arr = full.setdefault(k, np.full(full["weight"].size, np.nan, dtype=np.float32))
                    arr[start : start + v.size] = v
    for name, full in out.items():
        for k, arr in full.items():
            assert not np.isnan(arr).any(), f"{name} {k}: not every element assembled"
    return out


def _reference(precision="fp32", steps=STEPS, **model) -> dict[str, Any]:
    from training.parallel.mesh import ProcessMesh

    torch.set_num_threads(1)
    return _train(
        _cfg(precision=precision, steps=steps, **model),
        tempfile.mkdtemp(),
        ProcessMesh.single(),
        grads=precision == "fp32",
    )


def _compare(name: str, got: dict[str, Any], ref: dict[str, Any], vocab: int) -> None:
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=TOL, atol=0, err_msg=f"{name}: losses")
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=TOL, atol=0, err_msg=f"{name}: grad norms")
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        for pname, value in g.items():
            expect = r[pname]
            value = value[: expect.shape[0]] if value.shape != expect.shape else value  # tp vocabulary padding
            # Relative to the parameter's grad norm: from step 2 on, AdamW moves each weight by about lr whatever
            # the size of its grad, so fp32 rounding in grads near 0 (the keys' at init) moves single elements.
            err = float(np.linalg.norm(value - expect)) / max(float(np.linalg.norm(expect)), 1e-12)
            assert err < TOL, f"{name} step {step + 1} {pname}: relative error {err:.2e}"
            if step == 0:  # before any update: element by element, against the largest element
                err = float(np.abs(value - expect).max()) / max(float(np.abs(expect).max()), 1e-12)
                assert err < TOL, f"{name} step 1 {pname}: max error {err:.2e} of the largest element"
    assert len(got["grads"]) == len(ref["grads"]) == STEPS


CASES = {
    "ep2_dp4": dict(dp=4, ep=2, zero=1, checkpoint_every=2),
    "ep2_tp2_sp": dict(tp=2, dp=2, ep=2, zero=1),
    "ep2_pp2": dict(pp=2, dp=2, ep=2, zero=2, recompute="full"),
    # Capacity drops are decided on each source rank's own tokens, as in one process; gelu experts; edp = 1.
    "ep4_dp4_gelu_capacity": dict(dp=4, ep=4, zero=2, activation="gelu", moe_capacity_factor=1.0),
    "ep2_dp4_bf16": dict(dp=4, ep=2, zero=1, precision="bf16", steps=2),
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("moe"))
    cases = {name: config_to_dict(_cfg(**kw)) for name, kw in CASES.items()}
    return run_distributed(_four_ranks, 4, args=(base, cases), timeout_s=400)


_REFERENCES: dict[str, Any] = {}


def _reference_of(case: str) -> dict[str, Any]:
    model = {k: v for k, v in CASES[case].items() if k in ("activation", "moe_capacity_factor")}
    key = repr(sorted(model.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(**model)
    return _REFERENCES[key]


@pytest.mark.parametrize("case", ["ep2_dp4", "ep2_tp2_sp", "ep2_pp2", "ep4_dp4_gelu_capacity"])
def test_expert_parallel_layout_reproduces_single_process(four_ranks, case):
    reference = _reference_of(case)
    vocab = Config().model.vocab_size
    names = set()
    for rank, result in enumerate(four_ranks):
        _compare(f"{case} rank {rank}", result[case], reference, vocab)
        names |= set(result[case]["grads"][0])
    # Every parameter of the model (router, each expert, dense parts) was held and checked by some rank.
    assert names == set(reference["grads"][0])
    assert any(".mlp.experts.3.fc1.weight" in n for n in names) and any(".mlp.router.weight" in n for n in names)


@pytest.mark.parametrize(
    "case",
    [
        "ep2_dp4",
        "ep2_tp2_sp",  # every tp rank keeps each expert's fc2 bias whole, as plan.json counts it
        "ep2_pp2",
        "ep4_dp4_gelu_capacity",
        "ep2_dp4_bf16",
    ],
)
def test_memory_report_at_ep_is_plan_json(four_ranks, case):
    """Each rank's optimizer.memory_report() (weights, main grads, optimizer state: dense and expert together)
    equals its stage's plan.json memory_bytes at ep > 1, and the expert optimizer state is this rank's experts'
    Adam state sharded over the expert-dp group (dp / ep ranks), not over dp."""
    from launcher.plan.estimate import make_plan

    plan = make_plan(config_from_dict(config_to_dict(_cfg(**CASES[case]))))
    for rank, r in enumerate(four_ranks):
        got = r[case]
        experts, edp = got["expert_memory"], got["edp"]
        assert experts["weights"] > 0 and edp == CASES[case]["dp"] // CASES[case]["ep"], (rank, edp)
        # Adam's two fp32 moments (plus the fp32 masters when the weights are bf16) of this rank's expert
        # parameters, divided over the edp ranks (up to the shard padding).
        per_param = 12 if "bf16" in case else 8
        n = experts["weights"] // (2 if "bf16" in case else 4)
        assert abs(experts["optimizer"] * edp - n * per_param) <= edp * 64 * per_param, (rank, experts, edp)
        expected = plan.stages[got["stage"]].memory_bytes
        assert got["memory"] == {k: expected[k] for k in ("weights", "grads", "optimizer")}, (rank, got["memory"])


def test_ep_ranks_hold_their_experts_only(four_ranks):
    # dp4 ep2: ep rank 0 (dp ranks 0, 2) holds experts 0-1, ep rank 1 (dp ranks 1, 3) experts 2-3.
    for rank, result in enumerate(four_ranks):
        experts = {int(n.split(".")[4]) for n in result["ep2_dp4"]["grads"][0] if ".experts." in n}
        assert experts == ({0, 1} if rank % 2 == 0 else {2, 3}), (rank, experts)


def test_bf16_expert_parallel_tracks_single_process_bf16(four_ranks):
    ref = _reference(precision="bf16", steps=2)
    got = four_ranks[0]["ep2_dp4_bf16"]["losses"]
    assert all(np.isfinite(got))
    np.testing.assert_allclose(got, ref["losses"], rtol=2e-2)


def test_resume_at_ep2_is_bit_exact_and_at_ep1_loads_the_same_state(four_ranks):
    cont = four_ranks[0]["ep2_dp4"]["losses"]
    ep2, ep1 = (four_ranks[0][k] for k in ("resume_ep2", "resume_ep1"))
    assert len(ep2["losses"]) == STEPS - 2
    assert ep2["losses"] == cont[2:], "resumed at the same layout: bit-exact"
    saved = _assemble([r["ep2_dp4"]["saved"] for r in four_ranks])
    for key in ("resume_ep2", "resume_ep1"):
        loaded = _assemble([r[key]["resumed"]["state"] for r in four_ranks])
        assert set(loaded) == set(saved)
        for name, full in saved.items():
            assert set(loaded[name]) == set(full), (key, name)
            for k, arr in full.items():
                np.testing.assert_array_equal(loaded[name][k], arr, err_msg=f"{key}: {name} {k}")
    np.testing.assert_allclose(ep1["losses"], cont[2:], rtol=TOL, atol=0)
    # dp and tp changed too (dp4 -> tp2 x dp2, sp): experts resharded over tp; the next step's loss and norm.
    other = four_ranks[0]["resume_tp2_dp2"]
    np.testing.assert_allclose(other["losses"], cont[2:], rtol=TOL, atol=0)
    np.testing.assert_allclose(other["norms"], four_ranks[0]["ep2_dp4"]["norms"][2:], rtol=TOL, atol=0)


# ----- in-process -------------------------------------------------------------------------------------
def test_capacity_drops_are_counted_and_contribute_nothing():
    from training.model.moe import MoEMLP
    from training.parallel.mesh import ProcessMesh

    torch.manual_seed(0)
    cfg = _cfg(moe_capacity_factor=0.5)
    moe = MoEMLP(cfg.model, ProcessMesh.single(), False, torch.float32, "cpu")
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.train()
    x = torch.randn(2, 16, 32)
    out = moe(x).reshape(-1, 32)
    tokens = x.reshape(-1, 32)
    # By hand: route, keep each expert's first ceil(0.5 x 32 x 2 / 4) = 8 assignments in token order.
    probs = torch.softmax(tokens @ moe.router.weight.t(), -1)
    top, chosen = probs.topk(2, -1)
    gates = top / top.sum(-1, keepdim=True)
    seen = [0] * 4
    expect = torch.zeros_like(tokens)
    dropped = 0
    for t in range(tokens.shape[0]):
        for j in range(2):
            e = int(chosen[t, j])
            seen[e] += 1
            if seen[e] > 8:
                dropped += 1
                continue
            expert = moe.experts[str(e)]
            expect[t] += gates[t, j] * (expert.partial(tokens[t : t + 1], True, "none")[0] + expert.fc2.bias)
    assert dropped > 0 and moe.stats.dropped == dropped
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    assert float(moe.stats.tokens.sum()) == 64


def test_metrics_rows_and_load_event(tmp_path):
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    # Full recompute replays each layer's forward in backward (torch may stop the replay once it has the saved
    # tensors back): the routing is counted once either way.
    cfg = _cfg(steps=2, moe_capacity_factor=1.0, recompute="full")
    cfg.train.log_every = 1
    Trainer(cfg, str(tmp_path), ProcessMesh.single(), checkpointing=False).run()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl") if '"moe_load"' in line]
    assert len(events) == 2
    for row, event in zip(rows, events):
        assert row["moe_aux_loss"] > 0 and isinstance(row["moe_dropped_tokens"], int)
        # max/mean over the counted assignments, worked out here from the event's table: 1 (balanced) up to
        # E / k = 2 (every token's two choices on the same two experts), the largest layer's.
        loads = [max(r) / (sum(r) / len(r)) for r in event["tokens_per_expert"]]
        assert row["moe_max_load"] == pytest.approx(max(loads), rel=1e-9) and 1.0 <= max(loads) <= 4 / 2
        # Capacity 1.0 applies per micro-batch (each expert keeps its even share of that micro-batch's
        # assignments): at least what exceeds the step's even share (8 x 16 x 2 / 4 = 64 per layer and expert)
        # is dropped, and at most all but one expert's share (every assignment on one expert) of the 2 layers'.
        over = sum(max(0, t - 64) for r in event["tokens_per_expert"] for t in r)
        dropped = row["moe_dropped_tokens"]
        assert 0 < over <= dropped <= (1 - 1 / 4) * 2 * 8 * 16 * 2, (dropped, event["tokens_per_expert"])
    tokens = events[0]["tokens_per_expert"]
    # 8 samples x 16 tokens x top-2 per layer, over 2 layers and 4 experts.
    assert len(tokens) == 2 and all(len(row) == 4 and sum(row) == 8 * 16 * 2 for row in tokens)
    assert max(events[0]["max_load"]) == pytest.approx(rows[0]["moe_max_load"], rel=1e-3)


def test_layout_rules_refuse_what_the_engine_cannot_run():
    from training.contract.layout_rules import LayoutError, layout_violations, raise_errors

    def errors(dp, **kw):
        cfg = _cfg(
            **{k: v for k, v in kw.items() if k in ("tp", "pp", "ep", "zero")},
            **{k: v for k, v in kw.items() if k not in ("tp", "pp", "ep", "zero", "cp")},
        )
        cfg.parallel.cp = kw.get("cp", 1)
        return {v.code for v in layout_violations(cfg, dp) if v.level == "error"}

    assert errors(4, ep=2) == set()
    assert "ep_dp" in errors(3, ep=2)
    assert "ep_experts" in errors(4, ep=4, num_experts=6)
    assert "moe_top_k" in errors(1, moe_top_k=5)
    assert "moe_zero3" in errors(2, zero=3)
    assert "moe_cp" in errors(1, cp=2)
    cfg = _cfg(ep=2)
    cfg.model.num_experts = 0
    with pytest.raises(LayoutError, match="parallel.ep=1"):
        raise_errors(layout_violations(cfg, 2))


def test_aux_loss_is_transformers_mixtral_balance_loss_over_top_k(tmp_path):
    """moe_aux_loss against an independent formula (tests audit §6.3): transformers' Mixtral
    load_balancing_loss_func on each layer's router logits is E x sum_e (assignments to e / T) x P_e, k at perfect
    balance; the contract's per-layer loss is normalised to 1 there (E/k x sum_e f_e P_e with f_e over the T x k
    assignments), so each layer's term is transformers' / k, times model.moe_aux_loss_coeff, summed over layers
    and averaged over the step's micro-batches."""
    import torch.nn.functional as F
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    cfg = _cfg(steps=1, moe_aux_loss_coeff=0.3)
    cfg.train.log_every = 1
    trainer = Trainer(cfg, str(tmp_path), ProcessMesh.single(), checkpointing=False)
    E, k = cfg.model.num_experts, cfg.model.moe_top_k
    terms: list[float] = []

    def capture(module, args):
        x = args[0]
        logits = F.linear(x.reshape(-1, x.shape[-1]).detach(), module.router.weight.detach()).float()
        terms.append(float(load_balancing_loss_func((logits,), E, k)) / k * cfg.model.moe_aux_loss_coeff)

    layers = [m for c in trainer.chunks for m in c.modules() if hasattr(m, "router") and hasattr(m, "_route")]
    assert len(layers) == cfg.model.num_layers
    for m in layers:
        m.register_forward_pre_hook(capture)
    trainer.run()
    (row,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    micro_batches = cfg.parallel.global_batch // cfg.parallel.micro_batch
    assert len(terms) == micro_batches * cfg.model.num_layers
    expected = sum(terms) / micro_batches
    assert row["moe_aux_loss"] == pytest.approx(expected, rel=1e-5), (row["moe_aux_loss"], expected)
