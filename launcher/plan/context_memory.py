"""The planner's context-parallel and device-capacity rules, kept apart from the memory tables (pure Python).

- Device memory: `cluster.gpu_memory_gb` is read as GiB (2^30 bytes), the unit nvidia-smi and the CUDA
  allocator report; the cluster presets carry each part's usable capacity (docs/PLATFORM.md, *Device memory*).
- The distributed optimizer (zero >= 1) shards over dp x cp: cp ranks hold the same parameters, so the
  engine reduces the grads and shards the fp32 masters and Adam moments over the dp_cp group
  (training/optim/optimizer.py), as Megatron-LM does.
"""

from __future__ import annotations

from training.config import Config

GIB = 2**30
MIB = 2**20

# Usable memory of common parts, MiB, as nvidia-smi reports it (docs/PLATFORM.md, *Device memory*).
USABLE_MIB = {
    "H100 80GB": 81_559,
    "A100 80GB": 81_920,
    "A100 40GB": 40_960,
}


def gpu_memory_bytes(cfg: Config) -> int:
    """Bytes of one accelerator: cluster.gpu_memory_gb GiB."""
    return int(round(cfg.cluster.gpu_memory_gb * GIB))


def optimizer_shard_degree(cfg: Config, dp: int) -> int:
    """Ranks the distributed optimizer shards over: dp x cp."""
    return dp * max(1, cfg.parallel.cp)
