"""The planner's formulas: parameters, memory, activations, FLOPs, bubble, communication (pure Python).

Every number here is arithmetic on the typed config: no torch, no Hydra, so a 64-point sweep plans in
milliseconds per point. The published formulas (Korthikanti et al. 2022 Table 2, the ZeRO paper,
Megatron's distributed-optimizer table, Narayanan et al. 2021) are special cases of the general
counts below and are reproduced exactly by the tests. Units: bytes and element counts are ints;
GiB appear only in display code.

Conventions shared with the engine (docs/CONTRACTS.md): padded_vocab = ceil(V/tp)*tp; every pipeline
rank holds L/pp layers (split evenly over pp*vpp chunks); the first stage holds the embeddings, the
last the final norm and the output layer; with tied embeddings and pp > 1 the last stage also holds
a copy of the word embedding (Megatron), which counts in its memory but not in params_total.
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

from training.config import Config, derived_dp

# Bytes per parameter: weights, gradients (fp32 main grads for bf16), optimizer (K).
PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_BYTES = {"fp32": 4, "bf16": 4, "fp16": 2}
OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}


# --------------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------------


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp (the engine's embedding rows)."""
    return -(-vocab_size // tp) * tp


def _norm_params(cfg: Config) -> int:
    m = cfg.model
    if m.norm == "rmsnorm":
        return m.hidden_size
    return m.hidden_size * (2 if m.bias else 1)


@dataclass
class LayerParams:
    """Parameters of one transformer layer held by one tp rank (sharded part / replicated part)."""

    sharded: int
    """Elements of column/row-parallel weights and column-parallel biases on this tp rank."""
    replicated: int
    """Elements replicated over tp: norms and the row-parallel biases."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def layer_params(cfg: Config, tp: Optional[int] = None) -> LayerParams:
    """One layer on one tp rank: fused QKV (column), attention output (row), MLP fc1 (column), fc2 (row)."""
    m = cfg.model
    t = tp if tp is not None else cfg.parallel.tp
    h, a, g, f = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn
    hd = h // a
    qkv_out = (a + 2 * g) * hd
    fc1_out = 2 * f if m.activation == "swiglu" else f
    full_sharded = qkv_out * h + h * h + fc1_out * h + h * f
    if m.bias:
        full_sharded += qkv_out + fc1_out
    replicated = 2 * _norm_params(cfg) + (2 * h if m.bias else 0)
    return LayerParams(sharded=full_sharded // t, replicated=replicated)


@dataclass
class StageParams:
    """Parameters one pipeline stage's tp rank holds, by part."""

    layers: int
    """Transformer layers on this rank (all its virtual chunks)."""
    layer_params: int
    """Elements of those layers."""
    embedding: int
    """Word (vocab-parallel shard) and position embeddings, or the tied copy on the last stage."""
    head: int
    """Final norm and the untied output layer."""

    @property
    def total(self) -> int:
        return self.layer_params + self.embedding + self.head


def stage_params(cfg: Config, stage: int) -> StageParams:
    """Elements held by one rank of pipeline stage `stage` (0-based) at the config's tp."""
    m, par = cfg.model, cfg.parallel
    t, p = par.tp, par.pp
    h = m.hidden_size
    vp = padded_vocab(m.vocab_size, t)
    word = vp * h // t
    n_layers = m.num_layers // p
    lp = layer_params(cfg).total * n_layers
    embedding = 0
    head = 0
    if stage == 0:
        embedding += word
        if m.position == "learned":
            embedding += m.seq_length * h
    if stage == p - 1:
        head += _norm_params(cfg)
        if not m.tie_embeddings:
            head += word
        elif p > 1:
            embedding += word  # Megatron's tied copy on the last stage
    return StageParams(layers=n_layers, layer_params=lp, embedding=embedding, head=head)


def params_total(cfg: Config, tp: Optional[int] = None) -> int:
    """Unique parameters of the model as instantiated at tp (vocab padded to a multiple of tp).

    With tp=1 and V already a multiple of tp this is the model's true size; the tied copy on the
    last pipeline stage is not counted (it is the same parameter)."""
    m = cfg.model
    t = tp if tp is not None else cfg.parallel.tp
    h = m.hidden_size
    lp = layer_params(cfg, tp=1).total
    total = m.num_layers * lp + padded_vocab(m.vocab_size, t) * h + _norm_params(cfg)
    if m.position == "learned":
        total += m.seq_length * h
    if not m.tie_embeddings:
        total += padded_vocab(m.vocab_size, t) * h
    return total


def narayanan_params(L: int, h: int, V: int, s: int) -> float:
    """Narayanan et al. 2021, eq. for GPT with learned positions and tied embeddings."""
    return 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


# --------------------------------------------------------------------------------------------------
# Model states (weights, grads, optimizer) per rank
# --------------------------------------------------------------------------------------------------


def model_state_bytes(n: int, precision: str, zero: int, dp: int) -> Dict[str, int]:
    """Bytes of weights, grads and optimizer for n local parameters (docs/CONTRACTS.md, exact).

    zero=1 pads the flat buffer to a multiple of dp: grads ceil(n/dp)*dp*g, optimizer ceil(n/dp)*K."""
    w = n * PARAM_BYTES[precision]
    g = GRAD_BYTES[precision]
    k = OPTIMIZER_BYTES[precision]
    if zero == 1:
        shard = -(-n // dp)
        return {"weights": w, "grads": shard * dp * g, "optimizer": shard * k}
    return {"weights": w, "grads": n * g, "optimizer": n * k}


def model_state_bytes_per_param(precision: str, zero: int, dp: int) -> float:
    """The published bytes/param (ZeRO: fp16 4 + 12/d; Megatron: bf16 6 + 12/d, fp32 8 + 8/d)."""
    g, k = GRAD_BYTES[precision], OPTIMIZER_BYTES[precision]
    return PARAM_BYTES[precision] + g + (k / dp if zero == 1 else k)


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceProfile:
    """What the kernels of one device save for backward, per element (the activation estimator's knobs)."""

    act_bytes: int = 2
    """Bytes per saved activation element (2 for bf16/fp16, 4 for fp32)."""
    mask_bytes: int = 1
    """Bytes per saved dropout-mask element (CUDA: 1 bool byte; CPU: a full-dtype mask)."""
    flash_saves_lse: bool = True
    """Fused attention saves a logsumexp per (token, head) in fp32 instead of the s x s scores."""
    norm_stats: bool = True
    """Norms save fp32 statistics per token: LayerNorm mean and rstd, RMSNorm rstd."""
    stats_bytes: int = 4
    """Bytes per statistics / logsumexp element."""
    logits_bytes: int = 4
    """Bytes per element of the logits kept for the cross-entropy backward (fp32 softmax)."""
    flash_with_dropout: bool = True
    """Fused attention supports attention dropout; if not, dropout > 0 falls back to the math path."""


# Korthikanti et al. 2022's accounting: 16-bit activations, 1-byte masks, nothing else.
KORTHIKANTI = DeviceProfile(act_bytes=2, mask_bytes=1, flash_saves_lse=False, norm_stats=False)


def device_profile(cfg: Config) -> DeviceProfile:
    """The profile the planner uses for this run's device and precision (measured: notes/torch-cpu-gloo.md)."""
    act = PARAM_BYTES[cfg.train.precision]
    if cfg.cluster.device == "cpu":
        return DeviceProfile(act_bytes=act, mask_bytes=act, flash_with_dropout=False)
    return DeviceProfile(act_bytes=act, mask_bytes=1)


def effective_attention(cfg: Config, profile: DeviceProfile) -> str:
    """flash unless the device's fused kernel cannot do attention dropout."""
    m = cfg.model
    if m.attention == "flash" and m.dropout > 0 and not profile.flash_with_dropout:
        return "math"
    return m.attention


def layer_activation_bytes(
    cfg: Config, profile: DeviceProfile = KORTHIKANTI, micro_batch: Optional[int] = None
) -> int:
    """Bytes one layer saves for backward for one micro-batch on one tp rank.

    Saved tensors (elements; t = tp, t_sp = tp under sp else 1; f the FFN width; hd = h/a):
      norm inputs 2 x sbh/t_sp; QKV input sbh/t_sp; Q sb a hd/t; K, V sb k hd/t each (k = query groups
      for flash, a for math: the math path expands K/V to every head before the matmuls); core-attention
      output sbh/t; fc1 input sbh/t_sp; gelu: fc1 output and fc2 input sbf/t each (swiglu: 2sbf/t + sbf/t);
      math attention: softmax output a s^2 b/t, plus with dropout its mask and the dropout output;
      flash: a logsumexp a s b/t (if the profile says so); dropout > 0: masks of the attention-output and
      MLP-output dropouts sbh/t_sp each; norm statistics (profile).
    With the KORTHIKANTI profile and a GPT layer (gelu, f = 4h, math, dropout) this is exactly Table 2:
    sbh(34 + 5as/h) etc.; the general dense count is sbh(18 + 4f/h) + 5as^2b.
    Recompute: selective drops the core-attention internals (s^2 terms, logsumexp); full keeps only the
    layer input, 2sbh/t_sp at 16 bits.
    """
    m, par = cfg.model, cfg.parallel
    s = m.seq_length // par.cp
    b = micro_batch if micro_batch is not None else par.micro_batch
    h, a, g, f = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn
    t = par.tp
    t_sp = t if par.sp else 1
    hd = h // a
    sb = s * b
    ab, mb, stb = profile.act_bytes, profile.mask_bytes, profile.stats_bytes
    if par.recompute == "full":
        return sb * h * ab // t_sp
    attention = effective_attention(cfg, profile)
    dropout = m.dropout > 0
    kv_heads = g if attention == "flash" else a
    # Activations replicated over tp unless sp (norm inputs, QKV and fc1 inputs) and sharded by tp.
    act = 4 * sb * h // t_sp
    act += sb * (a * hd + 2 * kv_heads * hd + a * hd) // t
    act += sb * (3 * f if m.activation == "swiglu" else 2 * f) // t
    total = act * ab
    if dropout:
        total += 2 * (sb * h // t_sp) * mb
    if profile.norm_stats:
        stats_per_norm = 1 if m.norm == "rmsnorm" else 2
        total += 2 * stats_per_norm * (sb // t_sp) * stb
    if par.recompute == "none":
        if attention == "math":
            scores = a * s * s * b // t
            total += scores * ab
            if dropout:
                total += scores * (mb + ab)
        elif profile.flash_saves_lse:
            total += a * sb // t * stb
    return total


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int, setting: str) -> Fraction:
    """The six closed forms of Korthikanti et al. 2022 Table 2 (bytes per layer), exact, for the tests."""
    F = Fraction
    if setting == "none":
        return s * b * h * (34 + F(5 * a * s, h))
    if setting == "tp":
        return s * b * h * (10 + F(24, t) + F(5 * a * s, h * t))
    if setting == "tp_sp":
        return F(s * b * h, t) * (34 + F(5 * a * s, h))
    if setting == "tp_selective":
        return s * b * h * (10 + F(24, t))
    if setting == "tp_sp_selective":
        return F(34 * s * b * h, t)
    if setting == "full":
        return F(2 * s * b * h)
    raise ValueError(setting)


def inflight_microbatches(cfg: Config, stage: int, m: int) -> float:
    """Micro-batches (in units of this rank's L/pp layers) whose activations stage holds at its peak.

    gpipe: all m. 1f1b: min(m, p - stage) (first stage: p; Korthikanti's L x per-layer, times m/p
    when m < p). interleaved: Megatron's warm-up of (p - stage - 1)*2 + (v - 1)*p chunk micro-batches
    plus one, each of L/(p v) layers, capped at the m v there are; the first stage's factor is
    p (1 + (p - 1)/(p v))."""
    par = cfg.parallel
    p, v = par.pp, par.vpp
    if par.schedule == "gpipe":
        return float(m)
    if par.schedule == "interleaved_1f1b" and v > 1:
        chunks = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p - stage))


def stage_activation_bytes(cfg: Config, stage: int, m: int, profile: DeviceProfile) -> int:
    """Activation bytes of one rank of pipeline stage `stage` at its peak (layers + embedding + logits)."""
    mc, par = cfg.model, cfg.parallel
    s = mc.seq_length // par.cp
    sb = s * par.micro_batch
    h = mc.hidden_size
    t = par.tp
    t_sp = t if par.sp else 1
    n_layers = mc.num_layers // par.pp
    inflight = inflight_microbatches(cfg, stage, m)
    per_mb = n_layers * layer_activation_bytes(cfg, profile)
    if stage == 0 and mc.dropout > 0:
        per_mb += sb * h // t_sp * profile.mask_bytes  # embedding dropout mask
    total = per_mb * inflight
    if stage == par.pp - 1:
        # Final norm input (+ stats), output-layer input, fp32 logits for the cross entropy. The last
        # stage finishes each micro-batch's backward right after its forward, except under gpipe.
        last = 2 * (sb * h // t_sp) * profile.act_bytes
        if profile.norm_stats:
            last += (1 if mc.norm == "rmsnorm" else 2) * (sb // t_sp) * profile.stats_bytes
        last += sb * padded_vocab(mc.vocab_size, t) // t * profile.logits_bytes
        total += last * (m if par.schedule == "gpipe" else 1)
    return int(math.ceil(total))


# --------------------------------------------------------------------------------------------------
# FLOPs, bubble, communication
# --------------------------------------------------------------------------------------------------


def _forward_flops_per_token(cfg: Config) -> Dict[str, int]:
    """Forward GEMM FLOPs per token: layers' weight GEMMs, attention scores (QK^T and AV), logits."""
    m = cfg.model
    h, a, g, f, s = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn, m.seq_length
    hd = h // a
    fc1 = 2 * f if m.activation == "swiglu" else f
    weights = (a + 2 * g) * hd * h + a * hd * h + fc1 * h + f * h
    return {
        "layers": m.num_layers * 2 * weights,
        "attention": m.num_layers * 4 * s * a * hd,
        "logits": 2 * h * m.vocab_size,
    }


def model_flops_per_step(cfg: Config) -> int:
    """3 x forward GEMMs for B = global batch sequences; for GPT: 72 B s L h^2 (1 + s/(6h) + V/(12 L h))."""
    fw = _forward_flops_per_token(cfg)
    tokens = cfg.parallel.global_batch * cfg.model.seq_length
    return 3 * tokens * (fw["layers"] + fw["attention"] + fw["logits"])


def hardware_flops_per_step(cfg: Config) -> int:
    """Model FLOPs plus recomputation.

    full: one more forward of the layers (not the logits) -> 96 B s L h^2 (1 + s/(6h) + V/(16 L h)).
    selective: Korthikanti et al.'s published 72 B s L h^2 (1 + s/(3h) + V/(12 L h)), i.e. the
    attention-score term counted twice; reproduced as published."""
    fw = _forward_flops_per_token(cfg)
    tokens = cfg.parallel.global_batch * cfg.model.seq_length
    total = model_flops_per_step(cfg)
    if cfg.parallel.recompute == "full":
        total += tokens * (fw["layers"] + fw["attention"])
    elif cfg.parallel.recompute == "selective":
        total += 3 * tokens * fw["attention"]
    return total


def bubble(p: int, m: int, v: int = 1) -> Dict[str, float]:
    """Pipeline bubble: ratio to ideal compute (p-1)/(v m) and idle share of the wall clock (p-1)/(v m + p - 1)."""
    return {"bubble_ratio": (p - 1) / (v * m), "bubble_idle_fraction": (p - 1) / (v * m + p - 1)}


def _ring(n: int, nbytes: float, kind: str) -> float:
    """Bytes one rank sends in a ring collective over n ranks of an nbytes array (nccl-tests factors)."""
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes


def comm_bytes_per_step(cfg: Config, m: int, dp: int, n_local: int) -> Dict[str, int]:
    """Bytes each GPU sends per optimizer step, ring algorithms (worst rank). Returned keys:

    tp: per layer and micro-batch, 2 all-reduces forward and 2 backward of s b h activations (with sp: the
      same volume as all-gathers + reduce-scatters), a third forward pass under full recompute; the
      vocab-parallel embedding (1 fwd all-reduce), output layer (1 bwd all-reduce) and cross entropy
      (3 all-reduces of s b fp32); under sp, one all-reduce of the norm/bias grads per step.
    pp: each micro-batch's activation (fwd) and gradient (bwd) s b h/t_sp per chunk boundary of the rank
      (v sends each way for an interior rank).
    cp: ring attention: (cp-1) K/V chunks forward and twice that (K/V and their grads) backward per layer.
    dp: zero=0 all-reduce of the grads (n g bytes); zero=1 reduce-scatter of the padded grad buffer plus
      all-gather of the updated params.
    embedding: all-reduce of the tied word-embedding grads between the first and last stage (pp > 1).
    """
    mc, par = cfg.model, cfg.parallel
    prec = cfg.train.precision
    ab = PARAM_BYTES[prec]
    g = GRAD_BYTES[prec]
    t, p, v, cp = par.tp, par.pp, (par.vpp if par.schedule == "interleaved_1f1b" else 1), par.cp
    s = mc.seq_length // cp
    sb = s * par.micro_batch
    h = mc.hidden_size
    n_layers = mc.num_layers // p
    act = sb * h * ab
    passes = 3 if par.recompute == "full" else 2
    tp = m * n_layers * passes * 2 * _ring(t, act, "all_reduce")
    tp += m * 2 * _ring(t, act, "all_reduce")  # embedding fwd + output layer bwd
    tp += m * 3 * _ring(t, sb * 4, "all_reduce")
    if par.sp:
        repl = layer_params(cfg).replicated * n_layers
        tp += _ring(t, repl * g, "all_reduce")
    t_sp = t if par.sp else 1
    sends = 0
    if p > 1:
        sends = max((v - (1 if r == p - 1 else 0)) + (v - (1 if r == 0 else 0)) for r in range(p))
    pp = m * sends * sb * h // t_sp * ab
    kv = sb * 2 * mc.query_groups * (h // mc.num_attention_heads) // t * ab
    cpb = m * n_layers * 3 * (cp - 1) * kv if cp > 1 else 0
    if par.zero == 1:
        padded = -(-n_local // dp) * dp
        dpb = _ring(dp, padded * g, "reduce_scatter") + _ring(dp, padded * ab, "all_gather")
    else:
        dpb = _ring(dp, n_local * g, "all_reduce")
    emb = 0
    if p > 1 and mc.tie_embeddings:
        emb = _ring(2, padded_vocab(mc.vocab_size, t) * h // t * g, "all_reduce")
    return {"tp": int(tp), "pp": int(pp), "cp": int(cpb), "dp": int(dpb), "embedding": int(emb)}


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    """Memory of one rank of one pipeline stage."""

    stage: int
    """Pipeline stage (0 = first)."""
    params: int
    """Parameters this rank holds."""
    memory_bytes: Dict[str, int]
    """weights, grads, optimizer, activations, total."""


@dataclass
class Plan:
    """Everything `meshrun action=plan` reports; `to_json()` gives plan.json (DESIGN.md keys first)."""

    world_size: int
    tp: int
    pp: int
    dp: int
    cp: int
    vpp: int
    micro_batch: int
    global_batch: int
    grad_accum: int
    """Micro-batches per step per data-parallel rank (= num_microbatches of each pipeline)."""
    num_microbatches: int
    params_total: int
    params_per_gpu: int
    """Parameters of the worst (highest-memory) rank."""
    memory_bytes: Dict[str, int]
    """Per GPU, worst rank: weights, grads, optimizer, activations, activations_per_layer, total."""
    bubble_ratio: float
    bubble_idle_fraction: float
    model_flops_per_step: int
    hardware_flops_per_step: int
    tokens_per_step: int
    gpu_memory_bytes: int
    fits: bool
    worst_stage: int = 0
    """Pipeline stage of the worst rank."""
    padded_vocab: int = 0
    comm_bytes: Dict[str, int] = field(default_factory=dict)
    """Bytes sent per GPU per step by parallel dimension (see comm_bytes_per_step)."""
    stages: List[StagePlan] = field(default_factory=list)
    """Per-stage memory (every rank of a stage is the same)."""
    precision: str = "fp32"
    activation_profile: Dict[str, object] = field(default_factory=dict)

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_memory_bytes - self.memory_bytes["total"]

    def to_json(self) -> Dict[str, object]:
        d = asdict(self)
        d["headroom_bytes"] = self.headroom_bytes
        return d


def make_plan(cfg: Config, profile: Optional[DeviceProfile] = None) -> Plan:
    """Plan a config that passed the structural checks (sizes positive, divisibility holds)."""
    mc, par = cfg.model, cfg.parallel
    profile = profile or device_profile(cfg)
    dp = derived_dp(cfg)
    world = par.tp * par.pp * par.cp * dp
    m = par.global_batch // (par.micro_batch * dp)
    v = par.vpp if par.schedule == "interleaved_1f1b" else 1
    per_layer = layer_activation_bytes(cfg, profile)
    stages = []
    for st in range(par.pp):
        sp_ = stage_params(cfg, st)
        mem = model_state_bytes(sp_.total, cfg.train.precision, par.zero, dp)
        mem["activations"] = stage_activation_bytes(cfg, st, m, profile)
        mem["total"] = mem["weights"] + mem["grads"] + mem["optimizer"] + mem["activations"]
        stages.append(StagePlan(stage=st, params=sp_.total, memory_bytes=mem))
    worst = max(stages, key=lambda x: x.memory_bytes["total"])
    memory = dict(worst.memory_bytes)
    memory["activations_per_layer"] = per_layer
    gpu_bytes = int(cfg.cluster.gpu_memory_gb * 1e9)
    return Plan(
        world_size=world,
        tp=par.tp,
        pp=par.pp,
        dp=dp,
        cp=par.cp,
        vpp=par.vpp,
        micro_batch=par.micro_batch,
        global_batch=par.global_batch,
        grad_accum=m,
        num_microbatches=m,
        params_total=params_total(cfg),
        params_per_gpu=worst.params,
        memory_bytes={k: memory[k] for k in ("weights", "grads", "optimizer", "activations", "activations_per_layer", "total")},
        **bubble(par.pp, m, v),
        model_flops_per_step=model_flops_per_step(cfg),
        hardware_flops_per_step=hardware_flops_per_step(cfg),
        tokens_per_step=par.global_batch * mc.seq_length,
        gpu_memory_bytes=gpu_bytes,
        fits=memory["total"] <= gpu_bytes,
        worst_stage=worst.stage,
        padded_vocab=padded_vocab(mc.vocab_size, par.tp),
        comm_bytes=comm_bytes_per_step(cfg, m, dp, worst.params),
        stages=stages,
        precision=cfg.train.precision,
        activation_profile=asdict(profile),
    )


def with_parallel(cfg: Config, **changes) -> Config:
    """A copy of cfg with some parallel fields changed (for what-if fixes and tests)."""
    return replace(cfg, parallel=replace(cfg.parallel, **changes))


GIB = 2**30
MIB = 2**20


def fmt_bytes(n: float) -> str:
    """Bytes for display: GiB (2^30) from 0.1 GiB up, MiB (2^20) below; the unit is always printed."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / MIB:.2f} MiB"


def fmt_count(n: float) -> str:
    """Parameter counts for display: B = 1e9, M = 1e6."""
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def format_plan(plan: Plan) -> str:
    """The readable table (memory in GiB = 2^30 bytes or MiB = 2^20, FLOPs in TFLOP = 1e12)."""
    mem = plan.memory_bytes
    rows = [
        ("layout", f"world {plan.world_size} = tp {plan.tp} x pp {plan.pp} x cp {plan.cp} x dp {plan.dp}"
                   + (f", vpp {plan.vpp}" if plan.vpp > 1 else "")),
        ("batch", f"global {plan.global_batch} = micro {plan.micro_batch} x dp {plan.dp} x accum {plan.grad_accum}"),
        ("parameters", f"{fmt_count(plan.params_total)} total, {fmt_count(plan.params_per_gpu)} on the worst GPU"
                       f" (stage {plan.worst_stage}); vocab padded to {plan.padded_vocab}"),
        ("weights", fmt_bytes(mem["weights"])),
        ("grads", fmt_bytes(mem["grads"])),
        ("optimizer", fmt_bytes(mem["optimizer"])),
        ("activations", f"{fmt_bytes(mem['activations'])} ({fmt_bytes(mem['activations_per_layer'])} per layer"
                        " per micro-batch)"),
        ("total / GPU", f"{fmt_bytes(mem['total'])} of {fmt_bytes(plan.gpu_memory_bytes)}, headroom "
                        f"{fmt_bytes(plan.headroom_bytes)} -> " + ("fits" if plan.fits else "DOES NOT FIT")),
        ("bubble", f"{plan.bubble_ratio:.3f} of ideal compute, {100 * plan.bubble_idle_fraction:.1f} % of wall clock idle"),
        ("tokens / step", f"{plan.tokens_per_step}"),
        ("FLOPs / step", f"model {plan.model_flops_per_step / 1e12:.4g} TFLOP, hardware "
                         f"{plan.hardware_flops_per_step / 1e12:.4g} TFLOP (1 TFLOP = 1e12)"),
        ("comm / GPU / step", ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.comm_bytes.items() if v)
                              or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
