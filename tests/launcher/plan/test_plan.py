"""The planner against the published formulas (docs/FORMULAS.md) and the engine's accounting contract."""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction

import pytest
from helpers import ROOT
from helpers.cli import compose_cfg
from helpers.oracles_plan import korthikanti_table2, narayanan_params

from launcher.plan.estimate import bubble, make_plan, with_parallel
from launcher.plan.memory import (
    KORTHIKANTI,
    DeviceProfile,
    inflight_microbatches,
    layer_activation_bytes,
    model_state_bytes,
    model_state_bytes_per_param,
    stage_activation_bytes,
)
from launcher.plan.model_size import (
    hardware_flops_per_step,
    model_flops_per_step,
    params_total,
    stage_params,
)

# ---- Korthikanti et al. 2022, Table 2 ------------------------------------------------------------

SETTINGS = {
    "none": dict(tp=1, sp=False, recompute="none"),
    "tp": dict(tp=8, sp=False, recompute="none"),
    "tp_sp": dict(tp=8, sp=True, recompute="none"),
    "tp_selective": dict(tp=8, sp=False, recompute="selective"),
    "tp_sp_selective": dict(tp=8, sp=True, recompute="selective"),
    "full": dict(tp=8, sp=False, recompute="full"),
}


@pytest.mark.parametrize("preset", ["korthikanti_22b", "korthikanti_175b", "korthikanti_530b", "korthikanti_1t"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_korthikanti_table2_exact(preset, setting):
    cfg = compose_cfg(f"model={preset}", f"parallel={preset}")
    for b in (1, 4):
        c = with_parallel(cfg, micro_batch=b, **SETTINGS[setting])
        m = c.model
        got = layer_activation_bytes(c, KORTHIKANTI)
        want = korthikanti_table2(m.seq_length, b, m.hidden_size, m.num_attention_heads, c.parallel.tp, setting)
        assert got == want, (preset, setting, b, got, want)


def test_general_ffn_width_and_flash():
    cfg = compose_cfg("model=korthikanti_22b", "parallel=single", "model.ffn_hidden_size=9216")
    m = cfg.model
    s, h, a, f = m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn
    sbh = s * h
    # sbh (18 + 4 f/h) + 5 a s^2 b at 16 bits with 1-byte masks.
    assert layer_activation_bytes(cfg, KORTHIKANTI) == sbh * (18 + 4 * f // h) + 5 * a * s * s
    flash = compose_cfg(
        "model=korthikanti_22b", "parallel=single", "model.ffn_hidden_size=9216", "model.attention=flash"
    )
    assert layer_activation_bytes(flash, KORTHIKANTI) == sbh * (18 + 4 * f // h)


# ---- The CPU fp32 measurements of docs/PLATFORM.md -----------------------------------------------

CPU_FP32 = DeviceProfile(act_bytes=4, mask_bytes=4, flash_with_dropout=False)


def _cpu_layer(**par):
    cfg = compose_cfg(
        "model=tiny",
        "parallel=single",
        "model.num_layers=1",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.seq_length=32",
        "parallel.micro_batch=2",
        "model.dropout=0.0",
        f"model.attention={par.pop('attention', 'math')}",
    )
    return layer_activation_bytes(with_parallel(cfg, **par), CPU_FP32)


def test_cpu_fp32_measured_bytes():
    sbh = 32 * 2 * 64
    assert _cpu_layer() == 295_936  # math attention, no dropout: measured
    assert _cpu_layer(attention="flash") == 295_936 - 32_768 + 1_024  # no s x s, a logsumexp
    assert _cpu_layer(attention="flash") / sbh == 64.5
    assert _cpu_layer(attention="flash", tp=2) / sbh == pytest.approx(40.4, abs=0.03)
    assert _cpu_layer(attention="flash", tp=2, sp=True) / sbh == 32.25  # Megatron-ideal SP
    assert _cpu_layer(attention="flash", tp=2, recompute="full") / sbh == 4.0
    assert _cpu_layer(attention="flash", tp=2, sp=True, recompute="full") / sbh == 2.0


def test_cpu_dropout_forces_math_path():
    cfg = compose_cfg("model=tiny", "parallel=single", "model.dropout=0.1", "model.attention=flash")
    math_cfg = compose_cfg("model=tiny", "parallel=single", "model.dropout=0.1", "model.attention=math")
    assert layer_activation_bytes(cfg, CPU_FP32) == layer_activation_bytes(math_cfg, CPU_FP32)
    gpu = DeviceProfile(act_bytes=4, mask_bytes=4, flash_with_dropout=True)
    assert layer_activation_bytes(cfg, gpu) < layer_activation_bytes(math_cfg, gpu)


# ---- Model states: ZeRO paper and Megatron's distributed-optimizer table --------------------------


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_bytes_per_param_tables(d):
    assert model_state_bytes_per_param("fp16", 0, d) == 16
    assert model_state_bytes_per_param("fp16", 1, d) == 4 + 12 / d
    assert model_state_bytes_per_param("bf16", 0, d) == 18
    assert model_state_bytes_per_param("bf16", 1, d) == 6 + 12 / d
    assert model_state_bytes_per_param("fp32", 0, d) == 16
    assert model_state_bytes_per_param("fp32", 1, d) == 8 + 8 / d
    n = 1000 * d
    for prec, per in (("fp16", 4 + Fraction(12, d)), ("bf16", 6 + Fraction(12, d)), ("fp32", 8 + Fraction(8, d))):
        assert sum(model_state_bytes(n, prec, 1, d).values()) == per * n


def test_zero1_pads_to_multiple_of_dp():
    st = model_state_bytes(10, "bf16", 1, 4)  # ceil(10/4) = 3 per rank
    assert st == {"weights": 20, "grads": 3 * 4 * 4, "optimizer": 3 * 12}


def test_zero_paper_worked_example_and_a_7b_model():
    psi, d = 7.5e9, 64
    assert sum(model_state_bytes(int(psi), "fp16", 0, d).values()) / 1e9 == 120.0
    assert round(sum(model_state_bytes(int(psi), "fp16", 1, d).values()) / 1e9, 1) == 31.4
    assert sum(model_state_bytes(7 * 10**9, "fp16", 0, 1).values()) / 1e9 == 112.0


# ---- Narayanan et al. 2021, Table 1 ---------------------------------------------------------------

NARAYANAN = [  # billions, heads, hidden, layers
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


def _layer_forward_flops(B: int, s: int, h: int) -> int:
    """One GPT layer's forward matmuls (4h MLP): QKV, scores QK^T, scores x V, output projection, fc1, fc2."""
    tokens = B * s
    return (
        2 * tokens * h * 3 * h
        + 2 * B * s * s * h
        + 2 * B * s * s * h
        + 2 * tokens * h * h
        + 2 * tokens * h * 4 * h
        + 2 * tokens * 4 * h * h
    )


def _narayanan_cfg(heads, hidden, layers, **par):
    cfg = compose_cfg(
        "model=korthikanti_22b",
        "parallel=single",
        f"model.num_attention_heads={heads}",
        f"model.hidden_size={hidden}",
        f"model.num_layers={layers}",
        "model.vocab_size=51200",
        "model.seq_length=2048",
        "parallel.global_batch=512",
    )
    return with_parallel(cfg, **par)


@pytest.mark.parametrize("billions,heads,hidden,layers", NARAYANAN)
def test_narayanan_table1_params_and_flops(billions, heads, hidden, layers):
    cfg = _narayanan_cfg(heads, hidden, layers)
    n = params_total(cfg)
    assert abs(n / 1e9 - billions) < 0.06
    # The closed form lacks only the final LayerNorm (2h).
    assert n == round(narayanan_params(layers, hidden, 51200, 2048)) + 2 * hidden
    B, s, L, h, V = 512, 2048, layers, hidden, 51200
    # Counted matmul by matmul (not the closed form the planner uses): a forward matmul of [m, k] x [k, n]
    # costs 2mkn, its backward twice that; full recompute runs every layer's forward once more.
    layer, logits = _layer_forward_flops(B, s, h), 2 * B * s * h * V
    assert model_flops_per_step(cfg) == 3 * (L * layer + logits)
    full = with_parallel(cfg, recompute="full")
    assert hardware_flops_per_step(full) == 4 * L * layer + 3 * logits
    sel = with_parallel(cfg, recompute="selective")
    assert hardware_flops_per_step(sel) == 72 * B * s * L * h * h * (1 + Fraction(s, 3 * h) + Fraction(V, 12 * L * h))
    assert hardware_flops_per_step(cfg) == model_flops_per_step(cfg)


# ---- Pipeline, batch arithmetic, per-rank parameters -----------------------------------------------


def test_bubble_worked_example():
    b = bubble(4, 4)
    assert b["bubble_ratio"] == 0.75
    assert round(100 * b["bubble_idle_fraction"]) == 43
    assert bubble(4, 8, 2)["bubble_ratio"] == 3 / 16


def test_32_gpu_layout_worked_example():
    cfg = compose_cfg(
        "model=gpt_1p3b", "parallel=tp8_pp2", "cluster=dgx_h100", "cluster.nodes=4", "train.precision=bf16"
    )
    plan = make_plan(cfg)
    assert (plan.world_size, plan.tp, plan.pp, plan.dp) == (32, 8, 2, 2)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == (32, 1, 16)
    assert plan.bubble_ratio == 1 / 16


def test_stage_params_sum_to_model_plus_tied_copy():
    cfg = compose_cfg("model=gpt2_125m", "parallel=single")
    for pp in (1, 2, 4):
        c = with_parallel(cfg, pp=pp)
        stages = [stage_params(c, st).total for st in range(pp)]
        tied_copy = c.model.vocab_size * c.model.hidden_size if pp > 1 else 0
        assert sum(stages) == params_total(c) + tied_copy
    untied = compose_cfg("model=llama3_8b", "parallel=single", "parallel.pp=2")
    assert sum(stage_params(untied, st).total for st in range(2)) == params_total(untied)


def test_tp_shards_multiply_back():
    cfg = compose_cfg("model=llama3_8b", "parallel=single")
    full = stage_params(cfg, 0).total
    t8 = with_parallel(cfg, tp=8)
    sp8 = stage_params(t8, 0)
    # Norms are the only replicated params of a bias-free Llama; everything else splits 8 ways.
    norms = (2 * cfg.model.num_layers + 1) * cfg.model.hidden_size
    assert (sp8.total - norms) * 8 == full - norms
    assert params_total(cfg) == 8_030_261_248  # Llama 3 8B's published parameter count


def test_pipeline_inflight_first_stage():
    cfg = compose_cfg("model=korthikanti_175b", "parallel=korthikanti_175b", "model.dropout=0.0")
    p, L = cfg.parallel.pp, cfg.model.num_layers
    per = layer_activation_bytes(cfg, KORTHIKANTI)
    # 1F1B with m >= p: the first stage holds L x per-layer, independent of p.
    assert stage_activation_bytes(cfg, 0, 64, KORTHIKANTI) == L * per
    assert stage_activation_bytes(cfg, 0, 4, KORTHIKANTI) == L * per * 4 // p  # m < p
    gp = with_parallel(cfg, schedule="gpipe")
    assert stage_activation_bytes(gp, 0, 64, KORTHIKANTI) == L // p * per * 64
    v = 2
    il = with_parallel(cfg, schedule="interleaved_1f1b", vpp=v)
    assert stage_activation_bytes(il, 0, 64, KORTHIKANTI) == L * per * (1 + Fraction(p - 1, p * v))
    assert inflight_microbatches(cfg, p - 1, 64) == 1


def test_logits_on_last_stage_and_plan_memory_contract():
    cfg = compose_cfg(
        "model=gpt2_125m",
        "parallel=single",
        "parallel.pp=2",
        "parallel.global_batch=8",
        "parallel.micro_batch=1",
        "cluster.gpus_per_node=2",
        "train.precision=bf16",
    )
    plan = make_plan(cfg)
    s, V = cfg.model.seq_length, 50257
    last = plan.stages[1].memory_bytes["activations"]
    assert last >= s * V * 4  # fp32 logits for the cross entropy
    w = plan.stages[plan.worst_stage]
    assert plan.memory_bytes["weights"] == w.params * 2
    assert plan.memory_bytes["grads"] == w.params * 4
    assert plan.memory_bytes["optimizer"] == w.params * 12
    assert plan.memory_bytes["total"] == max(st.memory_bytes["total"] for st in plan.stages)
    assert plan.fits == (plan.memory_bytes["total"] <= plan.gpu_memory_bytes)
    assert plan.tokens_per_step == 8 * s
    assert all(isinstance(v, int) for v in plan.memory_bytes.values())


def test_comm_volumes():
    cfg = compose_cfg(
        "model=gpt2_125m",
        "parallel=tp2",
        "cluster.gpus_per_node=4",
        "train.precision=bf16",
        "parallel.micro_batch=1",
        "parallel.global_batch=4",
    )
    plan = make_plan(cfg)  # tp 2, dp 2, m = 2
    m, s, h, L = 2, 1024, 768, 12
    act = s * h * 2
    # 4 all-reduces per layer and micro-batch, ring factor 2(t-1)/t = 1 at t = 2.
    assert plan.comm_bytes["tp"] >= m * L * 4 * act
    assert plan.comm_bytes["pp"] == 0
    assert plan.comm_bytes["dp"] == plan.params_per_gpu * 4  # grads all-reduce, 2(d-1)/d = 1
    z = make_plan(with_parallel(cfg, zero=1))
    padded = math.ceil(z.params_per_gpu / 2) * 2
    assert z.comm_bytes["dp"] == padded * 4 // 2 + padded * 2 // 2


def test_launcher_imports_no_torch():
    code = (
        "import sys; import launcher.plan.estimate, launcher.plan.validate, launcher.launch.gate, launcher.sweep.summary, launcher.cli.app; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- The same Table 2 through `meshrun action=plan` on a GPU cluster (the engine's CUDA profile) ------------

CUDA_SETTINGS = ["tp", "tp_sp", "tp_selective", "tp_sp_selective", "full"]


def _table2_check(plan, preset, setting):
    m, mem = compose_cfg(f"model={preset}").model, plan["memory_bytes"]
    par = SETTINGS[setting]
    want = korthikanti_table2(m.seq_length, plan["micro_batch"], m.hidden_size, m.num_attention_heads, 8, setting)
    assert plan["activation_profile"]["mask_bytes"] == 1 and not plan["activation_profile"]["softmax_fp32"]
    assert mem["activations_per_layer_paper"] == want, (preset, setting, mem)  # Table 2's basis, exactly
    # What the engine saves: the paper's bytes plus the two LayerNorms' fp32 statistics, reported beside them.
    assert mem["activations_per_layer"] == want + mem["activations_per_layer_norm_stats"], (preset, setting, mem)
    # The statistics: two LayerNorms, mean and rstd in fp32 per token (of the sp shard); none under full.
    s_b = m.seq_length * plan["micro_batch"] // (8 if par["sp"] else 1)
    assert mem["activations_per_layer_norm_stats"] == (0 if setting == "full" else 2 * 2 * 4 * s_b)


def test_plan_on_dgx_h100_gives_table2_for_the_papers_gpt_layer(tmp_path):
    """The paper's GPT layer (math attention, dropout 0.1, bf16) planned for cluster=dgx_h100 with the device
    profile of what the engine saves on CUDA (1-byte masks, 16-bit probabilities: training/model/dropout_softmax.py;
    tests/launcher/launch/test_gpu_paths_on_cpu.py measures that profile with the saved-tensor counter): plan.json's
    activations_per_layer_paper is Table 2's bytes exactly; activations_per_layer adds the norms' fp32
    statistics (activations_per_layer_norm_stats), which the paper leaves out; the plan's table says so."""
    import json

    from helpers.cli import run_cli

    preset = "korthikanti_22b"  # every setting fits an 80 GB H100 at micro-batch 1, so each plan is written
    for setting in CUDA_SETTINGS:
        par = SETTINGS[setting]
        run = tmp_path / setting
        res = run_cli(
            "action=plan",
            "cluster=dgx_h100",
            f"model={preset}",
            f"parallel={preset}",
            "model.attention=math",
            "model.dropout=0.1",
            "train.precision=bf16",
            f"parallel.tp={par['tp']}",
            f"parallel.sp={str(par['sp']).lower()}",
            f"parallel.recompute={par['recompute']}",
            "parallel.micro_batch=1",
            f"run.dir={run}",
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        _table2_check(json.loads((run / "plan.json").read_text()), preset, setting)
        if setting != "full":  # the printed table names the difference where there is one
            assert "without the norms' fp32 mean/rstd, Korthikanti et al.'s Table 2 basis" in res.stdout, res.stdout
    # The larger presets through the same planner (make_plan is what action=plan writes; some of these layouts do
    # not fit an 80 GB part, which the CLI refuses before writing plan.json).
    for preset in ("korthikanti_175b", "korthikanti_530b", "korthikanti_1t"):
        for setting in CUDA_SETTINGS:
            cfg = compose_cfg(
                "cluster=dgx_h100",
                f"model={preset}",
                f"parallel={preset}",
                "model.attention=math",
                "model.dropout=0.1",
                "train.precision=bf16",
            )
            _table2_check(make_plan(with_parallel(cfg, micro_batch=1, **SETTINGS[setting])).to_json(), preset, setting)
