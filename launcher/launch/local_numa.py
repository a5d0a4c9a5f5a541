"""NUMA binding of local ranks, as Slurm ranks are bound (launcher/slurm/rank_task.py): the same choice of node
(launcher/slurm/numa.py: the GPU's NUMA node, a contiguous spread on CPU, or cluster.numa_map) and the same
`numactl --cpunodebind=N --membind=N` prefix. No torch.

cluster.numa=auto on a machine with one NUMA node (and no GPU) binds nothing: every rank would get node 0,
which is where it runs anyway."""

from __future__ import annotations

import os
import shutil
import sys

from launcher.slurm.numa import choose_node, numa_nodes, numactl_prefix
from training.contract.config import Config


def local_binding(
    cfg: Config, local_rank: int, local_world: int, sysfs_nodes: str = "/sys/devices/system/node"
) -> int | None:
    """The NUMA node a local rank binds to, or None (numa=off, or auto with nothing to choose between)."""
    c = cfg.cluster
    if c.numa == "off":
        return None
    if c.numa == "auto" and c.device != "cuda" and len(numa_nodes(sysfs_nodes)) < 2:
        return None
    return choose_node(
        c.numa,
        c.numa_map,
        c.device,
        local_rank,
        local_world,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        sysfs_nodes=sysfs_nodes,
    )


def rank_prefix(
    cfg: Config, local_rank: int, local_world: int, sysfs_nodes: str = "/sys/devices/system/node"
) -> tuple[list[str], int | None]:
    """(command prefix, NUMA node) of one local rank; a warning on stderr when numactl is missing."""
    node = local_binding(cfg, local_rank, local_world, sysfs_nodes)
    if node is None:
        return [], None
    if not shutil.which("numactl"):
        if local_rank == 0:
            print(
                "warning: numactl not found: local ranks are not NUMA-bound (install numactl or set cluster.numa=off)",
                file=sys.stderr,
            )
        return [], None
    return numactl_prefix(node), node
