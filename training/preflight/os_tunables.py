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
    checks: list[Check] = []

    def add(c: Check) -> None:
        c.node = node
        checks.append(c)

    def missing(name, key):
        add(ok(name, f"{key} not present on this kernel"))

    thp = _read(os.path.join(sys_root, "kernel", "mm", "transparent_hugepage", "enabled"))
    hp = sysctl(proc_sys, "vm.nr_hugepages")
    found = f"thp={bracketed(thp) if thp else '-'} nr_hugepages={hp if hp is not None else '-'}"
    expected = "thp=madvise|always nr_hugepages=0 unless hugetlbfs is used"
    if thp and bracketed(thp) == "never":
        add(
            warn(
                "os.hugepages",
                "THP disabled: large host buffers (pinned memory, data loaders) use 4 KiB pages",
                found=found,
                expected=expected,
            )
        )
    else:
        add(ok("os.hugepages", found=found, expected=expected))

    v = sysctl(proc_sys, "vm.swappiness")
    if v is None:
        missing("os.swappiness", "vm.swappiness")
    elif int(v) > pf.max_swappiness:
        add(
            warn(
                "os.swappiness",
                "the kernel may swap out rank memory under page-cache pressure (sysctl -w vm.swappiness=1)",
                found=int(v),
                expected=f"<= {pf.max_swappiness}",
            )
        )
    else:
        add(ok("os.swappiness", found=int(v), expected=f"<= {pf.max_swappiness}"))

    v = sysctl(proc_sys, "vm.overcommit_memory")
    if v is None:
        missing("os.overcommit", "vm.overcommit_memory")
    elif int(v) == 2:
        add(
            warn(
                "os.overcommit",
                "strict overcommit: CUDA's large virtual reservations and fork() of big "
                "processes fail (sysctl -w vm.overcommit_memory=0)",
                found=2,
                expected="0 or 1",
            )
        )
    else:
        add(ok("os.overcommit", found=int(v), expected="0 or 1"))

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
            add(
                warn(
                    "os.io_scheduler",
                    f"{cur} adds latency on SSD/NVMe (checkpoint writes)",
                    subject=dev,
                    found=cur,
                    expected=exp,
                )
            )
        else:
            add(ok("os.io_scheduler", subject=dev, found=cur, expected=exp))

    for key in ("net.core.rmem_max", "net.core.wmem_max"):
        v = sysctl(proc_sys, key)
        name = "os." + key.rsplit(".", 1)[1]
        if v is None:
            missing(name, key)
        elif int(v) < pf.min_socket_buffer_bytes:
            add(
                warn(
                    name,
                    f"socket buffers cap TCP bootstrap/socket transport throughput "
                    f"(sysctl -w {key}={pf.min_socket_buffer_bytes})",
                    found=int(v),
                    expected=f">= {pf.min_socket_buffer_bytes}",
                )
            )
        else:
            add(ok(name, found=int(v), expected=f">= {pf.min_socket_buffer_bytes}"))

    v = sysctl(proc_sys, "net.ipv4.tcp_congestion_control")
    if v is None:
        missing("os.tcp_congestion", "net.ipv4.tcp_congestion_control")
    elif v not in _GOOD_CONGESTION:
        add(
            warn(
                "os.tcp_congestion",
                f"{v} recovers slowly from loss on fast links",
                found=v,
                expected="|".join(_GOOD_CONGESTION),
            )
        )
    else:
        add(ok("os.tcp_congestion", found=v, expected="|".join(_GOOD_CONGESTION)))

    topo = numa_topology(sys_root)
    add(
        ok(
            "os.numa",
            f"{len(topo)} NUMA node(s)" if topo else "no NUMA information",
            found={str(n): {"cpus": _compact(t["cpus"]), "distance": t["distance"]} for n, t in topo.items()},
        )
    )
    gmap = gpu_numa_map(sys_root, gpu_bus_ids or [])
    if gpu_bus_ids:
        c = ok("os.gpu_numa", "NUMA node of each GPU (cluster.numa=auto binds rank i there)", found=gmap)
        if numa == "explicit" and numa_map and list(numa_map[: len(gmap)]) != gmap:
            c = warn(
                "os.gpu_numa",
                "cluster.numa_map binds ranks away from their GPU's NUMA node",
                found=gmap,
                expected=list(numa_map),
            )
        add(c)
    else:
        add(ok("os.gpu_numa", "no GPU on this node", found=[]))
    return checks


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
