"""The real preflight on this machine: CPU ranks with gloo, through the meshrun CLI and in-process."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT
from helpers.doubles import write_port

from training.contract.rundir.events import read_events
from training.preflight.collectives import bus_factor

PY = os.path.join(ROOT, ".venv", "bin", "python")


def meshrun(*overrides, timeout=120):
    return subprocess.run(
        [PY if os.path.exists(PY) else sys.executable, "-m", "launcher", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # CPU ranks started by the CLI
def test_local_preflight_cpu_reports_without_failing(tmp_path):
    run_dir = str(tmp_path / "run")
    # Small probes (the checks and their arithmetic are the same at any size; the defaults' 8 MiB x 5 iterations
    # only cost the shared cores time).
    sizes = "cluster.preflight.collective_sizes_mb=[0.25,1]"
    probes = [sizes, "cluster.preflight.collective_iters=2", "cluster.preflight.matmul_size=256"]
    t0 = time.monotonic()
    p = meshrun("action=preflight", "cluster=local", f"run.dir={run_dir}", *probes)
    wall_s = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.load(open(os.path.join(run_dir, "preflight.json")))
    assert data["status"] in ("ok", "warn") and data["bad_nodes"] == []
    by = {}
    for c in data["checks"]:
        by.setdefault(c["name"], []).append(c)
    assert by["gpu.nvml"][0]["status"] == "ok" and "no GPU expected" in by["gpu.nvml"][0]["reason"]
    assert by["ib.hcas"][0]["status"] == "ok"
    assert isinstance(by["os.swappiness"][0]["found"], int) and by["os.swappiness"][0]["expected"]
    # One matmul verdict per rank; on shared CPU cores a slow rank is a straggler *warning* only.
    mm = by["gpu.matmul"] + by.get("gpu.straggler", [])
    assert sorted(c["subject"] for c in mm) == ["rank0", "rank1", "rank2", "rank3"]
    assert all(c["found"] > 0 and c["status"] != "fail" for c in mm)
    # gloo busbw for blocks of 2 ranks and for all 4, every op, consistent with nccl-tests' factors.
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        subjects = sorted(c["subject"] for c in by[f"coll.{op}"])
        assert subjects == ["ranks[0-1]", "ranks[0-3]", "ranks[2-3]"]
        for c in by[f"coll.{op}"]:
            n = 2 if c["subject"] != "ranks[0-3]" else 4
            f = c["found"]
            assert f["bytes"] == 2**20  # the whole array of the largest size
            assert f["busbw_gbps"] == pytest.approx(f["algbw_gbps"] * bus_factor(op, n), rel=0.02, abs=2e-3)
            assert f["algbw_gbps"] == pytest.approx(f["bytes"] / (f["time_ms"] / 1e3) / 1e9, rel=0.02)
    # The rank's own clock, measured (positive, inside the launch around it); how long 4 CPU ranks take on shared
    # cores is the machine's load, not the preflight's (the small probes are pinned by the sizes above).
    assert 0 < data["meta"]["elapsed_s"] <= wall_s, (data["meta"]["elapsed_s"], wall_s)
    assert "job:" in p.stdout and "coll.all_reduce" in p.stdout
    ev = [e for e in read_events(run_dir) if e["event"] == "preflight"]
    assert len(ev) == 1 and ev[0]["bad_nodes"] == [] and ev[0]["job_id"] == "local"


@pytest.mark.slow  # CPU ranks started by the CLI
def test_fault_injected_on_one_node_fails_that_node_with_exit_4(tmp_path):
    good, bad = str(tmp_path / "ib_good"), str(tmp_path / "ib_bad")
    write_port(good, "mlx5_0")
    write_port(bad, "mlx5_0", state="1: DOWN", phys="2: Polling")
    host = socket.gethostname().split(".")[0]
    run_dir = str(tmp_path / "run")
    p = meshrun(
        "action=preflight",
        "cluster=local",
        "cluster.nodes=2",
        "cluster.gpus_per_node=1",
        f"run.dir={run_dir}",
        "cluster.preflight.ib_hcas=[mlx5_0]",
        "cluster.preflight.ib_rate_gbps=400",
        f"cluster.preflight.ib_sysfs_root={good}",
        "cluster.preflight.collective_sizes_mb=[1]",
        # Dict keys are added with '+' (Hydra struct mode), as a user would on the command line.
        f"+cluster.preflight.ib_sysfs_root_by_node.{host}-1={bad}",
    )
    assert p.returncode == 4, p.stderr[-3000:]
    data = json.load(open(os.path.join(run_dir, "preflight.json")))
    assert data["bad_nodes"] == [f"{host}-1"]
    assert data["nodes"][f"{host}-0"] != "fail"
    failing = {(c["name"], c["node"]) for c in data["checks"] if c["status"] == "fail"}
    assert failing == {("ib.state", f"{host}-1"), ("ib.phys_state", f"{host}-1")}
    ev = [e for e in read_events(run_dir) if e["event"] == "preflight"]
    assert ev[-1]["bad_nodes"] == [f"{host}-1"] and ev[-1]["status"] == "fail"


def test_before_training_gate_and_warn_in_process(tmp_path, monkeypatch):
    from training.contract.config import Config
    from training.preflight.runner import before_training

    bad = str(tmp_path / "ib_bad")
    write_port(bad, "mlx5_0", rate="100 Gb/sec (4X EDR)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    cfg = Config()
    pf = cfg.cluster.preflight
    pf.ib_hcas, pf.ib_rate_gbps, pf.ib_sysfs_root, pf.collective_sizes_mb = ["mlx5_0"], 400.0, bad, [0.25]
    before_training(cfg, str(tmp_path))  # off: nothing runs
    assert not os.path.exists(tmp_path / "preflight.json")
    pf.mode = "warn"
    before_training(cfg, str(tmp_path))  # warn: reports the bad rate, training goes on
    assert json.load(open(tmp_path / "preflight.json"))["status"] == "fail"
    pf.mode = "gate"
    with pytest.raises(SystemExit) as exc:
        before_training(cfg, str(tmp_path))
    assert exc.value.code == 4
    assert [e["mode"] for e in read_events(str(tmp_path)) if e["event"] == "preflight"] == ["warn", "gate"]


def test_launcher_side_never_imports_torch():
    code = (
        "import sys, launcher.launch.preflight, training.preflight.runner, training.preflight.report; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(launcher.launch.preflight.preflight_argv('/r')[1:])"
    )
    p = subprocess.run(
        [PY if os.path.exists(PY) else sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['-m', 'training.preflight', '/r']"


def _dev_cluster_up():
    try:
        return "UP" in subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _dev_cluster_up(), reason="dev Slurm cluster not running (bash slurm/dev-cluster.sh up)")
def test_slurm_preflight_job_finds_the_injected_bad_node(tmp_path):
    good, bad = str(tmp_path / "ib_good"), str(tmp_path / "ib_bad")
    write_port(good, "mlx5_0")
    write_port(bad, "mlx5_0", rate="100 Gb/sec (4X EDR)")
    run_dir = str(tmp_path / "run")
    p = meshrun(
        "action=preflight",
        "cluster=slurm_dev",
        "cluster.nodes=2",
        "cluster.gpus_per_node=1",
        f"run.dir={run_dir}",
        "cluster.preflight.ib_hcas=[mlx5_0]",
        "cluster.preflight.ib_rate_gbps=400",
        f"cluster.preflight.ib_sysfs_root={good}",
        "cluster.preflight.collective_sizes_mb=[1]",
        f"+cluster.preflight.ib_sysfs_root_by_node.n2={bad}",
        "cluster.exclude=n3",
        timeout=240,
    )
    assert p.returncode == 4, p.stderr[-3000:]
    data = json.load(open(os.path.join(run_dir, "preflight.json")))
    assert data["bad_nodes"] == ["n2"] and data["nodes"]["n1"] != "fail"
    assert {(c["name"], c["node"]) for c in data["checks"] if c["status"] == "fail"} == {("ib.rate", "n2")}
    assert "ib.rate" in p.stdout and "bad nodes: n2" in p.stdout
