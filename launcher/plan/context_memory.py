"""The planner's context-parallel and device-capacity rules, kept apart from the memory tables (pure Python).

- Device memory: `cluster.gpu_memory_gb` is read as GiB (2^30 bytes), the unit nvidia-smi and the CUDA
  allocator report; the cluster presets carry each part's usable capacity (docs/PLATFORM.md, *Device memory*).
- The distributed optimizer (zero >= 1) shards over dp x cp: cp ranks hold the same parameters, so the
  engine reduces the grads and shards the fp32 masters and Adam moments over the dp_cp group
  (training/optim/optimizer.py), as Megatron-LM does.
"""

from __future__ import annotations

from training.contract.config import Config

GIB = 2**30
MIB = 2**20


def gpu_memory_bytes(cfg: Config) -> int:
    """Bytes of one accelerator: cluster.gpu_memory_gb GiB."""
    return int(round(cfg.cluster.gpu_memory_gb * GIB))


def optimizer_shard_degree(cfg: Config, dp: int) -> int:
    """Ranks the distributed optimizer shards over: dp x cp."""
    return dp * max(1, cfg.parallel.cp)


LONG_SEQUENCE = 4096
"""From this sequence length on, validate's no-fit fixes offer context parallelism for activation-bound layouts."""


def activation_bound(memory_bytes) -> bool:
    """Activations are the largest part of a rank's memory (more than weights, grads or optimizer state alone)."""
    return memory_bytes["activations"] > max(memory_bytes[k] for k in ("weights", "grads", "optimizer"))


def more_cp(c: Config, derived_dp: int, memory_bytes) -> Config | None:
    """cp x 2 with dp / 2 (the same ranks): each rank holds half of every sequence's activations. Offered for
    activation-bound layouts at long sequences, when the engine can run it (the cp layout rules hold)."""
    from dataclasses import replace

    from training.contract.layout_rules import cp_rules

    par, m = c.parallel, c.model
    cp2 = par.cp * 2
    if m.seq_length < LONG_SEQUENCE or derived_dp % 2 or not activation_bound(memory_bytes):
        return None
    if cp_rules(cp2, m.seq_length, par.tp, par.sp, m.dropout, getattr(par, "cp_comm", "ring")):
        return None
    new = replace(c, parallel=replace(par, cp=cp2, dp=(derived_dp // 2) if par.dp is not None else None))
    unit = new.parallel.micro_batch * (derived_dp // 2)
    return new if new.parallel.global_batch % unit == 0 else None


MAX_SEARCH_CP = 8
"""The largest cp `action=recommend` tries (powers of two)."""


def search_cp(c: Config, tp: int, sp: bool, ranks_left: int) -> list:
    """The cp values `action=recommend` tries for a tp (x sp) and the ranks left after tp x pp: 1, and at long
    sequences (from LONG_SEQUENCE tokens, where activations dominate) the powers of two up to MAX_SEARCH_CP that
    divide those ranks and that the engine runs (the cp layout rules)."""
    from training.contract.layout_rules import cp_rules

    out = [1]
    m = c.model
    if m.seq_length < LONG_SEQUENCE:
        return out
    cp = 2
    while cp <= MAX_SEARCH_CP and ranks_left % cp == 0:
        if not cp_rules(cp, m.seq_length, tp, sp, m.dropout, getattr(c.parallel, "cp_comm", "ring")):
            out.append(cp)
        cp *= 2
    return out
