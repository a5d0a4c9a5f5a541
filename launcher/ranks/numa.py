"""The one reader of this machine's NUMA layout: which nodes exist, which node each local rank binds to, and the
numactl prefix that binds it (pure Python). Slurm ranks (launcher/slurm/rank_task.py) and local ranks
(launcher/launch/local.py) bind the same way; the launch gate checks cluster.numa_map against the nodes read here.

- GPU ranks: the NUMA node of the rank's GPU, from sysfs (/sys/bus/pci/devices/<bus id>/numa_node),
  the bus id from /proc/driver/nvidia/gpus/*/information (or nvidia-smi).
- CPU-only ranks: local ranks are spread over the NUMA nodes in contiguous blocks.
- numa=explicit: cluster.numa_map[local_rank]; numa=off: no binding.
- A local launch with cluster.numa=auto on a machine with one NUMA node (and no GPU) binds nothing: every rank
  would get node 0, which is where it runs anyway.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

from training.contract.config import Config

SYSFS_NODES = "/sys/devices/system/node"


def numa_nodes(sysfs_nodes: str = SYSFS_NODES) -> list[int]:
    """NUMA nodes that have CPUs; [0] when sysfs has none (containers without NUMA info)."""
    nodes = []
    try:
        for name in os.listdir(sysfs_nodes):
            m = re.fullmatch(r"node(\d+)", name)
            if not m:
                continue
            try:
                with open(os.path.join(sysfs_nodes, name, "cpulist")) as f:
                    if f.read().strip():
                        nodes.append(int(m.group(1)))
            except OSError:
                continue
    except OSError:
        pass
    return sorted(nodes) or [0]


def online_numa_nodes(path: str = os.path.join(SYSFS_NODES, "online")) -> list[int] | None:
    """This machine's online NUMA node ids from sysfs ("0-1,3" -> [0, 1, 3]); None where sysfs does not say."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes += range(int(lo), int(hi or lo) + 1)
    return nodes


def spread_node(local_rank: int, local_world: int, nodes: Sequence[int]) -> int:
    """CPU-only: contiguous blocks of local ranks per NUMA node (4 ranks on 2 nodes: 0,0,1,1)."""
    return nodes[local_rank * len(nodes) // max(local_world, 1)]


def _normal_bus_id(bus_id: str) -> str:
    """NVIDIA writes 00000000:17:00.0; sysfs names it 0000:17:00.0 (lower case)."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def gpu_bus_ids(proc_root: str = "/proc/driver/nvidia/gpus") -> dict[int, str]:
    """GPU index (device minor) -> PCI bus id, from the driver's proc files, else nvidia-smi."""
    out: dict[int, str] = {}
    try:
        for bus in os.listdir(proc_root):
            with open(os.path.join(proc_root, bus, "information")) as f:
                m = re.search(r"Device Minor:\s*(\d+)", f.read())
            if m:
                out[int(m.group(1))] = _normal_bus_id(bus)
    except OSError:
        pass
    if out or not shutil.which("nvidia-smi"):
        return out
    res = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for line in res.stdout.splitlines():
        idx, _, bus = line.partition(",")
        if idx.strip().isdigit():
            out[int(idx)] = _normal_bus_id(bus)
    return out


def gpu_numa_node(bus_id: str, pci_root: str = "/sys/bus/pci/devices") -> int | None:
    """NUMA node of a PCI device; None when unknown (sysfs says -1 on single-node machines)."""
    try:
        with open(os.path.join(pci_root, bus_id, "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _indices(text: str | None) -> list[int]:
    entries = [x.strip() for x in (text or "").split(",") if x.strip()]
    return [int(x) for x in entries] if entries and all(x.isdigit() for x in entries) else []


def visible_gpu(local_rank: int, cuda_visible: str | None, step_gpus: str | None = None) -> int:
    """Physical GPU index (device minor) of a local rank: the local_rank-th entry of CUDA_VISIBLE_DEVICES.
    step_gpus: Slurm's SLURM_STEP_GPUS, the step's physical GPUs on this node. Under cgroup device
    confinement CUDA_VISIBLE_DEVICES is renumbered from 0 inside the cgroup (every task of
    --gpus-per-task=1 sees "0"), so its entries index that list instead of naming device minors."""
    ids, phys = _indices(cuda_visible), _indices(step_gpus)
    if phys:
        if len(ids) == 1 and len(phys) > 1:  # one GPU per task, each renumbered to 0: tasks bind in order
            return phys[local_rank % len(phys)]
        if ids and all(i < len(phys) for i in ids):  # renumbered (or identical: phys[i] == i)
            return phys[ids[local_rank % len(ids)]]
        if not ids:
            return phys[local_rank % len(phys)]
    if cuda_visible:
        ids = [x for x in cuda_visible.split(",") if x.strip()]
        if local_rank < len(ids) and ids[local_rank].strip().isdigit():
            return int(ids[local_rank])
    return local_rank


def choose_node(
    numa: str,
    numa_map: Sequence[int],
    device: str,
    local_rank: int,
    local_world: int,
    cuda_visible: str | None = None,
    sysfs_nodes: str = SYSFS_NODES,
    pci_root: str = "/sys/bus/pci/devices",
    proc_root: str = "/proc/driver/nvidia/gpus",
    step_gpus: str | None = None,
) -> int | None:
    """The NUMA node this local rank binds to, or None for no binding (step_gpus: see visible_gpu)."""
    if numa == "off":
        return None
    if numa == "explicit":
        if local_rank >= len(numa_map):
            raise ValueError(
                f"cluster.numa=explicit but cluster.numa_map has {len(numa_map)} entries for local rank "
                f"{local_rank}: give one NUMA node per local rank"
            )
        return int(numa_map[local_rank])
    if numa != "auto":
        raise ValueError(f"cluster.numa={numa!r}: use auto, off or explicit")
    nodes = numa_nodes(sysfs_nodes)
    if device == "cuda":
        bus = gpu_bus_ids(proc_root).get(visible_gpu(local_rank, cuda_visible, step_gpus))
        node = gpu_numa_node(bus, pci_root) if bus else None
        if node is not None:
            return node
        # Unknown GPU placement: spreading is still better than every rank on node 0.
    return spread_node(local_rank, local_world, nodes)


def numactl_prefix(node: int | None) -> list[str]:
    """`numactl --cpunodebind=N --membind=N`, or [] for no binding."""
    if node is None:
        return []
    return ["numactl", f"--cpunodebind={node}", f"--membind={node}"]


def local_binding(cfg: Config, local_rank: int, local_world: int, sysfs_nodes: str = SYSFS_NODES) -> int | None:
    """The NUMA node a rank of a local launch binds to, or None (numa=off, or auto with nothing to choose between)."""
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
    cfg: Config, local_rank: int, local_world: int, sysfs_nodes: str = SYSFS_NODES
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
