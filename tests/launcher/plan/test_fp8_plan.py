"""train.precision=fp8 in the launcher (no torch): the validation's errors each name their fix, and the plan's
FP8 figures (memory_bytes.fp8_cache, the linears at cluster.peak_tflops_fp8, mfu_fp8 beside mfu)."""

from __future__ import annotations

import importlib.util

from launcher.plan.estimate import format_plan, make_plan
from launcher.plan.validate import validate
from training.contract.config import Config


def _cfg(**train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 8
    cfg.cluster.gpus_per_node = 1
    cfg.data.kind = "synthetic"
    cfg.train.precision = "fp8"
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _fp8_errors(cfg: Config):
    return [i for i in validate(cfg).errors if i.code == "fp8"]


def test_fp8_validates_on_the_tiny_model():
    assert _fp8_errors(_cfg()) == []


def test_width_not_a_multiple_of_16_names_the_skip_fix():
    cfg = _cfg()
    cfg.model.hidden_size, cfg.model.num_attention_heads = 40, 4  # qkv 120 x 40
    errors = _fp8_errors(cfg)
    assert errors and all(e.key == "train.fp8_skip" for e in errors)
    assert "multiples of 16" in errors[0].message and "train.fp8_skip=[embedding,output,qkv]" in errors[0].fix


def test_unknown_skip_kind_is_refused():
    keys = {e.key: e for e in _fp8_errors(_cfg(fp8_skip=["embedding", "mlp"]))}
    assert "'mlp'" in keys["train.fp8_skip"].message


def test_fp8_all_gather_needs_fp8_zero3_and_tensorwise():
    """parallel.fp8_all_gather runs with train.precision=fp8, zero=3 and the tensorwise recipe; each missing part
    is an error whose fix a user can type."""
    ok = _cfg()
    ok.parallel.dp, ok.parallel.zero, ok.parallel.fp8_all_gather = 2, 3, True
    ok.cluster.gpus_per_node = 2
    assert _fp8_errors(ok) == []
    cases = {
        "parallel.zero=3 (or parallel.fp8_all_gather=false)": dict(zero=1),
        "train.fp8_recipe=tensorwise (or parallel.fp8_all_gather=false)": dict(fp8_recipe="rowwise"),
        "train.precision=fp8 (or parallel.fp8_all_gather=false)": dict(precision="bf16"),
    }
    for fix, change in cases.items():
        cfg = _cfg()
        cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.fp8_all_gather = 2, 3, True
        cfg.cluster.gpus_per_node = 2
        for k, v in change.items():
            setattr(cfg.parallel if k == "zero" else cfg.train, k, v)
        errors = [e for e in validate(cfg).errors if e.key == "parallel.fp8_all_gather"]
        assert [e.fix for e in errors] == [fix], (change, errors)


def test_cluster_without_fp8_is_refused_before_launch():
    """cluster.fp8_supported=false (the A100 presets) refuses train.precision=fp8 with the bf16 fix; null (not
    stated) and true pass, and so does a CPU cluster (float8 emulated)."""
    cfg = _cfg()
    cfg.cluster.device, cfg.cluster.name, cfg.cluster.fp8_supported = "cuda", "dgx_a100", False
    (error,) = _fp8_errors(cfg)
    assert error.key == "train.precision" and "dgx_a100" in error.message and "fp8_supported=false" in error.message
    assert error.fix.startswith("train.precision=bf16")
    for supported in (None, True):
        cfg.cluster.fp8_supported = supported
        assert _fp8_errors(cfg) == []
    assert _fp8_errors(_cfg()) == []  # cpu


def test_a100_presets_state_no_fp8_and_the_plan_refuses_it(tmp_path):
    """`meshrun action=plan model=tiny cluster=dgx_a100 train.precision=fp8` fails naming the fix; dgx_h100 plans."""
    import os

    from helpers import ROOT
    from helpers.cli import run_cli

    for name, supported in (("dgx_a100", "false"), ("dgx_a100_40gb", "false"), ("dgx_h100", "true")):
        text = open(os.path.join(ROOT, "conf", "cluster", f"{name}.yaml")).read()
        assert f"fp8_supported: {supported}" in text, name
    bad = run_cli("action=plan", "model=tiny", "cluster=dgx_a100", "train.precision=fp8", cwd=str(tmp_path))
    assert bad.returncode != 0 and "fix: train.precision=bf16" in bad.stdout + bad.stderr
    good = run_cli("action=plan", "model=tiny", "cluster=dgx_h100", "train.precision=fp8", cwd=str(tmp_path))
    assert good.returncode == 0, good.stderr


def test_torchao_missing_gives_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    (error,) = _fp8_errors(_cfg())
    assert error.key == "train.precision" and "pip install 'torchao==0.18.*'" in error.fix


def test_plan_counts_fp8_cache_and_runs_the_linears_at_the_fp8_peak():
    bf16, fp8 = _cfg(precision="bf16"), _cfg()
    for cfg in (bf16, fp8):
        cfg.cluster.peak_tflops, cfg.cluster.peak_tflops_fp8 = 989.0, 1979.0
    pb, pf = make_plan(bf16), make_plan(fp8)
    assert pb.memory_bytes["fp8_cache"] == 0 and pf.memory_bytes["fp8_cache"] > 0
    assert pf.memory_bytes["total"] == pb.memory_bytes["total"] + pf.memory_bytes["fp8_cache"]
    # The FP8 share of the weight GEMMs at 2x: compute falls, attention and the bf16 head unchanged.
    assert pf.predicted_step_parts_s["compute"] < pb.predicted_step_parts_s["compute"]
    assert pb.mfu_fp8 == 0 and pf.peak_flops_fp8 == 1979e12 and pf.mfu_fp8 > 0
    assert abs(pf.mfu / pf.mfu_fp8 - 1979.0 / 989.0) < 1e-9  # the same step time against either peak
    assert "of the FP8 peak" in format_plan(pf) and "FP8 peak" not in format_plan(pb)


def test_dgx_h100_preset_has_the_datasheet_fp8_peak():
    import os

    from helpers import ROOT

    text = open(os.path.join(ROOT, "conf", "cluster", "dgx_h100.yaml")).read()
    assert "peak_tflops_fp8: 1979" in text
