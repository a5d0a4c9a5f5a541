"""The plan of one job: memory of the worst rank, bubble, communication, FLOPs, fits or not, and its table.

Pure arithmetic on the typed config (no torch, no Hydra), so a 64-point sweep plans in milliseconds
per point. The counts live in launcher/plan/model_size.py (parameters, FLOPs) and launcher/plan/memory.py
(model states, activations); this module adds the pipeline bubble and communication volume, puts
them together per pipeline stage (make_plan) and formats the table. Units: bytes and element counts
are ints; GiB appear only in display code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from launcher.plan.context_memory import gpu_memory_bytes, optimizer_shard_degree
from launcher.plan.cost_model import Rates, bubble_ratio, cluster_rates, predict
from launcher.plan.fp8 import fp8_cache_bytes, fp8_gathered_elements, saved_bytes_per_layer
from launcher.plan.levers import zero2_dp_bytes, zero3_dp_bytes
from launcher.plan.memory import (
    GRAD_BYTES,
    PARAM_BYTES,
    DeviceProfile,
    device_profile,
    device_reserve_bytes,
    layer_activation_bytes,
    pinned_host_bytes,
    pipeline_message_bytes,
    profile_dict,
    stage_layers_activation_bytes,
    stages_activation_bytes,
)
from launcher.plan.model_size import (
    layer_params,
    padded_vocab,
    rank_layers,
    recomputed_layers_per_rank,
)
from launcher.plan.moe import all_to_all_bytes, expert_dp
from launcher.plan.plan_cache import PlanCache, model_figures
from launcher.plan.stage_states import stage_kinds
from training.contract.config import Config, derived_dp
from training.contract.layout_text import Layout, format_layout
from training.contract.stage_split import SPLIT_KEYS, stage_split

# --------------------------------------------------------------------------------------------------
# Bubble and communication
# --------------------------------------------------------------------------------------------------


def bubble(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> dict[str, float]:
    """Pipeline bubble: ratio to ideal compute ((p-1)/(v m); zb_h1: cost_model.bubble_ratio) and idle share of
    the wall clock, ratio / (1 + ratio) ((p-1)/(v m + p - 1))."""
    ratio = bubble_ratio(p, m, v, schedule)
    return {"bubble_ratio": ratio, "bubble_idle_fraction": ratio / (1.0 + ratio)}


def _ring(n: int, nbytes: float, kind: str) -> float:
    """Bytes one rank sends in a ring collective over n ranks of an nbytes array (nccl-tests factors)."""
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes


def comm_bytes_per_step(cfg: Config, m: int, dp: int, n_local: int, experts_local: int = 0) -> dict[str, int]:
    """Bytes each GPU sends per optimizer step, ring algorithms (worst rank). Returned keys:

    tp: per layer and micro-batch, 2 all-reduces forward and 2 backward of s b h activations (with sp: the
      same volume as all-gathers + reduce-scatters), a third forward pass under full recompute; the
      vocab-parallel embedding (1 fwd all-reduce), output layer (1 bwd all-reduce) and cross entropy
      (3 all-reduces of s b fp32); under sp, one all-reduce of the norm/bias grads per step.
    pp: each micro-batch's activation (fwd) and gradient (bwd) s b h/t_sp per chunk boundary of the rank
      (v sends each way for an interior rank).
    cp: ring attention: (cp-1) K/V chunks forward and twice that (K/V and their grads) backward per layer.
    dp: over the dp x cp ranks: zero=0 all-reduce of the grads (n g bytes); zero=1 reduce-scatter of the padded grad buffer plus
      all-gather of the updated params; zero=2 the reduction once per micro-batch (levers.zero2_dp_bytes).
    embedding: all-reduce of the tied word-embedding grads between the first and last stage (pp > 1).
    ep: mixture of experts over ep > 1: per MoE layer and micro-batch, two all-to-alls forward (tokens to their
      experts' ranks and back), two backward, two more per recomputed forward (launcher/plan/moe.py
      all_to_all_bytes). The experts_local expert parameters of n_local are reduced over the expert-data-parallel
      group (dp x cp / ep ranks) instead of dp x cp, in the "dp" bytes.
    """
    mc, par = cfg.model, cfg.parallel
    prec = cfg.train.precision
    ab = PARAM_BYTES[prec]
    g = GRAD_BYTES[prec]
    t, p, v, cp = par.tp, par.pp, (par.vpp if par.schedule == "interleaved_1f1b" else 1), par.cp
    s = mc.seq_length // cp
    sb = s * par.micro_batch
    h = mc.hidden_size
    n_layers = max(rank_layers(cfg))  # the busiest pipeline rank's (training/contract/stage_split.py)
    act = sb * h * ab
    passes = 2 * n_layers + recomputed_layers_per_rank(cfg)  # layer passes: fwd, bwd, recomputed fwd
    tp = m * passes * 2 * _ring(t, act, "all_reduce")
    tp += m * 2 * _ring(t, act, "all_reduce")  # embedding fwd + output layer bwd
    tp += m * 3 * _ring(t, sb * 4, "all_reduce")
    if par.sp:
        repl = layer_params(cfg).replicated * n_layers
        tp += _ring(t, repl * g, "all_reduce")
    t_sp = t if par.sp else 1
    # The busiest rank's sends per micro-batch: v each way, less one forward on the last stage and one backward
    # on the first. An interior rank (p > 2) sends 2v; with p = 2 each rank sends 2v - 1.
    sends = 0
    if p > 1:
        sends = 2 * v - (1 if p == 2 else 0)
    pp = m * sends * sb * h // t_sp * ab
    kv = sb * 2 * mc.query_groups * (h // mc.num_attention_heads) // t * ab
    cpb = m * n_layers * 3 * (cp - 1) * kv if cp > 1 else 0
    # Grads are reduced, and the distributed optimizer sharded, over dp x cp (the engine's dp_cp group).
    dpc = optimizer_shard_degree(cfg, dp)

    # parallel.fp8_all_gather: the FP8 weights of the busiest rank's layers (and head) gathered at 1 byte.
    f8 = fp8_gathered_elements(cfg)
    f8_dense = f8["layer"] * n_layers + (f8["head"] if p == 1 else 0)

    def dp_traffic(n: int, group: int, fp8_local: int = 0) -> float:
        if par.zero == 3:
            return zero3_dp_bytes(cfg, n, group, m, g, ab, fp8_local)
        if par.zero == 2:
            return zero2_dp_bytes(n, group, m, g, ab)
        if par.zero == 1:
            padded = -(-n // group) * group
            return _ring(group, padded * g, "reduce_scatter") + _ring(group, padded * ab, "all_gather")
        return _ring(group, n * g, "all_reduce")

    dpb = dp_traffic(n_local - experts_local, dpc, f8_dense)
    if experts_local:
        dpb += dp_traffic(experts_local, expert_dp(cfg, dp), f8["experts"] * n_layers)
    epb = m * passes * 2 * all_to_all_bytes(cfg, ab)
    emb = 0.0
    if p > 1 and mc.tie_embeddings:
        emb = _ring(2, padded_vocab(mc.vocab_size, t) * h // t * g, "all_reduce")
    out = {"tp": int(tp), "pp": int(pp), "cp": int(cpb), "dp": int(dpb), "embedding": int(emb)}
    if epb:
        out["ep"] = int(epb)
    return out


# --------------------------------------------------------------------------------------------------
# Predicted step time
# --------------------------------------------------------------------------------------------------


def predict_step_seconds(
    cfg: Config, comm: dict[str, int], params_local: int, rates: Rates | None = None
) -> dict[str, float]:
    """Seconds of one optimizer step, by part, and their sum under "total": launcher/plan/cost_model.py's
    prediction at the given rates (default: the cluster config's, cost_model.cluster_rates)."""
    return predict(cfg, comm, params_local, rates or cluster_rates(cfg))


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    """Memory of one rank of one pipeline stage."""

    stage: int
    """Pipeline stage (0 = first)."""
    layers: int
    """Transformer layers of this pipeline rank, all its chunks (training/contract/stage_split.py)."""
    params: int
    """Parameters this rank holds."""
    memory_bytes: dict[str, int]
    """weights, grads, optimizer, activations, total."""


@dataclass
class Plan:
    """Everything `meshrun action=plan` reports; `to_json()` gives plan.json (docs/USER_CONTRACTS.md keys first)."""

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
    memory_bytes: dict[str, int]
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
    comm_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes sent per GPU per step by parallel dimension (see comm_bytes_per_step)."""
    stages: list[StagePlan] = field(default_factory=list)
    """Per-stage memory (every rank of a stage is the same)."""
    precision: str = "fp32"
    activation_profile: dict[str, object] = field(default_factory=dict)
    predicted_step_s: float = 0.0
    """Predicted seconds per optimizer step (predict_step_seconds): ranks the points of a sweep."""
    predicted_step_parts_s: dict[str, float] = field(default_factory=dict)
    """predicted_step_s by part: compute (recompute included), recompute, bubble, optimizer, tp, cp, pp,
    embedding, dp (launcher/plan/cost_model.py)."""
    tokens_per_s_per_gpu: float = 0.0
    """Predicted training tokens per second per GPU: tokens_per_step / predicted_step_s / world_size."""
    mfu: float = 0.0
    """Predicted model FLOPs utilisation: model_flops_per_step / (predicted_step_s x world_size x peak), the peak
    being cluster.peak_tflops or, when that is 0, the cost model's compute rate (peak_flops)."""
    peak_flops: float = 0.0
    """The per-GPU FLOP/s the mfu is relative to."""
    peak_source: str = ""
    """Where peak_flops comes from: "cluster.peak_tflops" (the hardware's peak: mfu is an MFU), else the cost
    model's own compute rate (launcher/plan/cost_model.py cluster_rates: a default or a measurement), against which
    mfu is only the compute share of the predicted step and is printed as that."""
    device: str = ""
    """cluster.device of the plan (cpu: its "GPU" columns are CPU ranks)."""
    mfu_fp8: float = 0.0
    """train.precision=fp8: the predicted MFU against cluster.peak_tflops_fp8 (mfu stays against the bf16 peak,
    cluster.peak_tflops); 0 when not fp8 or that peak is unknown."""
    peak_flops_fp8: float = 0.0
    """The per-GPU FP8 FLOP/s mfu_fp8 is relative to (0: not fp8, or cluster.peak_tflops_fp8 unset)."""
    reserve_bytes: int = 0
    """GPU memory kept back from model states and activations (CUDA context, NCCL buffers, allocator
    fragmentation: launcher/plan/memory.py device_reserve_bytes; 0 on CPU), plus memory_bytes' param_gather
    (the zero=1/2 all-gather's in-flight chunks, on any device). fits needs total + reserve."""
    params_active: int = 0
    """Parameters one token runs through (model_size.params_active): params_total for a dense model; a mixture
    of experts counts moe_top_k of its num_experts experts per layer."""
    ep: int = 1
    """Expert-parallel degree (parallel.ep; 1 for a dense model)."""
    stage_layers: list[int] = field(default_factory=list)
    """Transformer layers of each virtual stage k = chunk c x pp + pipeline rank r (training/contract/stage_split.py):
    pp x vpp entries, equal under the even split."""
    split: dict[str, object] = field(default_factory=dict)
    """The parallel.* keys that shape the split when any is set (first_stage_layers, last_stage_layers,
    embedding_in_split, loss_in_split); empty for the even split."""

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_memory_bytes - self.memory_bytes["total"] - self.reserve_bytes

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["headroom_bytes"] = self.headroom_bytes
        return d


def make_plan(
    cfg: Config,
    profile: DeviceProfile | None = None,
    rates: Rates | None = None,
    cache: PlanCache | None = None,
) -> Plan:
    """Plan a config that passed the structural checks (sizes positive, divisibility holds); rates: the
    cost model's (default: the cluster config's); cache: the search's PlanCache (launcher/plan/plan_cache.py)."""
    mc, par = cfg.model, cfg.parallel
    profile = profile or device_profile(cfg)
    dp = derived_dp(cfg)
    world = par.tp * par.pp * par.cp * dp
    m = par.global_batch // (par.micro_batch * dp)
    v = par.vpp if par.schedule == "interleaved_1f1b" else 1
    per_layer = layer_activation_bytes(cfg, profile)
    if str(par.recompute) != "full":  # fp8: what its matmuls save beyond bf16's (launcher/plan/fp8.py)
        per_layer += saved_bytes_per_layer(cfg)
    kinds = stage_kinds(cfg, dp) if cache is None else cache.stage_kinds(cfg, dp)
    stages, worst = _stage_plans(cfg, profile, m, per_layer, kinds)
    memory = _worst_memory(cfg, profile, worst, per_layer)
    gpu_bytes = gpu_memory_bytes(cfg)
    figures = model_figures(cfg) if cache is None else cache.model_figures(cfg)
    worst_experts = kinds[(worst.stage == 0, worst.stage == par.pp - 1)].params.experts
    comm = comm_bytes_per_step(cfg, m, dp, worst.params, worst_experts)
    rates = rates or cluster_rates(cfg)
    reserve = device_reserve_bytes(cfg, gpu_bytes)
    split = stage_split(cfg)
    bub = bubble(par.pp, m, v, str(par.schedule))
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
        params_total=figures.params_total,
        params_per_gpu=worst.params,
        memory_bytes=memory,
        bubble_ratio=bub["bubble_ratio"],
        bubble_idle_fraction=bub["bubble_idle_fraction"],
        model_flops_per_step=figures.model_flops_per_step,
        hardware_flops_per_step=figures.hardware_flops_per_step,
        gpu_memory_bytes=gpu_bytes,
        fits=memory["total"] + reserve + memory["param_gather"] <= gpu_bytes,
        reserve_bytes=reserve + memory["param_gather"],
        worst_stage=worst.stage,
        padded_vocab=padded_vocab(mc.vocab_size, par.tp),
        comm_bytes=comm,
        stages=stages,
        precision=cfg.train.precision,
        activation_profile=profile_dict(profile),
        **_speed(cfg, figures.model_flops_per_step, predict_step_seconds(cfg, comm, worst.params, rates), rates, world),
        device=str(cfg.cluster.device),
        params_active=figures.params_active,
        ep=getattr(par, "ep", 1) if mc.num_experts > 0 else 1,
        stage_layers=split.counts() or [mc.num_layers // max(1, par.pp * split.vpp)] * (par.pp * split.vpp),
        split={k: getattr(par, k) for k in SPLIT_KEYS if getattr(par, k)},
    )


def _stage_plans(
    cfg: Config, profile: DeviceProfile, m: int, per_layer: int, kinds: dict
) -> tuple[list[StagePlan], StagePlan]:
    """Every pipeline stage's plan, and the worst (the first of the largest memory total). Each stage's memory is
    its kind's (launcher/plan/stage_states.py: the recommender plans thousands of layouts with pp up to 64 and
    more) with its activations (the micro-batches in flight differ) and total filled in."""
    par = cfg.parallel
    fp8_cache = fp8_cache_bytes(cfg)
    activations = stages_activation_bytes(cfg, m, profile, stage_layers_activation_bytes(cfg, profile, per_layer))
    stages, totals = [], []
    last = par.pp - 1
    for st, act in enumerate(activations):
        kind = kinds[(st == 0, st == last)]
        mem = kind.memory.copy()
        mem["activations"] = act
        mem["fp8_cache"] = fp8_cache
        mem["pipeline_messages"] = messages = pipeline_message_bytes(cfg, st, m)
        mem["total"] = total = kind.model_states + act + mem["zero3_gathered"] + fp8_cache + messages
        stages.append(StagePlan(st, kind.params.layers, kind.params.total, mem))
        totals.append(total)
    worst = stages[totals.index(max(totals))]  # the first of the largest, as max(stages, key=total)
    return stages, worst


def _worst_memory(cfg: Config, profile: DeviceProfile, worst: StagePlan, per_layer: int) -> dict[str, int]:
    """plan.json's memory_bytes: the worst stage's parts, with the per-layer activation figures and the pinned host
    arena beside them."""
    par = cfg.parallel
    memory = dict(worst.memory_bytes)
    memory["activations_per_layer"] = per_layer
    # The norms' fp32 statistics (mean, rstd) within it: Korthikanti et al.'s Table 2 leaves them out, so
    # activations_per_layer minus this is Table 2's figure for a GPT layer (docs/PLATFORM.md).
    memory["activations_per_layer_norm_stats"] = (
        per_layer - layer_activation_bytes(cfg, replace(profile, norm_stats=False)) if profile.norm_stats else 0
    )
    # The same layer as the paper counts it: Table 2's basis, compared with it exactly (tests/launcher/plan/test_plan.py).
    memory["activations_per_layer_paper"] = per_layer - memory["activations_per_layer_norm_stats"]
    # parallel.offload=cpu on a GPU: the arena is one pinned allocation, rounded up to a power of two by torch's
    # host allocator; that is what the node's host memory must hold (training/preflight/node_ops.py).
    pinned = str(cfg.cluster.device) == "cuda" and str(getattr(par, "offload", "none")) == "cpu"
    memory["host_offload_pinned"] = pinned_host_bytes(memory["host_offload"]) if pinned else memory["host_offload"]
    return {
        k: memory[k]
        for k in (
            "weights",
            "grads",
            "optimizer",
            "activations",
            "activations_per_layer",
            "activations_per_layer_norm_stats",
            "activations_per_layer_paper",
            "zero3_gathered",
            "host_offload",
            "host_offload_pinned",
            "nvme_offload",
            "param_gather",
            "fp8_cache",
            "pipeline_messages",
            "total",
        )
    }


def _speed(cfg: Config, model_flops: float, step: dict[str, float], rates: Rates, world: int) -> dict:
    """The plan's speed fields: the predicted step and its parts, tokens per second per GPU, and MFU against the
    peak (cluster.peak_tflops, else the cost model's rate) and, for fp8, against the fp8 peak."""
    tokens = cfg.parallel.global_batch * cfg.model.seq_length
    total = step["total"]
    peak = cfg.cluster.peak_tflops * 1e12 if cfg.cluster.peak_tflops > 0 else rates.flops
    peak_fp8 = cfg.cluster.peak_tflops_fp8 * 1e12 if str(cfg.train.precision) == "fp8" else 0.0
    return {
        "tokens_per_step": tokens,
        "predicted_step_s": total,
        "predicted_step_parts_s": {k: v for k, v in step.items() if k != "total"},
        "tokens_per_s_per_gpu": tokens / total / world if total > 0 and world else 0.0,
        "mfu": model_flops / (total * world * peak) if total > 0 and world and peak else 0.0,
        "peak_flops": peak,
        "peak_source": "cluster.peak_tflops" if cfg.cluster.peak_tflops > 0 else rates.sources.get("flops", ""),
        "mfu_fp8": model_flops / (total * world * peak_fp8) if total > 0 and world and peak_fp8 else 0.0,
        "peak_flops_fp8": peak_fp8,
    }


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


def fmt_seconds(t: float) -> str:
    """Seconds for display: ms below one second."""
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def format_stages(plan: Plan) -> str:
    """Each pipeline rank's layers and memory, consecutive ranks alike merged: "rank 0: 7 layers (3 + 4), 61.2 GiB;
    ranks 1-14: 8 layers, ...". Virtual stages (vpp > 1) show each rank's chunks in parentheses."""
    pp = max(1, plan.pp)
    v = max(1, len(plan.stage_layers) // pp)
    runs: list[list] = []
    for st in plan.stages:
        chunks = [plan.stage_layers[c * pp + st.stage] for c in range(v)] if plan.stage_layers else []
        text = f"{st.layers} layer{'s' if st.layers != 1 else ''}" + (
            f" ({' + '.join(map(str, chunks))})" if v > 1 else ""
        )
        text += f", {fmt_bytes(st.memory_bytes['total'])}"
        if runs and runs[-1][2] == text:
            runs[-1][1] = st.stage
        else:
            runs.append([st.stage, st.stage, text])
    return "; ".join((f"rank {a}" if a == b else f"ranks {a}-{b}") + f": {text}" for a, b, text in runs)


def _throughput(plan: Plan) -> str:
    """Tokens/s and MFU; without the hardware's peak (cluster.peak_tflops) the ratio is only the compute share of
    the predicted step at the cost model's own rate, and says so (on CPU that rate is an uncalibrated default
    unless measured: `action=recommend recommend.calibrate=true`)."""
    unit = "rank" if plan.device == "cpu" else "GPU"
    rate = f"{plan.peak_flops / 1e12:.4g} TFLOP/s per {unit}"
    if plan.peak_source == "cluster.peak_tflops":
        return f"{plan.tokens_per_s_per_gpu:.4g} tokens/s per {unit}, MFU {100 * plan.mfu:.1f} % (of {rate})"
    basis = "uncalibrated" if plan.peak_source.startswith("default") else plan.peak_source or "assumed"
    return (
        f"{plan.tokens_per_s_per_gpu:.4g} tokens/s per {unit} (compute at {rate}, {basis}); MFU unknown without "
        f"cluster.peak_tflops: compute is {100 * plan.mfu:.1f} % of the predicted step"
    )


def format_plan(plan: Plan) -> str:
    """The readable table (memory in GiB = 2^30 bytes or MiB = 2^20, FLOPs in TFLOP = 1e12)."""
    mem = plan.memory_bytes
    uneven = bool(plan.split) or len(set(plan.stage_layers)) > 1
    rows = [
        (
            "layout",
            format_layout(Layout(tp=plan.tp, pp=plan.pp, cp=plan.cp, dp=plan.dp, vpp=plan.vpp, ep=plan.ep), "world"),
        ),
        ("batch", f"global {plan.global_batch} = micro {plan.micro_batch} x dp {plan.dp} x accum {plan.grad_accum}"),
        (
            "parameters",
            f"{fmt_count(plan.params_total)} total, "
            + (f"{fmt_count(plan.params_active)} active per token, " if plan.params_active != plan.params_total else "")
            + f"{fmt_count(plan.params_per_gpu)} on the worst GPU"
            f" (stage {plan.worst_stage}); vocab padded to {plan.padded_vocab}",
        ),
        *(
            [
                (
                    "stage split",
                    " ".join(f"parallel.{k}={str(v).lower()}" for k, v in plan.split.items()) or "even",
                ),
                ("stages", format_stages(plan)),
            ]
            if uneven
            else []
        ),
        ("weights", fmt_bytes(mem["weights"])),
        ("grads", fmt_bytes(mem["grads"])),
        ("optimizer", fmt_bytes(mem["optimizer"])),
        (
            "activations",
            f"{fmt_bytes(mem['activations'])} ({fmt_bytes(mem['activations_per_layer'])} per layer per micro-batch"
            + (
                f"; {fmt_bytes(mem['activations_per_layer_paper'])} without the norms' fp32 mean/rstd,"
                " Korthikanti et al.'s Table 2 basis)"
                if mem.get("activations_per_layer_norm_stats")
                else ")"
            ),
        ),
        *[
            (label, fmt_bytes(mem[key]))
            for key, label in (
                ("zero3_gathered", "zero=3 gathered"),
                ("host_offload", "host (offload)"),
                ("nvme_offload", "nvme (offload)"),
                ("param_gather", "zero=1/2 param gather"),
                ("pipeline_messages", "pipeline messages"),
            )
            if mem.get(key)
        ],
        (
            "total / GPU",
            f"{fmt_bytes(mem['total'])} of {fmt_bytes(plan.gpu_memory_bytes)}, headroom "
            f"{fmt_bytes(plan.headroom_bytes)} -> " + ("fits" if plan.fits else "DOES NOT FIT"),
        ),
        (
            "bubble",
            f"{plan.bubble_ratio:.3f} of ideal compute, {100 * plan.bubble_idle_fraction:.1f} % of wall clock idle",
        ),
        ("tokens / step", f"{plan.tokens_per_step}"),
        (
            "FLOPs / step",
            f"model {plan.model_flops_per_step / 1e12:.4g} TFLOP, hardware "
            f"{plan.hardware_flops_per_step / 1e12:.4g} TFLOP (1 TFLOP = 1e12)",
        ),
        ("comm / GPU / step", ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.comm_bytes.items() if v) or "none"),
        (
            "step (predicted)",
            f"{fmt_seconds(plan.predicted_step_s)}: "
            + ", ".join(
                f"{'of which ' if k == 'recompute' else ''}{k} {fmt_seconds(v)}"
                for k, v in plan.predicted_step_parts_s.items()
                if v
            ),
        ),
        (
            "throughput",
            _throughput(plan)
            + (
                f", {100 * plan.mfu_fp8:.1f} % of the FP8 peak ({plan.peak_flops_fp8 / 1e12:.4g} TFLOP/s)"
                if plan.peak_flops_fp8
                else ""
            ),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
