"""Context parallelism in the engine (training/parallel/context.py): every cp layout reproduces one process.

The real Trainer (model, optimizer, data, loop) on gloo ranks against the same Trainer in one process, on the
GPT (learned positions, LayerNorm, GELU, tied embeddings) and the Llama-style model (RoPE, grouped-query
attention with 2 key/value groups for 4 heads, SwiGLU, RMSNorm, untied): fp32, the grads of the first step
(reduced over dp x cp, assembled over tp) and every step's loss within 1e-5 relative.

Layouts: cp2 (ring, and the all_gather variant), cp4, cp2 x tp2 with sp, cp2 x pp2 (1f1b and interleaved with
2 virtual stages), cp2 x dp2 with the distributed optimizer (zero=1, sharded over dp x cp). Also: a cp2 run
stopped and resumed is bit-exact; a cp2 checkpoint resumed at cp1 and exported to Hugging Face equals the
model trained at cp1 throughout; a cp1 checkpoint resumed at cp2 matches cp1 throughout, and its export straight
from the checkpoint cp2 wrote equals the cp1 model's. One spawn per world size runs all of its cases.
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
MODELS = ("gpt", "llama")
# The cp2 -> cp1 runs: cp2 and cp1 grads differ by float rounding (1e-9 here), which Adam's normalised update
# turns into weight differences proportional to the learning rate; at 3e-4 (a pretraining rate, a tenth of the
# default) four steps stay well inside the 1e-6 the export is held to.
RESHARD = dict(steps=4, lr=3e-4, min_lr=3e-5)


def _cfg(model: str, tp=1, pp=1, vpp=1, cp=1, dp=1, schedule="1f1b", zero=None, steps=STEPS, **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.dropout = 4, 32, 4, 16, 0.0
    if model == "llama":
        m.num_query_groups, m.ffn_hidden_size = 2, 64
        m.norm, m.activation, m.position, m.tie_embeddings, m.bias = "rmsnorm", "swiglu", "rope", False, False
    p = cfg.parallel
    p.tp, p.pp, p.vpp, p.cp, p.dp, p.sp, p.schedule = tp, pp, vpp, cp, dp, tp > 1, schedule
    p.zero = (1 if dp > 1 else 0) if zero is None else zero
    p.micro_batch, p.global_batch, p.bucket_mb = 1, 4, 0.01
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * cp * dp, 1.0  # a fixed peak: no matmul timing
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.precision, t.dist_timeout_s = steps, 1, False, "fp32", 60
    for k, v in train.items():
        setattr(t, k, v)
    cfg.data.kind = "synthetic"
    return cfg


def _with_eval(cfg: Config) -> Config:
    """Held-out evaluation after the last step (forward only, on every rank)."""
    cfg.train.eval_every, cfg.train.eval_iters = STEPS, 1
    return cfg


def _bf16(cfg: Config) -> Config:
    cfg.train.precision = "bf16"
    return cfg


def _full_grads(trainer) -> dict[str, np.ndarray]:
    """Every parameter's grad of the step's mean loss: model-parallel finalised, averaged over dp x cp, tp-assembled."""
    import torch.distributed as dist

    opt, mesh = trainer.optimizer, trainer.mesh
    opt.grads.settle()
    opt.finalize_grads(opt.grads.views)
    out = {}
    for name, p, view in zip(opt.names, opt.params, opt.grads.views):
        g = view.detach().float().clone()
        if mesh.dp * mesh.cp > 1:
            dist.all_reduce(g, group=mesh.dp_cp_group)
            g /= mesh.dp * mesh.cp
        dim = getattr(p, "tp_shard_dim", None)
        if dim is not None and mesh.tp > 1:
            parts = [torch.empty_like(g) for _ in range(mesh.tp)]
            dist.all_gather(parts, g, group=mesh.tp_group)
            g = torch.cat(parts, dim=dim)
        out[name] = g.numpy()
    return out


def _run(cfg: Config, run_dir: str, mesh, checkpointing: bool = False, grads: bool = True) -> dict[str, Any]:
    """Grads of step 1 (before any update), then the whole run from scratch."""
    from training.run.loop import Trainer

    trainer = Trainer(config_from_dict(config_to_dict(cfg)), run_dir, mesh, checkpointing=checkpointing)
    g = None
    if grads:
        trainer.optimizer.zero_grad()
        trainer.schedule.forward_backward(trainer.sampler.micro_batches(0))
        g = _full_grads(trainer)
        trainer.optimizer.zero_grad()
    code = trainer.run()
    return {"code": code, "losses": list(trainer.losses), "grads": g, "eval": list(trainer.eval_losses)}


MEMORY_SEQ = 256


def _memory_cfg(model: str, cp: int) -> Config:
    cfg = _cfg(model, cp=cp)
    cfg.model.seq_length = MEMORY_SEQ
    return cfg


def _saved_activation_bytes(cfg: Config, mesh) -> dict[str, int]:
    """Bytes autograd saves for backward in one micro-batch's forward on this rank (saved-tensor hooks; parameters
    excluded, each tensor once), and the plan's activation bytes for the layout."""
    from launcher.plan.estimate import make_plan
    from training.run.loop import Trainer

    trainer = Trainer(config_from_dict(config_to_dict(cfg)), tempfile.mkdtemp(), mesh, checkpointing=False)
    from training.observe.saved_bytes import saved_activation_bytes

    measured = saved_activation_bytes(trainer)
    return {"measured": measured, "planned": make_plan(cfg).memory_bytes["activations"]}


def _mesh(cfg: Config):
    from training.parallel.mesh import ProcessMesh

    p = cfg.parallel
    return ProcessMesh.from_env(p.tp, p.pp, p.cp, p.dp, timeout_s=60)


def _cases_4(base: str) -> dict[str, Any]:
    """Every 4-rank layout, both models."""
    layouts = {
        "cp4": dict(cp=4),
        "cp2_tp2_sp": dict(cp=2, tp=2),
        "cp2_pp2_1f1b": dict(cp=2, pp=2),
        "cp2_pp2_interleaved": dict(cp=2, pp=2, vpp=2, schedule="interleaved_1f1b"),
        "cp2_dp2_zero1": dict(cp=2, dp=2),
    }
    out, mesh = {}, None
    for model in MODELS:
        cfg = _memory_cfg(model, 4)
        out[f"{model}/memory"] = _saved_activation_bytes(cfg, _mesh(cfg))
        for name, kw in layouts.items():
            cfg = _cfg(model, **kw)
            mesh = _mesh(cfg)
            out[f"{model}/{name}"] = _run(cfg, os.path.join(base, model, name), mesh)
    mesh.destroy()
    return out


def _cases_2(base: str) -> dict[str, Any]:
    """cp2 (ring and all_gather), bit-exact resume at cp2, and the cp2 half of the cp2 -> cp1 resharding."""
    out: dict[str, Any] = {}
    mesh = None
    for model in MODELS:
        cfg = _with_eval(_cfg(model, cp=2))
        mesh = _mesh(cfg)
        out[f"{model}/memory"] = _saved_activation_bytes(_memory_cfg(model, 2), mesh)
        out[f"{model}/cp2"] = _run(cfg, os.path.join(base, model, "cp2"), mesh)
        out[f"{model}/cp2_bf16"] = _run(
            _bf16(_cfg(model, cp=2)), os.path.join(base, model, "cp2_bf16"), mesh, grads=False
        )
        gathered = _cfg(model, cp=2)
        gathered.parallel.cp_comm = "all_gather"
        out[f"{model}/cp2_all_gather"] = _run(gathered, os.path.join(base, model, "cp2_all_gather"), mesh)
        # Recompute replays the ring inside backward (full: whole layers; selective: the attention core).
        recompute = _cfg(model, cp=2)
        recompute.parallel.recompute = "full" if model == "llama" else "selective"
        out[f"{model}/cp2_recompute"] = _run(recompute, os.path.join(base, model, "cp2_recompute"), mesh)
    # The engine's own layout rules: a rank started on a cp layout it cannot run refuses it, naming the fix.
    from training.contract.layout_rules import LayoutError
    from training.run.loop import Trainer

    refused = []
    for change in ({"seq_length": 18}, {"dropout": 0.1}):
        bad = _cfg("gpt", cp=2)
        for k, v in change.items():
            setattr(bad.model, k, v)
        try:
            Trainer(bad, os.path.join(base, "refused"), mesh, checkpointing=False)
        except LayoutError as exc:
            refused.append(str(exc))
    out["refused"] = refused
    # Resume: the reference with checkpoints, then the same run stopped after step 2 and resumed.
    ref = _run(_cfg("llama", cp=2, steps=4), os.path.join(base, "resume", "ref"), mesh, True, False)
    run = os.path.join(base, "resume", "run")
    first = _run(_cfg("llama", cp=2, steps=4, exit_interval=2), run, mesh, True, False)
    second = _run(_cfg("llama", cp=2, steps=4), run, mesh, True, False)
    out["resume"] = {"ref": ref, "first": first, "second": second}
    # The cp2 half of the resharding: stop after step 2 with a checkpoint (resumed at cp1 by the test).
    out["reshard"] = _run(
        _cfg("llama", cp=2, exit_interval=2, **RESHARD), os.path.join(base, "reshard"), mesh, True, False
    )
    # cp1 -> cp2: the cp1 checkpoint of step 2 (written by the fixture) resumed here; its final checkpoint is cp2's.
    out["reshard_up"] = _run(_cfg("llama", cp=2, **RESHARD), os.path.join(base, "reshard_up"), mesh, True, False)
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    torch.set_num_threads(1)
    from training.parallel.mesh import ProcessMesh

    base = str(tmp_path_factory.mktemp("cp"))
    # The cp1 half of the cp1 -> cp2 resharding: stopped after step 2 with a checkpoint (resumed at cp2 by _cases_2).
    up = _run(_cfg("llama", exit_interval=2, **RESHARD), os.path.join(base, "reshard_up"), ProcessMesh.single(), True)
    assert up["code"] == 3
    single = {m: _run(_with_eval(_cfg(m)), tempfile.mkdtemp(), ProcessMesh.single()) for m in MODELS}
    for m in MODELS:
        single[m]["bf16"] = _run(_bf16(_cfg(m)), tempfile.mkdtemp(), ProcessMesh.single(), grads=False)
    for m in MODELS:
        single[m]["memory"] = _saved_activation_bytes(_memory_cfg(m, 1), ProcessMesh.single())
    two = run_distributed(_cases_2, 2, args=(base,), timeout_s=400)
    four = run_distributed(_cases_4, 4, args=(base,), timeout_s=600)
    return single, two, four, base


def _assert_equivalent(got: dict[str, Any], ref: dict[str, Any], label: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {step + 1}: loss {a} vs single-process {b}"
    assert set(got["grads"]) <= set(ref["grads"]), label
    for name, g in got["grads"].items():
        r = ref["grads"][name]
        err, scale = float(np.abs(g - r).max()), float(np.abs(r).max())
        assert err <= 1e-5 * max(scale, 1e-3), f"{label} grad {name}: max error {err:.3g} (max |grad| {scale:.3g})"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ["cp2", "cp2_all_gather", "cp2_recompute"])
def test_cp2_reproduces_single_process(results, model, layout):
    single, two, _, _ = results
    for rank in two:  # every cp rank: the same loss and the same reduced grads
        _assert_equivalent(rank[f"{model}/{layout}"], single[model], f"{model} {layout}")
    assert len(set(single[model]["losses"])) == STEPS  # the updates changed the model: the steps differ
    if layout == "cp2":  # evaluation (forward only) over the cp group: the held-out loss of one process
        ref = single[model]["eval"]
        assert len(ref) == 1 and ref[0][0] == STEPS
        for rank in two:
            got = rank[f"{model}/cp2"]["eval"]
            assert got[0][0] == ref[0][0] and abs(got[0][1] - ref[0][1]) <= 1e-5 * abs(ref[0][1]), (got, ref)


@pytest.mark.parametrize("model", MODELS)
def test_cp2_bf16_tracks_the_bf16_single_process(results, model):
    """bf16 at cp2 only moves where bf16 values are rounded (attention itself runs in fp32): within 1e-3."""
    single, two, _, _ = results
    ref = single[model]["bf16"]["losses"]
    for rank in two:
        got = rank[f"{model}/cp2_bf16"]["losses"]
        assert len(got) == len(ref) == STEPS
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) <= 1e-3 * abs(b), f"{model} bf16 cp2 step {step + 1}: {a} vs {b}"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ["cp4", "cp2_tp2_sp", "cp2_pp2_1f1b", "cp2_pp2_interleaved", "cp2_dp2_zero1"])
def test_cp_layouts_reproduce_single_process(results, model, layout):
    single, _, four, _ = results
    names = set()
    for rank in four:
        res = rank[f"{model}/{layout}"]
        _assert_equivalent(res, single[model], f"{model} {layout}")
        names |= set(res["grads"])
    assert names == set(single[model]["grads"]), f"{model} {layout}: every parameter's grad was compared"


def test_engine_refuses_cp_layouts_it_cannot_run(results):
    _, two, _, _ = results
    for rank in two:
        seq, dropout = rank["refused"]
        assert "seq_length 18 is not divisible by 2 x cp = 4" in seq and "model.seq_length=20" in seq
        assert "model.dropout=0" in dropout


def test_cp2_resume_is_bit_exact(results):
    _, two, _, _ = results
    for rank in two:
        res = rank["resume"]
        ref, first, second = res["ref"]["losses"], res["first"]["losses"], res["second"]["losses"]
        assert res["first"]["code"] == 3 and res["second"]["code"] == 0
        assert first == ref[:2] and second == ref[2:], (first, second, ref)  # exact


def test_cp2_checkpoint_resumed_at_cp1_exports_the_cp1_model(results):
    from safetensors.torch import load_file

    from training.hf.export import export
    from training.parallel.mesh import ProcessMesh

    _, two, _, base = results
    assert two[0]["reshard"]["code"] == 3
    cp2_dir = os.path.join(base, "reshard")
    resumed = _run(_cfg("llama", **RESHARD), cp2_dir, ProcessMesh.single(), True, False)
    ref_dir = tempfile.mkdtemp()
    reference = _run(_cfg("llama", **RESHARD), ref_dir, ProcessMesh.single(), True, False)
    assert len(resumed["losses"]) == 2
    np.testing.assert_allclose(resumed["losses"], reference["losses"][2:], rtol=1e-5)
    outs = []
    for run_dir in (cp2_dir, ref_dir):
        out = os.path.join(tempfile.mkdtemp(), "hf")
        export(run_dir, out, dtype="fp32")
        tensors = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(out, f)))
        outs.append(tensors)
    assert set(outs[0]) == set(outs[1]) and outs[0]
    for k in outs[0]:
        err = float((outs[0][k] - outs[1][k]).abs().max())
        print(f"cp2 -> cp1 export vs cp1: {k} max abs difference {err:.3g}")
        assert err <= 1e-6, f"{k}: exported cp2 -> cp1 differs from cp1 by {err}"
    shutil.rmtree(ref_dir, ignore_errors=True)


def _export_tensors(run_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from training.hf.export import export

    out = os.path.join(tempfile.mkdtemp(), "hf")
    result = export(run_dir, out, dtype="fp32")
    tensors: dict[str, torch.Tensor] = {}
    for f in result["weight_files"]:
        tensors.update(load_file(os.path.join(out, f)))
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    return tensors


def test_cp1_checkpoint_resumed_at_cp2_matches_cp1_and_exports_straight_from_cp2(results):
    """cp1 -> cp2 (the other direction of the resharding): the cp1 checkpoint of step 2 resumed at cp2 gives
    steps 3 and 4 of the run at cp1 throughout (within 1e-5), and the export of the step-4 checkpoint that the
    cp2 ranks wrote equals the cp1 run's export within 1e-6."""
    from training.parallel.mesh import ProcessMesh

    _, two, _, base = results
    ref_dir = tempfile.mkdtemp()
    reference = _run(_cfg("llama", **RESHARD), ref_dir, ProcessMesh.single(), True, False)
    for rank in two:
        got = rank["reshard_up"]
        assert got["code"] == 0 and len(got["losses"]) == 2
        np.testing.assert_allclose(got["losses"], reference["losses"][2:], rtol=1e-5)
    up_dir = os.path.join(base, "reshard_up")
    with open(os.path.join(up_dir, "checkpoints", "step_4", "config.json")) as f:
        assert json.load(f)["parallel"]["cp"] == 2  # the checkpoint exported below is the one cp2 ranks wrote
    got, ref = _export_tensors(up_dir), _export_tensors(ref_dir)
    assert set(got) == set(ref) and got
    for k in ref:
        err = float((got[k] - ref[k]).abs().max())
        assert err <= 1e-6, f"{k}: exported from the cp2 checkpoint, differs from cp1 by {err}"
    shutil.rmtree(ref_dir, ignore_errors=True)


@pytest.mark.parametrize("model", MODELS)
def test_activation_memory_per_rank_falls_as_one_over_cp(results, model):
    """What autograd saves per rank halves at cp2 and quarters at cp4 (every saved tensor is per token, attention
    keeps its per-token log-sum-exp, no s x s scores), and it is the plan's activation bytes within 10 % at cp1,
    cp2 and cp4 on both models (the Llama-style one through training/model/fused_ops.py's RMSNorm, SwiGLU and RoPE)."""
    single, two, four, _ = results
    one = single[model]["memory"]
    for cp, ranks in ((2, two), (4, four)):
        for rank in ranks:
            got = rank[f"{model}/memory"]
            ratio = got["measured"] / one["measured"]
            print(
                f"{model} cp{cp}: saved {got['measured']} B vs cp1 {one['measured']} B (x {ratio:.3f}); "
                f"plan {got['planned']} B"
            )
            assert abs(ratio - 1 / cp) <= 0.02 / cp, (model, cp, ratio)
            assert got["planned"] * cp == pytest.approx(one["planned"], rel=0.01)
            assert abs(got["measured"] - got["planned"]) <= 0.10 * got["planned"], (model, cp, got)
    assert abs(one["measured"] - one["planned"]) <= 0.10 * one["planned"], (model, 1, one)
