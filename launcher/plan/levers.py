"""The planner's memory levers beyond ZeRO-1: ZeRO-2 (sharded main grads) and partial recomputation
(pure Python, no torch).

Kept apart from memory.py / estimate.py so that the formulas of each lever sit in one place; those modules
call in here when a config uses a lever. Bytes follow the engine's allocations exactly (training/optim/
grad_shard.py, training/model/gpt.py) and docs/FORMULAS.md gives the published forms (ZeRO paper, Megatron).
"""

from __future__ import annotations

from training.contract.config import Config
from training.contract.layout_rules import ZERO_STAGES as ENGINE_ZERO_STAGES  # the planner accepts exactly these
from training.contract.precision import GRAD_BYTES, OFFLOAD_BLOCK_ELEMS, OPTIMIZER_BYTES, PARAM_BYTES


def zero_state_bytes(n: int, precision: str, zero: int, dp: int) -> dict[str, int]:
    """Weights, grads and optimizer bytes of n local parameters at zero >= 2 (exact, the engine's buffers).

    zero=2: the flat layout is padded to S x dp, S = ceil(n/dp); this rank keeps the full weights, the
    shard of main grads (S g) and the shard of optimizer state (S K). Staging of in-flight buckets is
    transient (bounded by parallel.bucket_mb, docs/FORMULAS.md) and not held between steps.
    zero=3: the weights too are only the shard, S w (the units gathered for compute: zero3_gathered_bytes)."""
    if zero not in (2, 3):
        raise ValueError(f"zero={zero}: the engine runs ZeRO stages {ENGINE_ZERO_STAGES}")
    shard = -(-n // dp)
    weights = (shard if zero == 3 else n) * PARAM_BYTES[precision]
    return {"weights": weights, "grads": shard * GRAD_BYTES[precision], "optimizer": shard * OPTIMIZER_BYTES[precision]}


def zero3_units(cfg: Config, stage: int) -> list[int]:
    """Elements of each zero=3 gather unit of one rank of pipeline stage `stage` (training/model/gpt.py's
    param_units: the embedding, each layer, the final norm with the output layer)."""
    from launcher.plan.model_size import layer_params, padded_vocab, stage_params

    m, par = cfg.model, cfg.parallel
    sp_ = stage_params(cfg, stage)
    word = padded_vocab(m.vocab_size, par.tp) * m.hidden_size // par.tp
    units = [layer_params(cfg).total] * sp_.layers
    if stage == 0:
        units.append(word + (m.seq_length * m.hidden_size if m.position == "learned" else 0))
    if stage == par.pp - 1:
        units.append(sp_.head + (word if m.tie_embeddings else 0))  # the head reads the (tied) word embedding
    return units


def zero3_gathered_bytes(cfg: Config, stage: int) -> int:
    """Peak bytes of gathered parameters at zero=3 on one rank of `stage` (an upper bound, beside the shard).

    Resharding after forward (the default), one model chunk whose micro-batches run forward then backward
    each (pp = 1): two neighbouring units at once (training/optim/zero3.py: a
    unit's pre-hook prefetches the next and its post-hook releases it; in backward a unit's hook releases the
    one after it before prefetching the one before it; the output layer's unit, kept from its forward to its
    backward, is the last of the chain), so the largest sum of two neighbours; with evaluations (forward only,
    between steps) the output layer's unit stays gathered into the next step's forward, beside two. Under a
    pipeline schedule (forwards and backwards of different micro-batches interleave; a 1F1B stage was
    measured holding three: tests/engine/test_zero_levers.py) at most three: the one computing, the next one
    prefetched and a kept one. Without resharding,
    every unit stays gathered from forward to backward: the stage's whole weights."""
    units = zero3_unit_bytes(cfg, stage)
    if not getattr(cfg.parallel, "zero3_reshard_after_forward", True):
        from launcher.plan.model_size import stage_params

        w = PARAM_BYTES[cfg.train.precision]
        return stage_params(cfg, stage).total * w - sum(u * w for u in zero3_units(cfg, stage)) + sum(units)
    par = cfg.parallel
    if len(units) >= 2 and par.pp == 1 and getattr(par, "vpp", 1) <= 1:
        chain = _forward_order(cfg, stage, units)
        peak = max(a + b for a, b in zip(chain, chain[1:]))
        if cfg.train.eval_every > 0 and stage == par.pp - 1:  # an evaluation keeps the head's unit to the step
            rest = chain[:-1]
            peak = max(peak, chain[-1] + max([a + b for a, b in zip(rest, rest[1:])] or rest))
        return peak
    return sum(sorted(units, reverse=True)[:3])


def _forward_order(cfg: Config, stage: int, units: list[int]) -> list[int]:
    """zero3_units' figures in the chunk's forward order (param_units: the embedding, the layers, the head's
    unit); zero3_units lists the layers first."""
    layers = len(units) - (stage == 0) - (stage == cfg.parallel.pp - 1)
    chain = units[:layers]
    if stage == 0:
        chain = [units[layers]] + chain
    if stage == cfg.parallel.pp - 1:
        chain = chain + [units[-1]]
    return chain


def zero3_unit_bytes(cfg: Config, stage: int) -> list[int]:
    """Bytes of each zero=3 gather unit of one rank of `stage` as gathered: the model dtype, except the FP8
    weights under parallel.fp8_all_gather at 1 byte (launcher/plan/fp8.py fp8_gathered_elements)."""
    from launcher.plan.fp8 import fp8_gathered_elements
    from launcher.plan.model_size import stage_params

    w = PARAM_BYTES[cfg.train.precision]
    units = zero3_units(cfg, stage)
    f8 = fp8_gathered_elements(cfg)
    layers = stage_params(cfg, stage).layers
    per_layer = f8["layer"] + f8["experts"]
    out = [u * w - (per_layer * (w - 1) if k < layers else 0) for k, u in enumerate(units)]
    if stage == cfg.parallel.pp - 1 and f8["head"]:
        out[-1] -= f8["head"] * (w - 1)
    return out


def zero_bytes_per_param(precision: str, zero: int, dp: int) -> float:
    """Published bytes/param by ZeRO stage (Rajbhandari et al. 2020, Psi = params, K = optimizer bytes):
    stage 2: w + (g + K)/dp; stage 3: (w + g + K)/dp (fp16: 2 + 14/dp and 16/dp). Stage 3's gathered units
    are extra (zero3_gathered_bytes)."""
    w, g, k = PARAM_BYTES[precision], GRAD_BYTES[precision], OPTIMIZER_BYTES[precision]
    if zero == 2:
        return w + (g + k) / dp
    if zero == 3:
        return (w + g + k) / dp
    raise ValueError(f"zero={zero}: stages 2 and 3 only (memory.model_state_bytes_per_param has 0 and 1)")


def zero3_dp_bytes(
    cfg: Config, n_local: int, dp: int, m: int, grad_bytes: int, param_bytes: int, fp8_local: int = 0
) -> float:
    """Bytes one rank sends per step at zero=3: zero=2's grad reductions, and instead of the all-gather of the
    updated shards, the parameters gathered for every micro-batch's forward and again for its backward
    (2 m all-gathers; with zero3_reshard_after_forward=false, once per micro-batch). At m = 1 and g = w this
    is the ZeRO paper's 1.5x of an all-reduce (3 (dp-1)/dp of the parameters against 2 (dp-1)/dp).
    fp8_local of the n_local elements are FP8 weights gathered in float8 (parallel.fp8_all_gather): 1 byte each."""
    if dp <= 1:
        return 0.0
    padded = -(-n_local // dp) * dp
    gathers = 2 if getattr(cfg.parallel, "zero3_reshard_after_forward", True) else 1
    gathered = padded * param_bytes - fp8_local * (param_bytes - 1)
    return m * (dp - 1) / dp * (padded * grad_bytes + gathers * gathered)


def zero2_dp_bytes(n_local: int, dp: int, m: int, grad_bytes: int, param_bytes: int) -> float:
    """Bytes one rank sends per step at zero=2: the padded grads reduced to their owners once per
    micro-batch (the reduce-scatter's volume, (dp-1)/dp of the buffer, m times: the full-size grads are never
    held through the accumulation), then the updated shards all-gathered once."""
    if dp <= 1:
        return 0.0
    padded = -(-n_local // dp) * dp
    return m * (dp - 1) / dp * padded * grad_bytes + (dp - 1) / dp * padded * param_bytes


def search_zero_stages(dp: int) -> list[int]:
    """The ZeRO stages action=recommend tries at dp data-parallel ranks (one stage when there is nothing to
    shard)."""
    return list(ENGINE_ZERO_STAGES) if dp > 1 else [0]


def search_recompute(chunk: int) -> list[tuple[str, int]]:
    """(recompute, recompute_num_layers) pairs action=recommend tries for chunks of `chunk` layers: none,
    selective, full on every layer, and full on the first 1 and half of the layers of each chunk."""
    out = [("none", 0), ("selective", 0), ("full", 0)]
    for n in sorted({1, chunk // 2}):
        if 0 < n < chunk:
            out.append(("full", n))
    return out


def offload_bytes(cfg: Config, n: int, dp: int) -> dict[str, int]:
    """Optimizer bytes on the device, in host memory and in files for n local parameters under
    parallel.offload (the engine's allocations, training/optim/adamw.py and offload.py).

    The state is K bytes per element of this rank's shard (S = ceil(n/dp) at zero >= 1, else n); offloaded,
    the update runs where the state lives, so a master copy goes with it even for fp32 weights unless they
    are in host memory already (a CPU rank). cpu: all of it in one host arena (pinned on a GPU rank; a CPU
    rank keeps an arena of its own, the same path); nvme: all of it in files, and
    host memory holds one block buffer of min(OFFLOAD_BLOCK_ELEMS, S) fp32 elements per state tensor."""
    par, precision = cfg.parallel, cfg.train.precision
    shard = -(-n // dp) if par.zero >= 1 else n
    offload = str(getattr(par, "offload", "none"))
    if offload == "none":
        return {"optimizer": shard * OPTIMIZER_BYTES[precision], "host_offload": 0, "nvme_offload": 0}
    on_host = cfg.cluster.device == "cpu"
    master = precision != "fp32" or not on_host
    if offload == "cpu":  # the host arena (on a CPU rank too: it stands for the pinned memory)
        return {"optimizer": 0, "host_offload": shard * (8 + (4 if master else 0)), "nvme_offload": 0}
    states = 3 if master else 2
    return {
        "optimizer": 0,
        "host_offload": states * 4 * min(OFFLOAD_BLOCK_ELEMS, shard),
        "nvme_offload": states * 4 * shard,
    }


HOST_LINK_GBPS = 25.0
"""Device <-> host copy rate assumed for offload=cpu/nvme on GPUs (PCIe 4.0 x16, GB/s; docs/COST_MODEL.md)."""
NVME_GBPS = 3.0
"""Read and write rate of the node-local drive assumed for offload=nvme (GB/s; docs/COST_MODEL.md)."""
HOST_OPTIMIZER_S_PER_PARAM = 5e-9
"""Seconds of the Adam update per parameter on one host core (as the CPU rate in cost_model.py)."""


def offload_seconds(cfg: Config, n: int, dp: int) -> float:
    """Seconds one step spends on the offloaded optimizer (0 without offload): the update on the host, the
    grads down and the weights up over the host link (GPU ranks), and for nvme the state read and written
    once. Nothing is assumed to overlap (as everywhere in the cost model)."""
    par = cfg.parallel
    offload = str(getattr(par, "offload", "none"))
    if offload == "none":
        return 0.0
    shard = -(-n // dp) if par.zero >= 1 else n
    seconds = shard * HOST_OPTIMIZER_S_PER_PARAM
    if cfg.cluster.device != "cpu":
        seconds += shard * (GRAD_BYTES[cfg.train.precision] + PARAM_BYTES[cfg.train.precision]) / (HOST_LINK_GBPS * 1e9)
    if offload == "nvme":
        seconds += 2 * offload_bytes(cfg, n, dp)["nvme_offload"] / (NVME_GBPS * 1e9)
    return seconds
