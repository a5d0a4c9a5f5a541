"""OS settings a training node should have, each with the value found and the recommended one.

Read from /proc/sys and /sys (roots are arguments so tests use fixture trees). None of these
makes a node bad: they cost speed, not correctness, so the worst verdict is warn.
"""

from __future__ import annotations

import os
import re

from training.contract import slurm_env
from training.preflight.report import Check, ok, warn

# I/O schedulers fit for SSD/NVMe; bfq and the old cfq add latency to checkpoint writes.
_GOOD_SCHEDULERS = ("none", "mq-deadline", "noop", "deadline", "kyber")
_GOOD_CONGESTION = ("bbr", "cubic", "dctcp")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def sysctl(proc_sys: str, key: str) -> str | None:
    """vm.swappiness -> contents of <proc_sys>/vm/swappiness, or None when absent."""
    return _read(os.path.join(proc_sys, *key.split(".")))


def bracketed(text: str) -> str:
    """The selected entry of a sysfs choice list: 'always [madvise] never' -> 'madvise'."""
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip()


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8-11' -> [0, 1, 2, 3, 8, 9, 10, 11] (sorted; the parser is training/contract/slurm_env.py's)."""
    return sorted(slurm_env.parse_cpulist(text))


def numa_topology(sys_root: str) -> dict[int, dict]:
    """{node: {cpus: [...], distance: [...]}} from <sys>/devices/system/node."""
    base = os.path.join(sys_root, "devices", "system", "node")
    out: dict[int, dict] = {}
    if not os.path.isdir(base):
        return out
    for name in os.listdir(base):
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        d = os.path.join(base, name)
        out[int(m.group(1))] = {
            "cpus": parse_cpulist(_read(os.path.join(d, "cpulist")) or ""),
            "distance": [int(x) for x in (_read(os.path.join(d, "distance")) or "").split()],
        }
    return dict(sorted(out.items()))


def gpu_numa_map(sys_root: str, bus_ids: list[str]) -> list[int]:
    """NUMA node of each GPU (sysfs bus ids, e.g. 0000:18:00.0); -1 where the platform reports none."""
    out = []
    for bus in bus_ids:
        v = _read(os.path.join(sys_root, "bus", "pci", "devices", bus, "numa_node"))
        out.append(int(v) if v not in (None, "") else -1)
    return out


def check_os(
    pf,
    node: str,
    proc_sys: str = "/proc/sys",
    sys_root: str = "/sys",
    gpu_bus_ids: list[str] | None = None,
    numa: str = "auto",
    numa_map: list[int] | None = None,
) -> list[Check]:
    """This node's OS tunables, in table order: pages, memory, I/O scheduler, network, NUMA."""
    checks = [
        _hugepages(proc_sys, sys_root),
        *_memory_sysctls(pf, proc_sys),
        *_io_schedulers(sys_root),
        *_network_sysctls(pf, proc_sys),
        *_numa_checks(sys_root, gpu_bus_ids, numa, numa_map),
    ]
    for c in checks:
        c.node = node
    return checks


def _missing(name: str, key: str) -> Check:
    return ok(name, f"{key} not present on this kernel")


def _hugepages(proc_sys: str, sys_root: str) -> Check:
    thp = _read(os.path.join(sys_root, "kernel", "mm", "transparent_hugepage", "enabled"))
    hp = sysctl(proc_sys, "vm.nr_hugepages")
    found = f"thp={bracketed(thp) if thp else '-'} nr_hugepages={hp if hp is not None else '-'}"
    expected = "thp=madvise|always nr_hugepages=0 unless hugetlbfs is used"
    if thp and bracketed(thp) == "never":
        return warn(
            "os.hugepages",
            "THP disabled: large host buffers (pinned memory, data loaders) use 4 KiB pages",
            found=found,
            expected=expected,
        )
    return ok("os.hugepages", found=found, expected=expected)


def _memory_sysctls(pf, proc_sys: str) -> list[Check]:
    """Swappiness and the overcommit policy."""
    out: list[Check] = []
    v = sysctl(proc_sys, "vm.swappiness")
    if v is None:
        out.append(_missing("os.swappiness", "vm.swappiness"))
    elif int(v) > pf.max_swappiness:
        out.append(
            warn(
                "os.swappiness",
                "the kernel may swap out rank memory under page-cache pressure (sysctl -w vm.swappiness=1)",
                found=int(v),
                expected=f"<= {pf.max_swappiness}",
            )
        )
    else:
        out.append(ok("os.swappiness", found=int(v), expected=f"<= {pf.max_swappiness}"))

    v = sysctl(proc_sys, "vm.overcommit_memory")
    if v is None:
        out.append(_missing("os.overcommit", "vm.overcommit_memory"))
    elif int(v) == 2:
        out.append(
            warn(
                "os.overcommit",
                "strict overcommit: CUDA's large virtual reservations and fork() of big "
                "processes fail (sysctl -w vm.overcommit_memory=0)",
                found=2,
                expected="0 or 1",
            )
        )
    else:
        out.append(ok("os.overcommit", found=int(v), expected="0 or 1"))
    return out


def _io_schedulers(sys_root: str) -> list[Check]:
    """The I/O scheduler of each block device (loop, RAM and optical devices skipped)."""
    out: list[Check] = []
    block = os.path.join(sys_root, "block")
    for dev in sorted(os.listdir(block)) if os.path.isdir(block) else []:
        if dev.startswith(("loop", "ram", "zram", "sr")):
            continue
        sched = _read(os.path.join(block, dev, "queue", "scheduler"))
        if not sched:
            continue
        cur = bracketed(sched)
        rotational = _read(os.path.join(block, dev, "queue", "rotational")) == "1"
        exp = "any (rotational)" if rotational else "none|mq-deadline"
        if not rotational and cur not in _GOOD_SCHEDULERS:
            out.append(
                warn(
                    "os.io_scheduler",
                    f"{cur} adds latency on SSD/NVMe (checkpoint writes)",
                    subject=dev,
                    found=cur,
                    expected=exp,
                )
            )
        else:
            out.append(ok("os.io_scheduler", subject=dev, found=cur, expected=exp))
    return out


def _network_sysctls(pf, proc_sys: str) -> list[Check]:
    """Socket buffer limits and TCP congestion control (the bootstrap and socket transport)."""
    out: list[Check] = []
    for key in ("net.core.rmem_max", "net.core.wmem_max"):
        v = sysctl(proc_sys, key)
        name = "os." + key.rsplit(".", 1)[1]
        if v is None:
            out.append(_missing(name, key))
        elif int(v) < pf.min_socket_buffer_bytes:
            out.append(
                warn(
                    name,
                    f"socket buffers cap TCP bootstrap/socket transport throughput "
                    f"(sysctl -w {key}={pf.min_socket_buffer_bytes})",
                    found=int(v),
                    expected=f">= {pf.min_socket_buffer_bytes}",
                )
            )
        else:
            out.append(ok(name, found=int(v), expected=f">= {pf.min_socket_buffer_bytes}"))

    v = sysctl(proc_sys, "net.ipv4.tcp_congestion_control")
    if v is None:
        out.append(_missing("os.tcp_congestion", "net.ipv4.tcp_congestion_control"))
    elif v not in _GOOD_CONGESTION:
        out.append(
            warn(
                "os.tcp_congestion",
                f"{v} recovers slowly from loss on fast links",
                found=v,
                expected="|".join(_GOOD_CONGESTION),
            )
        )
    else:
        out.append(ok("os.tcp_congestion", found=v, expected="|".join(_GOOD_CONGESTION)))
    return out


def _numa_checks(sys_root: str, gpu_bus_ids: list[str] | None, numa: str, numa_map: list[int] | None) -> list[Check]:
    """The NUMA topology (reported) and each GPU's NUMA node against an explicit cluster.numa_map."""
    topo = numa_topology(sys_root)
    out = [
        ok(
            "os.numa",
            f"{len(topo)} NUMA node(s)" if topo else "no NUMA information",
            found={str(n): {"cpus": _compact(t["cpus"]), "distance": t["distance"]} for n, t in topo.items()},
        )
    ]
    gmap = gpu_numa_map(sys_root, gpu_bus_ids or [])
    if not gpu_bus_ids:
        return out + [ok("os.gpu_numa", "no GPU on this node", found=[])]
    c = ok("os.gpu_numa", "NUMA node of each GPU (cluster.numa=auto binds rank i there)", found=gmap)
    if numa == "explicit" and numa_map and list(numa_map[: len(gmap)]) != gmap:
        c = warn(
            "os.gpu_numa",
            "cluster.numa_map binds ranks away from their GPU's NUMA node",
            found=gmap,
            expected=list(numa_map),
        )
    return out + [c]


def _compact(cpus: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5' (readable in the table)."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(parts)
