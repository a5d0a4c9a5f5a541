"""OS tunables parsed from fixture /proc/sys and /sys trees."""

import os

from training.contract.config import PreflightConfig
from training.preflight.os_tunables import bracketed, check_os, numa_topology, parse_cpulist
from training.preflight.report import FAIL, WARN


def put(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def tree(tmp_path, **over):
    proc, sys_ = str(tmp_path / "proc_sys"), str(tmp_path / "sys")
    values = {
        "vm/swappiness": "1",
        "vm/overcommit_memory": "0",
        "vm/nr_hugepages": "0",
        "net/core/rmem_max": "134217728",
        "net/core/wmem_max": "134217728",
        "net/ipv4/tcp_congestion_control": "cubic",
    }
    values.update({k.replace("__", "/"): v for k, v in over.items()})
    for rel, text in values.items():
        put(proc, rel, text)
    put(sys_, "kernel/mm/transparent_hugepage/enabled", "always [madvise] never")
    put(sys_, "block/nvme0n1/queue/scheduler", "[none] mq-deadline kyber bfq")
    put(sys_, "block/nvme0n1/queue/rotational", "0")
    put(sys_, "block/loop0/queue/scheduler", "[none]")
    for node, cpus, dist in ((0, "0-55,112-167", "10 21"), (1, "56-111,168-223", "21 10")):
        put(sys_, f"devices/system/node/node{node}/cpulist", cpus)
        put(sys_, f"devices/system/node/node{node}/distance", dist)
    put(sys_, "devices/system/node/possible", "0-1")
    put(sys_, "bus/pci/devices/0000:18:00.0/numa_node", "0")
    put(sys_, "bus/pci/devices/0000:9a:00.0/numa_node", "1")
    return proc, sys_


def run(tmp_path, pf=None, **over):
    proc, sys_ = tree(tmp_path, **over)
    return check_os(
        pf or PreflightConfig(), "n1", proc_sys=proc, sys_root=sys_, gpu_bus_ids=["0000:18:00.0", "0000:9a:00.0"]
    )


def by_name(checks):
    return {c.name: c for c in checks}


def test_parsers():
    assert bracketed("always [madvise] never") == "madvise"
    assert parse_cpulist("0-2,8,10-11") == [0, 1, 2, 8, 10, 11]


def test_good_node_reports_found_and_recommended(tmp_path):
    checks = run(tmp_path)
    assert not [c for c in checks if c.status in (WARN, FAIL)]
    c = by_name(checks)
    assert c["os.swappiness"].found == 1 and c["os.swappiness"].expected == "<= 10"
    assert c["os.rmem_max"].found == 134217728
    assert c["os.tcp_congestion"].found == "cubic"
    assert c["os.io_scheduler"].subject == "nvme0n1" and c["os.io_scheduler"].found == "none"
    assert "thp=madvise" in c["os.hugepages"].found
    assert c["os.gpu_numa"].found == [0, 1]
    assert c["os.numa"].found["1"] == {"cpus": "56-111,168-223", "distance": [21, 10]}
    assert all(x.subject != "loop0" for x in checks)


def test_bad_values_warn_never_fail(tmp_path):
    checks = run(
        tmp_path,
        vm__swappiness="60",
        vm__overcommit_memory="2",
        net__core__rmem_max="212992",
        net__ipv4__tcp_congestion_control="reno",
    )
    warned = {c.name for c in checks if c.status == WARN}
    assert warned == {"os.swappiness", "os.overcommit", "os.rmem_max", "os.tcp_congestion"}
    assert not [c for c in checks if c.status == FAIL]
    assert by_name(checks)["os.swappiness"].found == 60


def test_bfq_on_ssd_warns_and_thresholds_come_from_config(tmp_path):
    proc, sys_ = tree(tmp_path)
    put(sys_, "block/nvme0n1/queue/scheduler", "none mq-deadline kyber [bfq]")
    put(sys_, "kernel/mm/transparent_hugepage/enabled", "always madvise [never]")
    checks = check_os(PreflightConfig(max_swappiness=0), "n1", proc_sys=proc, sys_root=sys_)
    assert {c.name for c in checks if c.status == WARN} == {"os.io_scheduler", "os.hugepages", "os.swappiness"}


def test_numa_map_mismatch_warns(tmp_path):
    proc, sys_ = tree(tmp_path)
    checks = check_os(
        PreflightConfig(),
        "n1",
        proc_sys=proc,
        sys_root=sys_,
        gpu_bus_ids=["0000:18:00.0", "0000:9a:00.0"],
        numa="explicit",
        numa_map=[1, 0],
    )
    assert {c.name for c in checks if c.status == WARN} == {"os.gpu_numa"}


def test_this_machine(tmp_path):
    checks = check_os(PreflightConfig(), "here")
    c = by_name(checks)
    assert isinstance(c["os.swappiness"].found, int)
    assert set(numa_topology("/sys")) == set(int(k) for k in c["os.numa"].found)
