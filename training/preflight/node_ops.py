"""Node checks of the operations checklist (pure Python, every path a parameter so tests point them at fixtures):

- node.rdma_modules: the RDMA kernel modules (ib_core, and mlx5_core for mlx5 HCAs) loaded where InfiniBand is
  present or expected (missing: fail when the job expects HCAs, else warn);
- node.irq_affinity: each HCA's interrupts (its PCI device's msi_irqs) allowed only on CPUs of the HCA's NUMA node
  (/proc/irq/<n>/smp_affinity_list): interrupts served across the socket add latency to every message;
- node.read_ahead: read_ahead_kb of the block devices under run.dir (checkpoints) and the data (warn below
  cluster.preflight.min_read_ahead_kb; network file systems have no block device and are skipped);
- node.cgroup_memory: the job's cgroup memory limit against the host memory its ranks on this node need:
  cluster.preflight.host_memory_per_rank_gb each, plus with train.async_save a host copy of the rank's checkpoint
  shard (plan.json: weights + optimizer of the worst rank) and any offloaded bytes plan.json lists.
"""

from __future__ import annotations

import json
import os

from training.contract.rundir.paths import RunPaths
from training.preflight import ib_sysfs
from training.preflight.os_tunables import _read  # one reader of /proc and /sys files
from training.preflight.report import Check, fail, ok, warn

GIB = 2**30


def _cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, (text or "").replace("\n", ",").split(",")):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return sorted(out)


def loaded_modules(proc_modules: str = "/proc/modules") -> set | None:
    text = _read(proc_modules)
    return None if text is None else {line.split()[0] for line in text.splitlines() if line.strip()}


def check_rdma_modules(
    ib_root: str, node: str, expected: bool, proc_modules: str = "/proc/modules", builtin: str = ""
) -> list[Check]:
    hcas = sorted(ib_sysfs.list_ports(ib_root))
    if not hcas and not expected:
        return [ok("node.rdma_modules", "no InfiniBand HCA present or expected", node=node)]
    mods = loaded_modules(proc_modules)
    if mods is None:
        return [warn("node.rdma_modules", f"{proc_modules} is unreadable: the RDMA modules are not checked", node=node)]
    want = ["ib_core"] + (["mlx5_core", "mlx5_ib"] if any(h.startswith("mlx5") for h in hcas) or not hcas else [])
    # A module built into the kernel is not listed in /proc/modules but has a /sys/module/<name> directory.
    missing = [m for m in want if m not in mods and not (builtin and os.path.isdir(os.path.join(builtin, m)))]
    if missing:
        bad = fail if expected else warn
        return [
            bad(
                "node.rdma_modules",
                f"RDMA kernel modules not loaded: {', '.join(missing)} (modprobe them, or "
                "install the OFED / rdma-core drivers)",
                node=node,
                found=sorted(set(want) - set(missing)),
                expected=want,
            )
        ]
    return [ok("node.rdma_modules", f"loaded: {', '.join(want)}", node=node)]


def check_irq_affinity(ib_root: str, node: str, sys_root: str = "/sys", proc_irq: str = "/proc/irq") -> list[Check]:
    checks: list[Check] = []
    for hca in sorted(ib_sysfs.list_ports(ib_root)):
        dev = os.path.join(ib_root, hca, "device")
        numa = _read(os.path.join(dev, "numa_node"))
        if numa is None or int(numa) < 0:
            checks.append(
                ok("node.irq_affinity", "the platform reports no NUMA node for the HCA", subject=hca, node=node)
            )
            continue
        node_cpus = set(
            _cpulist(_read(os.path.join(sys_root, "devices", "system", "node", f"node{numa}", "cpulist")) or "")
        )
        try:
            irqs = sorted(int(i) for i in os.listdir(os.path.join(dev, "msi_irqs")) if i.isdigit())
        except OSError:
            irqs = []
        if not irqs or not node_cpus:
            checks.append(
                ok("node.irq_affinity", "no MSI interrupts or NUMA CPU list to compare", subject=hca, node=node)
            )
            continue
        off = []
        for irq in irqs:
            allowed = set(_cpulist(_read(os.path.join(proc_irq, str(irq), "smp_affinity_list")) or ""))
            if allowed and not allowed <= node_cpus:
                off.append(irq)
        if off:
            checks.append(
                warn(
                    "node.irq_affinity",
                    f"{len(off)} of {len(irqs)} interrupts of {hca} may run on CPUs "
                    f"outside its NUMA node {numa}: pin them there (irqbalance --banirq, or set_irq_affinity "
                    "from the NIC's driver tools)",
                    subject=hca,
                    node=node,
                    found=off[:16],
                    expected=f"CPUs of node {numa}",
                )
            )
        else:
            checks.append(
                ok("node.irq_affinity", f"all {len(irqs)} interrupts on NUMA node {numa}", subject=hca, node=node)
            )
    return checks


def block_queue(path: str, sys_root: str = "/sys") -> str | None:
    """The sysfs queue/ directory of the block device holding path (a partition: its disk's), or None."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        dev = os.stat(probe).st_dev
    except OSError:
        return None
    base = os.path.realpath(os.path.join(sys_root, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}"))
    for d in (base, os.path.dirname(base)):
        if os.path.isfile(os.path.join(d, "queue", "read_ahead_kb")):
            return os.path.join(d, "queue")
    return None


def check_read_ahead(paths: dict[str, str], min_kb: int, node: str, sys_root: str = "/sys") -> list[Check]:
    """paths: label (checkpoints, data) -> a path on the device to check."""
    checks: list[Check] = []
    seen: dict[str, str] = {}
    for label, path in paths.items():
        queue = block_queue(path, sys_root)
        if queue is None:
            checks.append(
                ok(
                    "node.read_ahead",
                    f"{label}: {path} is on no block device here (a network or virtual file system)",
                    subject=label,
                    node=node,
                )
            )
            continue
        if queue in seen:
            continue
        seen[queue] = label
        kb = int(_read(os.path.join(queue, "read_ahead_kb")) or 0)
        device = os.path.basename(os.path.dirname(queue))
        if min_kb and kb < min_kb:
            checks.append(
                warn(
                    "node.read_ahead",
                    f"{label}: read_ahead_kb of {device} is {kb}: sequential reads of "
                    f"checkpoints and data shards go in small requests (blockdev --setra or "
                    f"/sys/block/{device}/queue/read_ahead_kb)",
                    subject=label,
                    node=node,
                    found=kb,
                    expected=f">= {min_kb}",
                )
            )
        else:
            checks.append(
                ok("node.read_ahead", f"{label}: {device} read_ahead_kb {kb}", subject=label, node=node, found=kb)
            )
    return checks


def cgroup_memory_limit(proc_self_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit of this process's cgroup and its parents (v2 memory.max, v1
    memory.limit_in_bytes); None when unlimited or unknown."""
    text = _read(proc_self_cgroup) or ""
    limits: list[int] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2
            rel = rel.strip("/")
            pieces = rel.split("/") if rel else []
            for k in range(len(pieces), -1, -1):
                value = _read(os.path.join(cgroup_root, *pieces[:k], "memory.max"))
                if value and value != "max":
                    limits.append(int(value))
        elif "memory" in controllers.split(","):
            value = _read(os.path.join(cgroup_root, "memory", rel.strip("/"), "memory.limit_in_bytes")) or _read(
                os.path.join(cgroup_root, "memory", "memory.limit_in_bytes")
            )
            if value and int(value) < 2**60:  # v1 writes a huge number for "no limit"
                limits.append(int(value))
    return min(limits) if limits else None


def host_memory_needed(cfg, ranks_on_node: int, plan: dict | None) -> dict[str, int]:
    """Bytes of host memory this node's ranks need, by part."""
    pf = cfg.cluster.preflight
    parts = {"ranks": int(ranks_on_node * pf.host_memory_per_rank_gb * GIB)}
    mem = (plan or {}).get("memory_bytes") or {}
    if cfg.train.async_save:
        parts["async_save_staging"] = ranks_on_node * int(mem.get("weights", 0) + mem.get("optimizer", 0))
    # plan.json (ZeRO offload): host bytes per rank as pinned (power-of-two rounded on a GPU); nvme is disk
    offload = int(mem.get("host_offload_pinned", mem.get("host_offload", 0)))
    if offload:
        parts["offload"] = ranks_on_node * offload
    return parts


def check_cgroup_memory(
    cfg,
    node: str,
    ranks_on_node: int,
    run_dir: str,
    proc_self_cgroup: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> list[Check]:
    plan = None
    try:
        with open(RunPaths(run_dir).plan) as f:
            plan = json.load(f)
    except (OSError, ValueError):
        pass
    need = host_memory_needed(cfg, ranks_on_node, plan)
    total = sum(need.values())
    limit = cgroup_memory_limit(proc_self_cgroup, cgroup_root)
    detail = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in need.items())
    if limit is None:
        return [
            ok(
                "node.cgroup_memory",
                f"no cgroup memory limit; this node's ranks need about {total / GIB:.1f} GiB ({detail})",
                node=node,
                found=None,
                expected=total,
            )
        ]
    if limit < total:
        return [
            warn(
                "node.cgroup_memory",
                f"the job's cgroup allows {limit / GIB:.1f} GiB of host memory, its "
                f"{ranks_on_node} ranks here need about {total / GIB:.1f} GiB ({detail}): the kernel's OOM killer "
                "would end them (sbatch --mem, cluster.mem=0 for the whole node)",
                node=node,
                found=limit,
                expected=total,
            )
        ]
    return [
        ok(
            "node.cgroup_memory",
            f"cgroup limit {limit / GIB:.1f} GiB >= about {total / GIB:.1f} GiB needed ({detail})",
            node=node,
            found=limit,
            expected=total,
        )
    ]


def check_node_ops(cfg, node: str, ib_root: str, env: dict[str, str], ranks_on_node: int) -> list[Check]:
    """Every check of this module with the real paths (runner.node_checks calls it on one rank per node)."""
    pf = cfg.cluster.preflight
    expected = bool(ib_sysfs.expected_hcas(pf.ib_hcas, dict(cfg.cluster.env)))
    checks = check_rdma_modules(ib_root, node, expected, builtin="/sys/module")
    checks += check_irq_affinity(ib_root, node)
    run_dir = cfg.run.dir
    paths = {"checkpoints": RunPaths(run_dir).checkpoints}
    data = list(cfg.data.prefixes) + list(cfg.data.paths)
    if data and cfg.data.kind != "synthetic":
        paths["data"] = data[0]
    checks += check_read_ahead(paths, pf.min_read_ahead_kb, node)
    checks += check_cgroup_memory(cfg, node, ranks_on_node, run_dir)
    return checks
