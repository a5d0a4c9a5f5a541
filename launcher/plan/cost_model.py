"""Predicted seconds of one optimizer step of a layout: compute, pipeline bubble, communication, optimizer.

Pure Python (no torch): `meshrun action=recommend` ranks thousands of layouts with it in seconds, and every
plan's predicted_step_s comes from it. The rates (Rates) come from, best first: a measurement on this machine
(training/observe/cost_probe.py, CPU clusters), a preflight.json's measured matmul and bus bandwidths, the cluster
preset's expected ones (cluster.preflight.matmul_tflops, busbw_intra_gbps, busbw_inter_gbps), its peak
(cluster.peak_tflops), and last the defaults below. docs/COST_MODEL.md gives the formulas and their limits.
The communication the engine overlaps with compute (overlap_hidden_s) is taken off the step as the negative
part "overlapped".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher.plan.fp8 import fp8_rate_ratio, logits_rate, weight_gemm_seconds
from launcher.plan.levers import offload_seconds
from launcher.plan.model_size import padded_vocab, rank_layers, recomputed_layers_per_rank
from launcher.plan.moe import ep_degree, expert_ffn, is_moe, router_params
from training.contract.config import Config, derived_dp


def bubble_ratio(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Pipeline idle time over the ideal compute of one step: (p - 1)/(v m) for gpipe, 1f1b and interleaved (any
    micro-batch group); zb_h1 with a forward, an input-grad and a weight-grad pass of one unit each (the backward
    is two forwards): (p - 1)/(3 m) for m >= p (Qi et al. 2024, section 3.1: (p - 1)(T_F + T_B - T_W) idle beside
    m (T_F + T_B + T_W)); for m < p the last micro-batch's chains and one W pace it: 2 (p + m - 1) + 1 - 3 m
    (docs/FORMULAS.md; training/schedules/pipeline.py planned_idle_share is the same for any pass times)."""
    if p <= 1:
        return 0.0
    if schedule == "zb_h1":
        work = 3.0 * m
        return max(work + (p - 1), 2.0 * (p + m - 1) + 1) / work - 1.0
    return (p - 1) / (v * m)


DEFAULT_PEAK_TFLOPS = {"cpu": 0.05, "cuda": 100.0}
"""Per-rank TFLOP/s when neither a measurement nor cluster.peak_tflops / preflight.matmul_tflops gives one."""
DEFAULT_BUSBW_GBPS = {"cpu": (2.0, 1.0), "cuda": (200.0, 100.0)}
"""(inside a node, across nodes with every rank of each node taking part) all-reduce bus bandwidth in GB/s when
neither a preflight nor the cluster preset gives one (assumptions: docs/COST_MODEL.md)."""
DEFAULT_LATENCY_S = {"cpu": 5e-4, "cuda": 2e-5}
"""Seconds of one collective or point-to-point call beyond its bytes (assumptions; CPU: measured by the probe)."""
DEFAULT_OVERHEAD_S = {"cpu": 0.0, "cuda": 0.0}
"""Fixed seconds per layer forward + backward per micro-batch (operator dispatch): 0 unless measured (the probe
measures it on CPU; GPUs hide it behind the kernels of large micro-batches)."""
DEFAULT_OPTIMIZER_S_PER_PARAM = {"cpu": 5e-9, "cuda": 1.2e-11}
"""Seconds of the Adam update per local parameter: about 24 bytes touched at 5 GB/s (a CPU core) or 2 TB/s (HBM)."""

OVERLAP_EFFICIENCY = {"cpu": 0.5, "cuda": 0.25}
"""Share of a compute window that a background transfer can fill. GPUs: NCCL runs on its own stream, but its
kernels take SMs and memory bandwidth from the compute they overlap, and the dp and tp traffic of a node share its
links; 0.25 is the largest of 1, 0.5, 0.25 at which the published layouts (tests/launcher/recommend/test_recommend.py) stay within
10 % of the recommended ones (docs/COST_MODEL.md). CPU: gloo's threads take the cores the compute uses (an
assumption)."""


@dataclass
class Rates:
    """What one rank computes and moves per second."""

    flops: float
    """Per-rank FLOP/s of the transformer layers' work (matmuls and what comes with them)."""
    intra_bw: float
    """All-reduce bus bandwidth inside a node, bytes/s (nccl-tests' busbw: bytes one rank sends per second)."""
    inter_bw: float
    """The same across nodes when every rank of each node takes part (NCCL spreads rings over all NICs)."""
    latency_s: float
    """Seconds per collective or send beyond its bytes."""
    overhead_s: float
    """Fixed seconds per layer forward + backward per micro-batch."""
    optimizer_s_per_param: float
    """Seconds of the optimizer update per parameter this rank updates."""
    cores: float = 0.0
    """How many of the job's ranks compute at full speed at once (the probe's measurement on CPU, where ranks can
    outnumber the cores or share them with other work); 0: every rank (a GPU each). flops, overhead_s and
    optimizer_s_per_param are rates with every rank computing at once (shared_cores_s)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each rate came from."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _device(cfg: Config) -> str:
    return cfg.cluster.device if cfg.cluster.device in DEFAULT_PEAK_TFLOPS else "cuda"


def preflight_measured(report: dict[str, Any]) -> dict[str, float]:
    """Median measured matmul TFLOP/s and all-reduce busbw (GB/s) inside and across nodes of a preflight.json."""
    mm: list[float] = []
    intra: list[float] = []
    inter: list[float] = []
    for c in report.get("checks", []):
        found = c.get("found")
        if c.get("name") in ("gpu.matmul", "gpu.straggler") and isinstance(found, (int, float)):
            mm.append(float(found))
        elif c.get("name") == "coll.all_reduce" and isinstance(found, dict) and "busbw_gbps" in found:
            (intra if c.get("node") else inter).append(float(found["busbw_gbps"]))
    out = {}
    for key, values in (("matmul_tflops", mm), ("busbw_intra_gbps", intra), ("busbw_inter_gbps", inter)):
        if values:
            out[key] = statistics.median(values)
    return out


NIC_BUSBW_EFFICIENCY = 0.9
"""All-reduce bus bandwidth across nodes over a node's NICs' line rate: NCCL spreads its rings over every NIC and
reaches about 90 % of their sum (conf/cluster/dgx_a100.yaml: 8 x 200 Gb/s HDR = 200 GB/s per node, 180 busbw)."""


def nic_busbw_gbps(cfg: Config) -> float:
    """The node's NICs as inter-node bus bandwidth, GB/s: len(cluster.preflight.ib_hcas) x ib_rate_gbps (Gb/s) / 8 x
    NIC_BUSBW_EFFICIENCY (dgx_h100: 8 x 400 Gb/s NDR = 400 GB/s -> 360); 0 on CPU or without both keys."""
    pf = cfg.cluster.preflight
    if cfg.cluster.device == "cpu" or not pf.ib_hcas or not pf.ib_rate_gbps > 0:
        return 0.0
    return len(pf.ib_hcas) * pf.ib_rate_gbps / 8.0 * NIC_BUSBW_EFFICIENCY


def cluster_rates(cfg: Config, preflight: dict[str, Any] | None = None, probe: dict[str, Any] | None = None) -> Rates:
    """The rates of cfg's cluster; `preflight` is a preflight.json dict, `probe` training/observe/cost_probe.py's output."""
    c, dev = cfg.cluster, _device(cfg)
    measured = preflight_measured(preflight) if preflight else {}
    src: dict[str, str] = {}

    def pick(name: str, options) -> float:
        for value, where in options:
            if value and value > 0:
                src[name] = where
                return float(value)
        raise AssertionError("the last option is a default")

    probe = probe or {}
    flops = pick(
        "flops",
        [
            (probe.get("flops"), "measured here (training/observe/cost_probe.py)"),
            ((measured.get("matmul_tflops") or 0) * 1e12, "preflight.json matmul"),
            (c.preflight.matmul_tflops * 1e12, "cluster.preflight.matmul_tflops"),
            (c.peak_tflops * 1e12, "cluster.peak_tflops"),
            (DEFAULT_PEAK_TFLOPS[dev] * 1e12, f"default for {dev}"),
        ],
    )
    intra_d, inter_d = DEFAULT_BUSBW_GBPS[dev]
    intra = pick(
        "intra_bw",
        [
            (probe.get("busbw"), "measured here (training/observe/cost_probe.py)"),
            ((measured.get("busbw_intra_gbps") or 0) * 1e9, "preflight.json busbw inside a node"),
            (c.preflight.busbw_intra_gbps * 1e9, "cluster.preflight.busbw_intra_gbps"),
            (intra_d * 1e9, f"default for {dev}"),
        ],
    )
    inter = pick(
        "inter_bw",
        [
            ((measured.get("busbw_inter_gbps") or 0) * 1e9, "preflight.json busbw across nodes"),
            (c.preflight.busbw_inter_gbps * 1e9, "cluster.preflight.busbw_inter_gbps"),
            (nic_busbw_gbps(cfg) * 1e9, "cluster.preflight.ib_hcas x ib_rate_gbps"),
            # The dev cluster's "nodes" share this machine: the probe's loopback figure holds.
            (probe.get("busbw") if c.device == "cpu" else 0, "measured here (training/observe/cost_probe.py)"),
            (inter_d * 1e9, f"default for {dev}"),
        ],
    )
    latency = pick(
        "latency_s",
        [
            (probe.get("latency_s"), "measured here (training/observe/cost_probe.py)"),
            (DEFAULT_LATENCY_S[dev], f"default for {dev}"),
        ],
    )
    overhead = pick(
        "overhead_s",
        [
            (probe.get("overhead_s"), "measured here (training/observe/cost_probe.py)"),
            (DEFAULT_OVERHEAD_S[dev] or 1e-30, f"default for {dev}"),
        ],
    )
    opt = pick(
        "optimizer_s_per_param",
        [
            (probe.get("optimizer_s_per_param"), "measured here (training/observe/cost_probe.py)"),
            (DEFAULT_OPTIMIZER_S_PER_PARAM[dev], f"default for {dev}"),
        ],
    )
    cores = float(probe.get("cores") or 0.0)
    if cores > 0:
        src["cores"] = "measured here (training/observe/cost_probe.py)"
    return Rates(
        cores=cores,
        flops=flops,
        intra_bw=intra,
        inter_bw=inter,
        latency_s=latency,
        overhead_s=overhead,
        optimizer_s_per_param=opt,
        sources=src,
    )


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


def group_bandwidth(stride: int, size: int, gpus_per_node: int, rates: Rates) -> float | None:
    """Bus bandwidth of a group of `size` ranks `stride` apart (training/parallel/mesh.py's order: tp fastest, then cp,
    pp, dp); None for a group of one. Inside a node: intra_bw. Across nodes, a group with k of a node's
    gpus_per_node ranks gets k/gpus_per_node of the node's network (inter_bw is measured with all of them)."""
    if size <= 1:
        return None
    if stride * size <= gpus_per_node:
        return rates.intra_bw
    k = max(1, gpus_per_node // stride) if stride < gpus_per_node else 1
    return min(rates.intra_bw, rates.inter_bw * min(k, size) / gpus_per_node)


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    return size > 1 and stride * size > gpus_per_node


def _layer_forward_flops(cfg: Config) -> dict[str, float]:
    """Forward FLOPs of one layer for one micro-batch on one tp rank: weight GEMMs and the attention core."""
    m, par = cfg.model, cfg.parallel
    h, a, g, f = m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn
    s = m.seq_length // par.cp
    hd = h // a
    fc1 = 2 * f if m.activation == "swiglu" else f
    tokens = s * par.micro_batch
    weights = 2 * tokens * ((a + 2 * g) * hd * h + a * hd * h + fc1 * h + f * h) / par.tp
    if is_moe(cfg):  # the router, and k experts per token (balanced over the ep ranks: k tokens' worth each)
        fe = expert_ffn(m)
        expert = (3 if m.activation == "swiglu" else 2) * fe * h
        weights = 2 * tokens * (((a + 2 * g) * hd * h + a * hd * h + m.moe_top_k * expert) / par.tp + router_params(m))
    # QK^T and AV over the whole s x s, as launcher/plan/model_size.py counts them (a causal fused kernel skips
    # about half: the measured or configured rate absorbs that).
    attention = 4 * tokens * m.seq_length * a * hd / par.tp
    return {"weights": weights, "attention": attention}


def collective_counts(cfg: Config, m: int, dp: int, grad_bytes: float) -> dict[str, int]:
    """Calls per step per rank by kind (each pays Rates.latency_s): see comm_bytes_per_step for the bytes."""
    mc, par = cfg.model, cfg.parallel
    t, p = par.tp, par.pp
    v = par.vpp if par.schedule == "interleaved_1f1b" else 1
    n_layers = max(rank_layers(cfg))  # the busiest pipeline rank's (training/contract/stage_split.py)
    redo_layers = recomputed_layers_per_rank(cfg)
    out = {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "embedding": 0, "ep": 0}
    if t > 1:
        per_pass = 2 * (2 if par.sp else 1)  # sp: an all-gather and a reduce-scatter per all-reduce
        out["tp"] = m * ((2 * n_layers + redo_layers) * per_pass + 2 + 3) + (1 if par.sp else 0)
    if p > 1:
        out["pp"] = m * 2 * (2 * v - 1)  # sends and receives per micro-batch, an interior rank
        out["embedding"] = 1 if mc.tie_embeddings else 0
    if par.cp > 1:
        out["cp"] = m * n_layers * 3 * (par.cp - 1)
    if ep_degree(cfg) > 1:  # dispatch and combine per layer pass (launcher/plan/estimate.py comm_bytes_per_step)
        out["ep"] = m * (2 * n_layers + redo_layers) * 2
    if dp > 1:
        buckets = max(1, math.ceil(grad_bytes / (par.bucket_mb * 2**20)))
        out["dp"] = buckets * (2 if par.zero >= 1 else 1)
    return out


def predict(cfg: Config, comm: dict[str, int], params_local: int, rates: Rates) -> dict[str, float]:
    """Seconds of one optimizer step by part (compute, recompute, bubble, optimizer, tp, cp, pp, embedding, dp,
    and ep for a mixture of experts over ep > 1: its all-to-alls) and their sum under "total"; comm is comm_bytes_per_step's bytes, params_local the worst rank's parameters.

    compute: the worst pipeline stage's m micro-batches (its layers forward + backward, the output layer and
    cross entropy on the last stage) at rates.flops plus rates.overhead_s per layer pass; recompute: the part
    of that spent recomputing (full: the layers' forward again; selective: the attention core's forward);
    bubble: (p - 1)/(v m) of the stage's compute; each communication part: bytes / the group's bandwidth
    (group_bandwidth) + calls x latency; optimizer: the update of the rank's (ZeRO-1: 1/dp of its) parameters;
    overlapped (overlap_hidden_s) and shared_cores (shared_cores_s, CPU ranks with fewer cores): negative, when
    not zero."""
    mc, par, c = cfg.model, cfg.parallel, cfg.cluster
    dp = derived_dp(cfg)
    m = max(1, par.global_batch // max(1, par.micro_batch * dp))
    v = par.vpp if par.schedule == "interleaved_1f1b" else 1
    fw = _layer_forward_flops(cfg)
    layer_fwd = fw["weights"] + fw["attention"]
    redo = {"full": layer_fwd, "selective": fw["attention"]}.get(str(par.recompute), 0.0)
    redo_overhead = rates.overhead_s / 2 if par.recompute == "full" else 0.0
    # fp8: the FP8 linears' share of the weight GEMMs at the FP8 rate (launcher/plan/fp8.py; 1x when not fp8).
    if fp8_rate_ratio(cfg) == 1.0:
        per_layer = 3 * layer_fwd / rates.flops + rates.overhead_s
    else:
        per_layer = 3 * (weight_gemm_seconds(cfg, fw["weights"], rates.flops) + fw["attention"] / rates.flops)
        per_layer += rates.overhead_s
    tokens = mc.seq_length // par.cp * par.micro_batch
    logits = (
        3 * 2 * tokens * mc.hidden_size * padded_vocab(mc.vocab_size, par.tp) / par.tp / logits_rate(cfg, rates.flops)
    )
    # The slowest pipeline stage paces the pipeline: each stage's layers (training/contract/stage_split.py; the
    # first and last ranks' may differ from the others'), the last one's also the output layer and cross entropy.
    ranks = rank_layers(cfg)
    last_stage = len(ranks) - 1

    def stage_work(st: int) -> tuple:
        n = ranks[st]
        own = m * (n * per_layer + (logits if st == last_stage else 0.0))
        redo_n = n if par.recompute != "full" else recomputed_layers_per_rank(cfg, st)
        again = m * redo_n * (redo / rates.flops + redo_overhead) if redo else 0.0
        return own + again, own, again

    _, compute, recompute = max(stage_work(st) for st in sorted({0, min(1, last_stage), last_stage}))
    compute += recompute
    parts = {
        "compute": compute,
        "recompute": recompute,
        "bubble": compute * bubble_ratio(par.pp, m, v, str(par.schedule)),
    }
    # The dp reduction and the distributed optimizer span dp x cp ranks (the engine's dp_cp group); its reach,
    # which decides the link it runs over, is the dp dimension's when dp > 1, else the cp one's.
    dpc = dp * max(1, par.cp)
    updated = params_local / dpc if (par.zero >= 1 and dpc > 1) else params_local
    parts["optimizer"] = updated * rates.optimizer_s_per_param
    if str(getattr(par, "offload", "none")) != "none":  # the update runs on the host instead
        parts["optimizer"] = offload_seconds(cfg, params_local, dpc)
    counts = collective_counts(cfg, m, dpc, comm.get("dp", 0))
    strides = {
        "tp": (1, par.tp),
        "cp": (par.tp, par.cp),
        "pp": (par.tp * par.cp, par.pp),
        "embedding": (par.tp * par.cp, par.pp),
        "dp": (par.tp * par.cp * par.pp, dp) if dp > 1 else (par.tp, par.cp),
    }
    if ep_degree(cfg) > 1:  # the all-to-all among ep consecutive dp ranks
        strides["ep"] = (par.tp * par.cp * par.pp, ep_degree(cfg))
    for kind, (stride, size) in strides.items():
        bw = group_bandwidth(stride, size, c.gpus_per_node, rates)
        parts[kind] = 0.0 if bw is None else comm.get(kind, 0) / bw + counts[kind] * rates.latency_s
    hidden = overlap_hidden_s(cfg, parts, m, counts)
    if sum(hidden.values()) > 0:
        parts["overlapped"] = -sum(hidden.values())
    mean_compute = compute - (m * logits * (par.pp - 1) / par.pp if par.pp > 1 else 0.0)
    shared = shared_cores_s(parts, mean_compute, par.tp * par.pp * dpc, rates.cores)
    if shared:
        parts["shared_cores"] = shared
    parts["total"] = sum(v_ for k, v_ in parts.items() if k != "recompute")  # recompute is inside compute
    return parts


def shared_cores_s(parts: dict[str, float], mean_compute: float, world: int, cores: float) -> float:
    """The correction when the job's `world` ranks get only `cores` (< world) ranks' worth of CPU at once.

    The rates were measured with every rank computing at once; a rank that computes while its peers wait (a
    pipeline bubble, the other side of a transfer) runs world/cores times faster. Work-conserving CPUs give a
    step of at least the critical path at that faster speed and at least the mean rank's work at the shared
    speed (all ranks' work on `cores` cores; its communication included): max(critical, work), returned as the
    difference from the dedicated-core total (never positive: at most the bubble and the last stage's extra
    work). mean_compute: the mean stage's compute (the last stage alone also runs the output layer). 0 when
    every rank has a core of its own (cores 0 or >= world)."""
    if not 0 < cores < world:
        return 0.0
    busy = parts["compute"] + parts["bubble"] + parts["optimizer"]  # the busy parts at the shared speed
    total = sum(v for k, v in parts.items() if k != "recompute")
    critical = total - busy * (1 - cores / world)
    # The mean rank's work: its compute and optimizer, and its exposed communication (gloo moves the bytes on
    # the same cores; every rank of a collective waits for the slowest).
    work = total - parts["compute"] - parts["bubble"] + mean_compute
    return max(critical, work) - total


def overlap_hidden_s(cfg: Config, parts: dict[str, float], m: int, counts: dict[str, int]) -> dict[str, float]:
    """Seconds of each communication part that the engine hides behind compute, by kind (docs/COST_MODEL.md).

    Windows, per rank (a micro-batch's forward is 1/3 of its compute, its backward 2/3), each scaled by
    OVERLAP_EFFICIENCY; what a window hides is at most the part less its one exposed call (the last bucket, the
    first gather, the last send), which waits at the step's end:
    - dp, zero=0/1 with parallel.overlap_grad_reduce: the grad reduction (zero=1: the reduce half of its bytes)
      runs while the last micro-batch's backward goes on (buckets start once their grads are final);
    - dp, zero=1: the updated shards' all-gather (the other half) runs into the next step's first forward;
    - dp, zero=2: the per-micro-batch reduction overlaps every micro-batch's backward;
    - dp, zero=3: the next unit's parameter gather is prefetched during the current unit's compute (all of it);
    - pp with parallel.overlap_p2p, on CPU (gloo): sends complete behind the next micro-batch's compute;
    - cp: the ring's K/V exchange runs during the attention of the block in hand (the attention's share)."""
    par = cfg.parallel
    stage = parts.get("compute", 0.0)
    if stage <= 0 or m <= 0:
        return {}
    eff = OVERLAP_EFFICIENCY[_device(cfg)]
    per_micro = stage / m
    fwd, bwd = per_micro / 3, 2 * per_micro / 3
    out: dict[str, float] = {}

    def hide(kind: str, seconds: float, calls: int, window: float) -> None:
        if seconds > 0 and window > 0:
            exposed = seconds / max(1, calls)  # the call that can only start (or must end) at the boundary
            out[kind] = out.get(kind, 0.0) + min(seconds - exposed, eff * window)

    dp_s, dp_calls = parts.get("dp", 0.0), counts.get("dp", 0)
    if dp_s > 0:
        if par.zero >= 3:
            hide("dp", dp_s, dp_calls, stage)
        elif par.zero == 2:
            hide("dp", dp_s, dp_calls, m * bwd)
        elif par.overlap_grad_reduce:
            if par.zero == 1:  # reduce-scatter and all-gather: half the bytes and half the calls each
                hide("dp", dp_s / 2, dp_calls // 2, bwd)
                hide("dp", dp_s / 2, dp_calls // 2, fwd)
            else:
                hide("dp", dp_s, dp_calls, bwd)
    if parts.get("pp", 0.0) > 0 and par.overlap_p2p and _device(cfg) == "cpu":
        # gloo: the next exchange's receives are posted early, so the send half completes behind compute. NCCL
        # (training/schedules/pipeline.py): receives are posted at the exchange itself, and a send cannot complete
        # before its receive is posted: counted as not hidden.
        hide("pp", parts["pp"] / 2, counts.get("pp", 0) // 2, stage)
    if parts.get("cp", 0.0) > 0:
        fw = _layer_forward_flops(cfg)
        share = fw["attention"] / max(1.0, fw["weights"] + fw["attention"])
        hide("cp", parts["cp"], counts.get("cp", 0), share * stage)
    return out
