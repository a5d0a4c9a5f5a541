"""The operations checklist against test doubles of what a CPU machine lacks: the
InfiniBand sysfs tree (tests/launcher/launch/test_preflight_ib.py's writer, extended with the HCA's PCI device: NUMA node and MSI
interrupts), /proc and /sys fixtures (modules, IRQ affinity, block queues, cgroups, the mount table), and the
NVML file double (training/preflight/nvml_double.py) extended with Xid events. The run-time paths that need ranks
(OOM through training.main, slowdown, NVTX, the checkpoint replica) are tests/engine/test_ops_run.py."""

from __future__ import annotations

import json
import os

from helpers.cli import compose_cfg
from helpers.doubles import write_port

from training.contract.config import Config
from training.contract.rundir.events import read_events
from training.observe.health import XID, HealthSampler
from training.observe.oom import explain, levers
from training.observe.slowdown import JobSlowdown
from training.preflight import nccl_checks, node_ops
from training.preflight.nvml_double import make_nvml_double
from training.preflight.report import FAIL, OK, WARN


def _by(checks, name):
    return [c for c in checks if c.name == name]


# ---- 9. NCCL: transport, IB settings, versions ------------------------------------------------------------------


def test_nccl_socket_fallback_is_warned_with_its_cause(tmp_path):
    root = str(tmp_path / "ib")
    write_port(root, "mlx5_0")
    write_port(root, "mlx5_1")
    good = nccl_checks.transport_checks({"NCCL_IB_HCA": "mlx5", "NCCL_IB_TIMEOUT": "22"}, root, "n1")
    assert _by(good, "nccl.transport")[0].status == OK
    settings = _by(good, "nccl.ib_settings")[0]
    assert settings.found["NCCL_IB_TIMEOUT"] == "22" and "NCCL_IB_RETRY_CNT=unset" in settings.reason
    for env, cause in (
        ({"NCCL_IB_DISABLE": "1"}, "NCCL_IB_DISABLE=1"),
        ({"NCCL_NET": "Socket"}, "NCCL_NET=Socket"),
        ({"NCCL_IB_HCA": "=mlx5_9"}, "selects none"),
        ({"NCCL_IB_HCA": "^mlx5"}, "selects none"),
    ):
        (c,) = _by(nccl_checks.transport_checks(env, root, "n1"), "nccl.transport")
        assert c.status == WARN and cause in c.reason and "sockets" in c.reason, (env, c.reason)
    down = str(tmp_path / "down")
    write_port(down, "mlx5_0", state="1: DOWN", phys="3: Disabled")
    (c,) = _by(nccl_checks.transport_checks({}, down, "n1"), "nccl.transport")
    assert c.status == WARN and "no ACTIVE port" in c.reason
    (c,) = _by(nccl_checks.transport_checks({}, str(tmp_path / "none"), "n1"), "nccl.transport")
    assert c.status == OK and "no InfiniBand" in c.reason


def _rank(r, node="n1", **v):
    base = {
        "torch": "2.4",
        "cuda": "12.4",
        "nccl": "2.21.5",
        "driver": "550.54",
        "cudnn": "90100",
        "cuda_driver": "12.4",
    }
    return {"rank": r, "node": node, "versions": {**base, **v}}


def test_nccl_minimum_cudnn_agreement_and_cuda_runtime_against_driver():
    assert nccl_checks.parse_version("2.18.3") == (2, 18, 3)
    fine = nccl_checks.version_checks([_rank(0), _rank(1, nccl="2.18.1")])  # a minimum, not an exact match
    assert all(c.status == OK for c in fine) and {c.name for c in fine} == {
        "version.nccl_min",
        "version.cudnn",
        "version.cuda_runtime",
    }
    old = nccl_checks.version_checks([_rank(0), _rank(1, "n2", nccl="2.17.1")])
    (c,) = [c for c in old if c.status == FAIL]
    assert c.name == "version.nccl_min" and c.node == "n2" and c.found == "2.17.1"
    cudnn = nccl_checks.version_checks([_rank(0), _rank(1), _rank(2, "n3", cudnn="8902")])
    (c,) = [c for c in cudnn if c.status == FAIL]
    assert c.name == "version.cudnn" and c.node == "n3" and c.expected == "90100"
    newer = nccl_checks.version_checks([_rank(0, cuda="12.6", cuda_driver="12.2")])
    (c,) = [c for c in newer if c.status == FAIL]
    assert c.name == "version.cuda_runtime" and "newer than the driver" in c.reason
    assert not [c for c in nccl_checks.version_checks([_rank(0, cuda="11.8", cuda_driver="12.2")]) if c.status == FAIL]
    # A CPU build (no NCCL, cuDNN, driver) is not judged.
    assert nccl_checks.version_checks([_rank(0, nccl=None, cudnn=None, cuda=None, cuda_driver=None)]) == []


# ---- 10. node: RDMA modules, IRQ affinity, read-ahead, cgroup memory, shared file system -----------------------


def _hca_device(root, hca, numa, irqs):
    dev = os.path.join(root, hca, "device")
    os.makedirs(os.path.join(dev, "msi_irqs"), exist_ok=True)
    with open(os.path.join(dev, "numa_node"), "w") as f:
        f.write(f"{numa}\n")
    for irq in irqs:
        open(os.path.join(dev, "msi_irqs", str(irq)), "w").close()


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_rdma_modules_and_nic_irq_affinity(tmp_path):
    root = str(tmp_path / "ib")
    write_port(root, "mlx5_0")
    modules = str(tmp_path / "modules")
    _write(modules, "ib_core 1 0 - Live 0x0\nmlx5_core 2 0 - Live 0x0\n")
    (c,) = node_ops.check_rdma_modules(root, "n1", expected=True, proc_modules=modules)
    assert c.status == FAIL and "mlx5_ib" in c.reason  # expected HCAs: a missing module fails the node
    (c,) = node_ops.check_rdma_modules(root, "n1", expected=False, proc_modules=modules)
    assert c.status == WARN
    _write(modules, "ib_core 1 0 - Live 0x0\nmlx5_core 2 0 - Live 0x0\nmlx5_ib 3 0 - Live 0x0\n")
    assert node_ops.check_rdma_modules(root, "n1", expected=True, proc_modules=modules)[0].status == OK
    assert node_ops.check_rdma_modules(str(tmp_path / "no_ib"), "n1", False, modules)[0].status == OK
    # IRQs of mlx5_0 (NUMA node 1: CPUs 8-15): two pinned there, one allowed on every CPU.
    sys_root, proc_irq = str(tmp_path / "sys"), str(tmp_path / "irq")
    _write(os.path.join(sys_root, "devices/system/node/node0/cpulist"), "0-7\n")
    _write(os.path.join(sys_root, "devices/system/node/node1/cpulist"), "8-15\n")
    _hca_device(root, "mlx5_0", 1, [100, 101, 102])
    for irq, cpus in ((100, "8-11"), (101, "12"), (102, "0-15")):
        _write(os.path.join(proc_irq, str(irq), "smp_affinity_list"), cpus + "\n")
    (c,) = node_ops.check_irq_affinity(root, "n1", sys_root, proc_irq)
    assert c.status == WARN and c.found == [102] and "1 of 3" in c.reason
    _write(os.path.join(proc_irq, "102", "smp_affinity_list"), "13-15\n")
    assert node_ops.check_irq_affinity(root, "n1", sys_root, proc_irq)[0].status == OK


def test_read_ahead_of_the_checkpoint_and_data_devices(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    dev = os.stat(data).st_dev
    sys_root = tmp_path / "sys"
    disk = sys_root / "devices" / "block" / "vdz"
    _write(str(disk / "queue" / "read_ahead_kb"), "128\n")
    (disk / "vdz1").mkdir()  # a partition: its queue is the disk's
    os.makedirs(sys_root / "dev" / "block")
    os.symlink(disk / "vdz1", sys_root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}")
    checks = node_ops.check_read_ahead(
        {"checkpoints": str(tmp_path / "run" / "checkpoints"), "data": str(data)}, 1024, "n1", str(sys_root)
    )
    assert len(checks) == 1 and checks[0].status == WARN and checks[0].found == 128  # one device, said once
    _write(str(disk / "queue" / "read_ahead_kb"), "4096\n")
    assert node_ops.check_read_ahead({"data": str(data)}, 1024, "n1", str(sys_root))[0].status == OK
    (c,) = node_ops.check_read_ahead({"data": str(data)}, 1024, "n1", str(tmp_path / "nosys"))
    assert c.status == OK and "no block device" in c.reason


def test_cgroup_memory_limit_against_the_host_memory_the_ranks_need(tmp_path):
    cg, proc = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(str(proc), "0::/slurm/job_7/step_0\n")
    _write(str(cg / "slurm" / "job_7" / "memory.max"), f"{20 * 2**30}\n")
    _write(str(cg / "slurm" / "job_7" / "step_0" / "memory.max"), "max\n")
    assert node_ops.cgroup_memory_limit(str(proc), str(cg)) == 20 * 2**30  # the tightest of the path
    cfg = compose_cfg("train.async_save=true", "cluster.preflight.host_memory_per_rank_gb=2")
    run = tmp_path / "run"
    _write(str(run / "plan.json"), json.dumps({"memory_bytes": {"weights": 2 * 2**30, "optimizer": 1 * 2**30}}))
    need = node_ops.host_memory_needed(cfg, 4, json.loads((run / "plan.json").read_text()))
    assert need == {"ranks": 8 * 2**30, "async_save_staging": 12 * 2**30}
    (c,) = node_ops.check_cgroup_memory(cfg, "n1", 4, str(run), str(proc), str(cg))
    assert c.status == OK and c.found == c.expected == 20 * 2**30  # exactly enough
    (c,) = node_ops.check_cgroup_memory(cfg, "n1", 5, str(run), str(proc), str(cg))
    assert c.status == WARN and "OOM killer" in c.reason and c.expected == 25 * 2**30
    (c,) = node_ops.check_cgroup_memory(compose_cfg(), "n1", 4, str(run), str(proc), str(cg))
    assert c.status == OK  # without async saves: 4 x 4 GiB
    v1 = tmp_path / "v1"
    _write(str(v1 / "proc"), "4:memory:/job\n")
    _write(str(v1 / "cg" / "memory" / "job" / "memory.limit_in_bytes"), f"{2**30}\n")
    assert node_ops.cgroup_memory_limit(str(v1 / "proc"), str(v1 / "cg")) == 2**30


def test_multi_node_run_dir_must_be_on_a_shared_file_system(tmp_path, monkeypatch):
    from launcher.launch import shared_fs
    from launcher.launch.gate import validate_for_launch as validate

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda1 / ext4 rw 0 0\nserver:/export {tmp_path / 'nfs'} nfs4 rw 0 0\n")
    monkeypatch.setattr(shared_fs, "MOUNTS", str(mounts))
    (tmp_path / "nfs").mkdir()  # the mount point
    assert shared_fs.shared_verdict(str(tmp_path / "nfs" / "runs" / "new"))[0] is True
    assert shared_fs.shared_verdict(str(tmp_path / "local")) == (False, "/ (ext4)")
    local = compose_cfg("cluster=slurm_dev", "cluster.nodes=2", f"run.dir={tmp_path / 'local'}")
    (w,) = [i for i in validate(local).warnings if i.code == "run_dir_not_shared"]
    assert "node-local" in w.message and "ext4" in w.message
    shared = compose_cfg("cluster=slurm_dev", "cluster.nodes=2", f"run.dir={tmp_path / 'nfs' / 'r'}")
    assert not [i for i in validate(shared).warnings if i.code == "run_dir_not_shared"]
    one = compose_cfg("cluster=slurm_dev", "cluster.nodes=1", f"run.dir={tmp_path / 'local'}")
    assert not [i for i in validate(one).warnings if i.code == "run_dir_not_shared"]


# ---- 11. in the run: Xid events, low utilisation, slowdown, OOM --------------------------------------------------


def test_xid_events_and_low_utilisation_on_the_nvml_double(tmp_path):
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps({"gpus": 2, "nodes": {"*": {"utilization": 50}, "n2": {"xid": [[0, 13]]}}}))
    sampler = HealthSampler(make_nvml_double(str(spec), "n2"), "n2", str(tmp_path), 60.0, 2, 95.0)
    assert sampler.sample() == 0  # Xid 13: the program's, reported, the node stays healthy
    spec.write_text(json.dumps({"gpus": 2, "nodes": {"*": {"utilization": 50}, "n2": {"xid": [[0, 13], [1, 79]]}}}))
    assert sampler.sample() == XID
    assert sampler.sample() == XID  # each Xid delivered once
    events = read_events(str(tmp_path))
    xids = [e for e in events if e["event"] == "xid"]
    assert [(e["gpu"], e["xid"], e["critical"]) for e in xids] == [(0, 13, False), (1, 79, True)]
    (health,) = [e for e in events if e["event"] == "health"]
    assert health["node"] == "n2" and health["kind"] == "xid" and "gpu1: Xid 79" in health["reasons"][0]
    lines = [json.loads(x) for x in open(tmp_path / "health.jsonl")]
    assert {(x["gpu"], x["xid"]) for x in lines if "xid" in x} == {(0, 13), (1, 79)}
    # Utilisation 50 % against the 95 % target: the first sample (before training) is skipped, then 2 samples.
    (low,) = [e for e in events if e["event"] == "low_utilization"]
    assert low["node"] == "n2" and low["utilization_mean_pct"] == 50.0 and low["target_pct"] == 95.0
    busy = tmp_path / "busy"
    busy.mkdir()
    spec.write_text(json.dumps({"gpus": 1, "nodes": {"*": {"utilization": 99}}}))
    ok_sampler = HealthSampler(make_nvml_double(str(spec), "n1"), "n1", str(busy), 60.0, 2, 95.0)
    for _ in range(4):
        ok_sampler.sample()
    assert not [e for e in read_events(str(busy)) if e["event"] == "low_utilization"]


def test_job_slowdown_against_its_own_baseline_and_the_plan():
    j = JobSlowdown(0.5, baseline_steps=3, persist=2, planned=1000.0, judge_plan=True)
    assert [j.update(s, r) for s, r in enumerate([400, 420, 410], 2)][-1] == [
        {"kind": "plan", "step": 4, "tokens_per_s": 410, "planned_tokens_per_s": 1000.0, "ratio": 0.41}
    ]
    assert j.update(5, 300) == []  # above half the baseline
    assert j.update(6, 150) == []  # one slow step is not a slowdown
    (ev,) = j.update(7, 100)
    assert ev["kind"] == "baseline" and ev["baseline_tokens_per_s"] == 410 and ev["vs_plan"] == 0.1
    assert j.update(8, 100) == []  # said once per streak
    cpu = JobSlowdown(0.5, 3, 2, planned=1000.0, judge_plan=False)
    assert [cpu.update(s, 10) for s in range(3)][-1] == []  # CPU: the plan's rates are not judged


def test_oom_says_states_or_activations_and_the_levers_that_fit(tmp_path):
    cfg = compose_cfg("parallel.tp=2", "parallel.sp=false", "parallel.zero=0", "parallel.micro_batch=4")
    gib = 2**30
    (tmp_path / "plan.json").write_text(
        json.dumps(
            {
                "gpu_memory_bytes": 80 * gib,
                "memory_bytes": {
                    "weights": 10 * gib,
                    "grads": 10 * gib,
                    "optimizer": 20 * gib,
                    "activations": 30 * gib,
                },
            }
        )
    )
    exc = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    msg = explain(cfg, str(tmp_path), exc, states_bytes=41 * gib, capacity=80 * gib, rank=3, node="n2")
    assert "the activations overflowed" in msg and "planned 40.00" in msg and "parallel.sp=true" in msg
    assert "parallel.recompute=full" in msg and "parallel.micro_batch=2" in msg and "zero" not in msg
    (ev,) = [e for e in read_events(str(tmp_path)) if e["event"] == "oom"]
    assert ev["part"] == "activations" and ev["rank"] == 3 and ev["node"] == "n2" and ev["states_bytes"] == 41 * gib
    assert ev["planned_states_bytes"] == 40 * gib and ev["planned_activations_bytes"] == 30 * gib
    full = explain(cfg, str(tmp_path), exc, states_bytes=75 * gib, capacity=80 * gib)
    assert "the states overflowed" in full and "parallel.zero=1" in full and "parallel.tp=4" in full
    assert "the states overflowed" in explain(cfg, str(tmp_path), exc, states_bytes=None, capacity=80 * gib)
    zero1 = compose_cfg("parallel.zero=1", "parallel.sp=true", "parallel.recompute=full", "parallel.micro_batch=1")
    assert levers(zero1, "states")[0].startswith("parallel.tp=") and levers(zero1, "activations") == [
        "parallel.cp=2 (the sequence split over more GPUs)"
    ]
    assert isinstance(Config().cluster.health.min_utilization_pct, float)


# ---- 12. nsys wrapping and its validation ------------------------------------------------------------------------


def test_nsys_wraps_the_chosen_ranks_with_the_profile_steps_capture_range(tmp_path, monkeypatch):
    from launcher.launch.gate import validate_for_launch as validate
    from launcher.ranks.nsys import nsys_prefix

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nsys").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nsys").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    gpu = ("cluster=dgx_h100", "cluster.kind=local", "cluster.nodes=1", "model=llama3_8b", "parallel=tp8")
    cfg = compose_cfg(*gpu, "train.nsys=true", "train.nvtx=true", "train.profile_steps=[3,4]", "train.nsys_ranks=[0,5]")
    run = str(tmp_path / "run")
    argv = nsys_prefix(cfg, 5, run)
    assert argv[:2] == ["nsys", "profile"] and "--capture-range=cudaProfilerApi" in argv
    assert "--capture-range-end=stop" in argv and argv[-1] == os.path.join(run, "profile", "nsys_rank5")
    assert nsys_prefix(cfg, 1, run) == []  # not a chosen rank
    assert validate(cfg).errors == []
    bad = compose_cfg(*gpu, "train.nsys=true", "train.nsys_ranks=[8]")
    errors = {i.message for i in validate(bad).errors if i.key.startswith("train.nsys")}
    assert any("profile_steps" in m for m in errors) and any("[8]" in m for m in errors)
    cpu = compose_cfg("train.nsys=true", "train.profile_steps=[1,2]", "cluster.gpus_per_node=2")
    assert any("CPU run" in i.message for i in validate(cpu).errors)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert any("not on PATH" in i.message for i in validate(cfg).errors)
