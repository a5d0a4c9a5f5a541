"""Memory per GPU: model states (weights, grads, optimizer) and activations saved for backward (pure Python).

Model states follow docs/CONTRACTS.md exactly (the engine's own report must equal them); the ZeRO
paper's and Megatron's bytes/param tables are special cases. Activations count what each kernel saves
for backward under sp, recompute, flash-vs-math attention and the pipeline schedule's in-flight
micro-batches; with the KORTHIKANTI profile they are Korthikanti et al. 2022 Table 2, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

from launcher.plan.levers import zero_bytes_per_param, zero_state_bytes
from launcher.plan.model_size import padded_vocab, rank_chunk_layers, rank_layers, recomputed_layers_per_rank
from launcher.plan.moe import is_moe, moe_activation_elements
from training.contract.config import Config, derived_dp
from training.contract.layout_rules import sequence_parallel_on

# Bytes per parameter: weights, gradients (fp32 main grads for bf16), optimizer (K); the engine allocates
# from the same table.
from training.contract.precision import GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES

# --------------------------------------------------------------------------------------------------
# Model states (weights, grads, optimizer) per rank
# --------------------------------------------------------------------------------------------------


def model_state_bytes(n: int, precision: str, zero: int, dp: int) -> dict[str, int]:
    """Bytes of weights, grads and optimizer for n local parameters (docs/CONTRACTS.md, exact).

    zero=1 pads the flat buffer to a multiple of dp: grads ceil(n/dp)*dp*g, optimizer ceil(n/dp)*K.
    zero=2: launcher/plan/levers.py."""
    if zero >= 2:
        return zero_state_bytes(n, precision, zero, dp)
    w = n * PARAM_BYTES[precision]
    g = GRAD_BYTES[precision]
    k = OPTIMIZER_BYTES[precision]
    if zero == 1:
        shard = -(-n // dp)
        return {"weights": w, "grads": shard * dp * g, "optimizer": shard * k}
    return {"weights": w, "grads": n * g, "optimizer": n * k}


def model_state_bytes_per_param(precision: str, zero: int, dp: int) -> float:
    """The published bytes/param (ZeRO: fp16 4 + 12/d; Megatron: bf16 6 + 12/d, fp32 8 + 8/d)."""
    if zero >= 2:
        return zero_bytes_per_param(precision, zero, dp)
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
    """Bytes per saved dropout-mask element (the engine's: 1 bool byte on every device)."""
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
    softmax_fp32: bool = False
    """Math attention's softmax runs in fp32 and saves its fp32 output (training/model/gpt.py); at 16 bits the
    cast copy the next matmul (or the dropout) takes is saved besides it."""


@lru_cache(maxsize=16)
def _profile_items(profile: DeviceProfile) -> tuple[tuple[str, object], ...]:
    return tuple(asdict(profile).items())


def profile_dict(profile: DeviceProfile) -> dict[str, object]:
    """asdict(profile), a new dict each call (plan.json's activation_profile). The profile is frozen and its
    fields are plain numbers and flags, so one asdict per profile serves every plan of a search."""
    return dict(_profile_items(profile))


# Korthikanti et al. 2022's accounting: 16-bit activations, 1-byte masks, nothing else.
KORTHIKANTI = DeviceProfile(act_bytes=2, mask_bytes=1, flash_saves_lse=False, norm_stats=False)


def device_profile(cfg: Config) -> DeviceProfile:
    """The profile the planner uses for this run's device and precision (measured: docs/PLATFORM.md)."""
    return _device_profile(PARAM_BYTES[cfg.train.precision], cfg.cluster.device == "cpu")


@lru_cache(maxsize=16)  # one frozen profile per (bytes, device), shared by every plan of a search
def _device_profile(act: int, cpu: bool) -> DeviceProfile:
    # The model's dropout saves its 1-byte boolean mask and math attention's softmax only its output in the
    # activation dtype (training/model/dropout_softmax.py), on every device: Korthikanti's accounting.
    if cpu:
        return DeviceProfile(act_bytes=act, mask_bytes=1, flash_with_dropout=False)
    return DeviceProfile(act_bytes=act, mask_bytes=1)


def effective_attention(cfg: Config, profile: DeviceProfile) -> str:
    """flash unless the device's fused kernel cannot do attention dropout."""
    m = cfg.model
    if m.attention == "flash" and m.dropout > 0 and not profile.flash_with_dropout:
        return "math"
    return m.attention


def layer_activation_bytes(
    cfg: Config,
    profile: DeviceProfile = KORTHIKANTI,
    micro_batch: int | None = None,
    recompute: str | None = None,
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
    layer input, 2sbh/t_sp at 16 bits. recompute: in place of parallel.recompute (a layer that keeps its
    activations under partial recompute) without copying the config.
    """
    m, par = cfg.model, cfg.parallel
    s = m.seq_length // par.cp
    b = micro_batch if micro_batch is not None else par.micro_batch
    recompute = par.recompute if recompute is None else recompute
    h, a, g, f = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn
    t = par.tp
    t_sp = t if par.sp else 1
    hd = h // a
    sb = s * b
    ab, mb, stb = profile.act_bytes, profile.mask_bytes, profile.stats_bytes
    if recompute == "full":
        return sb * h * ab // t_sp
    attention = effective_attention(cfg, profile)
    dropout = m.dropout > 0
    kv_heads = g if attention == "flash" else a
    # Activations replicated over tp unless sp (norm inputs, QKV and fc1 inputs) and sharded by tp.
    act = 4 * sb * h // t_sp
    act += sb * (a * hd + 2 * kv_heads * hd + a * hd) // t
    moe_fp32 = moe_int64 = 0
    if is_moe(cfg):  # the experts' k copies of every token in place of the dense MLP (launcher/plan/moe.py)
        moe = moe_activation_elements(cfg, sb, t)  # every tp rank routes the whole micro-batch, sp or not
        act += moe["act"]
        moe_fp32, moe_int64 = moe["fp32"], moe["int64"]
    else:
        act += sb * (3 * f if m.activation == "swiglu" else 2 * f) // t
    total = act * ab + moe_fp32 * 4 + moe_int64 * 8
    if dropout:
        total += 2 * (sb * h // t_sp) * mb
    if profile.norm_stats:
        stats_per_norm = 1 if m.norm == "rmsnorm" else 2
        total += 2 * stats_per_norm * (sb // t_sp) * stb
    if recompute == "none":
        if attention == "math":
            scores = a * s * s * b // t
            if profile.softmax_fp32:
                total += scores * 4  # the fp32 softmax output (the probabilities themselves at fp32)
                if dropout:
                    total += scores * (mb + ab)  # the mask and the dropout output
                elif ab != 4:
                    total += scores * ab  # the 16-bit cast of the probabilities
            else:
                total += scores * ab
                if dropout:
                    total += scores * (mb + ab)
        elif profile.flash_saves_lse:
            total += a * sb // t * stb
    return total


def inflight_microbatches(cfg: Config, stage: int, m: int) -> float:
    """Micro-batches (in units of this rank's L/pp layers) whose activations stage holds at its peak.

    gpipe: all m. 1f1b: min(m, p - stage) (first stage: p; Korthikanti's L x per-layer, times m/p
    when m < p). interleaved: Megatron's warm-up of (p - stage - 1)*2 + (v - 1)*p chunk micro-batches
    plus one, each of L/(p v) layers, capped at the m v there are (with parallel.microbatch_group_size g: (v - 1) g
    instead of (v - 1) p); the first stage's factor is p (1 + (p - 1)/(p v)). zb_h1: min(m, p) on every stage (rank
    r defers the weight-grad pass of r micro-batches, whose graphs it keeps: training/schedules/pipeline.py)."""
    return stages_inflight_microbatches(cfg, [stage], m)[0]


def stages_inflight_microbatches(cfg: Config, stages: Iterable[int], m: int) -> list[float]:
    """inflight_microbatches of each of `stages` (make_plan takes every stage's)."""
    par = cfg.parallel
    p, v = par.pp, par.vpp
    if par.schedule == "gpipe":
        return [float(m) for _ in stages]
    if par.schedule == "interleaved_1f1b" and v > 1:
        g = getattr(par, "microbatch_group_size", 0) or p
        return [min(m * v, (p - stage - 1) * 2 + (v - 1) * g + 1) / v for stage in stages]
    if par.schedule == "zb_h1":
        return [float(min(m, p)) for _ in stages]
    return [float(min(m, p - stage)) for stage in stages]


def stage_layers_activation_bytes(
    cfg: Config, profile: DeviceProfile, per_layer: int | None = None, stage: int | None = None
) -> int:
    """Bytes the layers of one rank (pipeline rank `stage`; default: the one with the most layers,
    model_size.rank_layers) save for one micro-batch: with recompute=full and recompute_num_layers = N > 0, the
    first N layers of each chunk keep only their input and the others everything (launcher/plan/levers.py counts
    them). per_layer: layer_activation_bytes(cfg, profile) when the caller has it."""
    ranks = rank_layers(cfg)
    st = ranks.index(max(ranks)) if stage is None else stage
    n_layers = ranks[st]
    redo = recomputed_layers_per_rank(cfg, st)
    per_layer = layer_activation_bytes(cfg, profile) if per_layer is None else per_layer
    if str(cfg.parallel.recompute) != "full" or redo == n_layers:
        return n_layers * per_layer
    return redo * per_layer + (n_layers - redo) * layer_activation_bytes(cfg, profile, recompute="none")


def stage_activation_bytes(
    cfg: Config, stage: int, m: int, profile: DeviceProfile, layers_per_mb: int | None = None
) -> int:
    """Activation bytes of one rank of pipeline stage `stage` at its peak (layers + embedding + logits);
    layers_per_mb: stage_layers_activation_bytes(cfg, profile) when the caller has it (with the even split the
    same for every stage; an uneven split scales it by each stage's layers, stages_activation_bytes)."""
    return stages_activation_bytes(cfg, m, profile, layers_per_mb, [stage])[0]


def stages_activation_bytes(
    cfg: Config,
    m: int,
    profile: DeviceProfile,
    layers_per_mb: int | None = None,
    stages: Sequence[int] | None = None,
) -> list[int]:
    """stage_activation_bytes of each of `stages` (default: every pipeline stage). What does not depend on the
    stage is worked out once: a plan needs every stage's figure, and the recommender plans thousands of layouts
    with up to 64 and more stages."""
    mc, par = cfg.model, cfg.parallel
    s = mc.seq_length // par.cp
    sb = s * par.micro_batch
    h = mc.hidden_size
    t = par.tp
    t_sp = t if par.sp else 1
    layers = stage_layers_activation_bytes(cfg, profile) if layers_per_mb is None else layers_per_mb
    # An uneven split (training/contract/stage_split.py): each stage's layers, the given figure being the busiest
    # stage's (stage_layers_activation_bytes' default) and each layer's bytes the same at every stage.
    ranks = rank_layers(cfg)
    uneven = min(ranks) != max(ranks)
    per_stage: dict[int, float] = {}
    if uneven:
        per_layer = None if str(par.recompute) != "full" else layer_activation_bytes(cfg, profile)
        for st in set(range(par.pp) if stages is None else stages):
            if str(par.recompute) == "full":
                per_stage[st] = stage_layers_activation_bytes(cfg, profile, per_layer, st)
            else:
                per_stage[st] = layers * ranks[st] // max(ranks)
    chosen = list(range(par.pp) if stages is None else stages)
    inflights = stages_inflight_microbatches(cfg, chosen, m)
    v = par.vpp if par.schedule == "interleaved_1f1b" and par.pp > 1 else 1
    same_per_layer = str(par.recompute) != "full" or not getattr(par, "recompute_num_layers", 0)
    if v > 1 and same_per_layer:
        # Chunks of one rank with different layers (embedding/loss_in_split): the interleaved order holds more
        # micro-batches of the early chunks, so the peak is counted chunk by chunk (_interleaved_peak_layers).
        g = getattr(par, "microbatch_group_size", 0) or par.pp
        for st, inflight in zip(chosen, inflights):
            chunks = rank_chunk_layers(cfg, st)
            if len(set(chunks)) > 1 and inflight > 0 and ranks[st]:
                per_layer_bytes = per_stage.get(st, layers * ranks[st] / max(ranks)) / ranks[st]
                peak = _interleaved_peak_layers(chunks, par.pp, st, m, g)
                per_stage[st] = peak * per_layer_bytes / inflight
    embedding = sb * h // t_sp * profile.mask_bytes if mc.dropout > 0 else 0  # embedding dropout mask
    # Final norm input (+ stats), output-layer input, fp32 logits for the cross entropy. The last
    # stage finishes each micro-batch's backward right after its forward, except under gpipe.
    last = 2 * (sb * h // t_sp) * profile.act_bytes
    if profile.norm_stats:
        last += (1 if mc.norm == "rmsnorm" else 2) * (sb // t_sp) * profile.stats_bytes
    last += sb * padded_vocab(mc.vocab_size, t) // t * profile.logits_bytes
    # zb_h1's last stage keeps the graphs of the micro-batches whose weight-grad pass it deferred, logits included.
    last *= m if par.schedule == "gpipe" else (min(m, par.pp) if par.schedule == "zb_h1" else 1)
    out = []
    for stage, inflight in zip(chosen, inflights):
        total = (per_stage.get(stage, layers) + (embedding if stage == 0 else 0)) * inflight
        if stage == par.pp - 1:
            total += last
        out.append(int(math.ceil(total)))
    return out


def _interleaved_peak_layers(chunks: Sequence[int], p: int, r: int, m: int, g: int) -> int:
    """The most layer x micro-batch activations rank r of an interleaved pipeline holds at once when its chunks hold
    `chunks` layers: Megatron's order (forward i runs chunk (i mod g v) // g, backward j chunk v - 1 - that; a
    warm-up of (p - r - 1) x 2 + (v - 1) x g forwards, then a forward and a backward each). With equal chunks this
    is stages_inflight_microbatches' count times the rank's layers."""
    v = len(chunks)
    total = m * v
    warm = min(total, (p - r - 1) * 2 + (v - 1) * g)
    live = sum(chunks[(i % (g * v)) // g] for i in range(warm))
    peak = live
    for j, i in enumerate(range(warm, total)):
        live += chunks[(i % (g * v)) // g]
        peak = max(peak, live)
        live -= chunks[v - 1 - (j % (g * v)) // g]
    return peak


def pipeline_message_count(cfg: Config, stage: int, m: int) -> int:
    """Outgoing pipeline messages pipeline rank `stage` still holds at its peak (docs/FORMULAS.md, Pipeline messages
    in flight). Without parallel.overlap_p2p every send is waited for in its exchange: none. On NCCL torch coalesces
    an exchange into one work the engine waits for whole, so only an exchange of one send is left in flight, until
    the rank has received a message sent after its peer posted the receive (training/rehearse/messages.py derives
    the same counts from the schedule's exchanges). On gloo no send is known complete before the step's end: every
    send of the step. Interleaved with micro-batch groups other than pp: that bound too."""
    par = cfg.parallel
    p, r = par.pp, stage
    v = par.vpp if par.schedule == "interleaved_1f1b" else 1
    if p < 2 or not getattr(par, "overlap_p2p", True):
        return 0
    group = getattr(par, "microbatch_group_size", 0) or p
    if str(cfg.cluster.device) != "cuda" or (par.schedule == "interleaved_1f1b" and group != p):
        return m * (2 * v - (r == 0) - (r == p - 1))
    if m < 2:
        return 0  # the one micro-batch's messages travel in exchanges with a receive
    if par.schedule == "gpipe":
        return m - 1 if r in (0, p - 1) else 1
    if r == 0:  # the warm-up's forwards each send alone; the first backward's grad tells it they arrived
        return min(p - 1, m - 1)
    if par.schedule == "zb_h1":
        return max(1, min(p - r, m - r))
    return 1  # the last backward's grad, sent alone and never acknowledged within the step


def pipeline_message_bytes(cfg: Config, stage: int, m: int) -> int:
    """pipeline_message_count messages of [s / cp (/ tp under sp), micro_batch, hidden] in the weights' dtype
    (training/schedules/pipeline.py p2p_shape)."""
    par = cfg.parallel
    s = cfg.model.seq_length // max(1, par.cp)
    if sequence_parallel_on(par.sp, par.tp):
        s //= par.tp
    message = s * par.micro_batch * cfg.model.hidden_size * PARAM_BYTES[cfg.train.precision]
    return pipeline_message_count(cfg, stage, m) * message


def pinned_host_bytes(nbytes: int) -> int:
    """Host bytes one pinned allocation of nbytes takes: torch's CachingHostAllocator rounds every request up
    to a power of two (its pinned_max_round_threshold is unlimited by default), e.g. 406 MB takes 512 MiB."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


# What a CUDA rank holds besides the allocator's tensors, and what the caching allocator reserves above what
# it has allocated: estimates until the first GPU run measures them (docs/PLATFORM.md, "Not verified on a GPU").
CUDA_CONTEXT_BYTES = 2**30
"""CUDA context, cuBLAS / cuDNN workspaces and kernel images of one rank."""
NCCL_COMM_BYTES = 2**28
"""Buffers of one NCCL communicator on one GPU (channels x peers x NCCL_BUFFSIZE, with its default 4 MiB)."""
FRAGMENTATION = 0.03
"""Share of the GPU's memory the caching allocator reserves but cannot hand out (fragmentation). Bounded by a
published fact: NVIDIA's Llama-3 8B layout (tp1 cp2, BF16, 8 x H100 80 GB) runs in production, and its plan
(75.13 GiB of 79.65) leaves 4.52 GiB for the whole reserve, which 5 % would exceed (docs/PLATFORM.md)."""


def device_reserve_bytes(cfg: Config, gpu_bytes: int) -> int:
    """Memory of one GPU that neither the model states nor the activations can use (0 on CPU): the plan's
    `fits` compares model states + activations + this against the GPU's memory."""
    if cfg.cluster.device != "cuda":
        return 0
    par = cfg.parallel
    comms = sum(1 for size in (par.tp, par.pp, par.cp, derived_dp(cfg)) if size > 1)
    comms += 1 if cfg.model.num_experts > 0 and getattr(par, "ep", 1) > 1 else 0  # the ep all-to-all group
    return CUDA_CONTEXT_BYTES + comms * NCCL_COMM_BYTES + int(FRAGMENTATION * gpu_bytes)


def param_gather_bytes(cfg: Config, n: int, dp: int) -> int:
    """Bytes the zero=1/2 all-gather of the updated shards holds at most, for n local parameters sharded over
    dp ranks (training/optim/param_gather.py): the chunks in flight at once, each a receive buffer of dp
    pieces and a send copy of one, in the weights' dtype, bounded by PARAM_GATHER_INFLIGHT_BYTES. It lives
    from the optimizer step into the next forward, beside the activations. 0 without that gather (zero 0
    or 3, dp 1)."""
    from training.contract.precision import param_gather_chunk_elems, param_gather_inflight_chunks

    zero, precision = cfg.parallel.zero, cfg.train.precision
    if zero not in (1, 2) or dp <= 1:
        return 0
    width = param_gather_chunk_elems(precision, cfg.parallel.bucket_mb, dp)
    per_rank = -(-n // dp)
    chunks = -(-per_rank // width)
    inflight = min(chunks, param_gather_inflight_chunks(precision, cfg.parallel.bucket_mb, dp))
    return inflight * (dp + 1) * width * PARAM_BYTES[precision]


def reserved_check(plan: dict, reserved: int) -> dict[str, object]:
    """A run's peak reserved bytes (the CUDA caching allocator's max_memory_reserved: allocated plus what
    fragmentation keeps) against its plan.json: within_plan when they stay within the plan's total and
    param_gather plus its fragmentation share (FRAGMENTATION of the GPU), within_device when, with the rest
    of the reserve (CUDA context, NCCL buffers), they fit the GPU. `fits` counts allocated bytes; this is what the device gives."""
    gather = int(plan["memory_bytes"].get("param_gather", 0))  # allocator memory too: in `reserved`
    gpu, total = int(plan["gpu_memory_bytes"]), int(plan["memory_bytes"]["total"]) + gather
    fragmentation = int(FRAGMENTATION * gpu)
    rest = max(0, int(plan.get("reserve_bytes", 0)) - gather - fragmentation)
    return {
        "reserved": reserved,
        "plan_limit": total + fragmentation,
        "device_limit": gpu - rest,
        "within_plan": reserved <= total + fragmentation,
        "within_device": reserved + rest <= gpu,
    }
