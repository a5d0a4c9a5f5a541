"""The CUDA / NCCL paths that no GPU has run yet, shown on CPU wherever a stand-in can show them: the
NVML double, a patched torch module, a stand-in device, a small collective timeout. bench/gpu_check.sh --dry
runs in tests/bench/test_gpu_check.py; bench/gpu_preflight.sh --dry and the offline install mode run here."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import types
import zipfile

import pynvml
import pytest
import torch
from helpers import ROOT
from helpers.dist import run_distributed

PY = sys.executable


# ---------------------------------------------------------------- bench scripts end to end (--dry)
@pytest.mark.slow  # the preflight's CPU ranks
def test_gpu_preflight_dry_runs_every_check(tmp_path):
    """Would-fail 1: the script imported a save_config that does not exist. Now its --dry mode runs the real
    preflight (2 gloo ranks, NVML answered by the double) and every check reports a computed value."""
    run_dir = tmp_path / "pre flight"
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu_preflight.sh"), "--dry", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SIZES_MB": "1"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    checks = json.loads((run_dir / "preflight.json").read_text())["checks"]
    by = {(c["name"], c["subject"]): c for c in checks}
    assert all(c["status"] != "fail" for c in checks), [c for c in checks if c["status"] == "fail"]
    assert by[("gpu.count", "")]["found"] == 2
    for gpu in ("gpu0", "gpu1"):  # per-GPU NVML checks ran against the double's values
        assert by[("gpu.temperature", gpu)]["found"] == 40
        assert by[("gpu.ecc_uncorrected_volatile", gpu)]["found"] == 0
        assert by[("gpu.mig", gpu)]["found"] == "disabled"
        assert by[("gpu.foreign_memory", gpu)]["found"] == 0
    for rank in ("rank0", "rank1"):
        # A rank measured much slower than its peer is reported as gpu.straggler (a warning) instead of
        # gpu.matmul: on a loaded 2-core machine either can happen; both carry the measured rate.
        rate = by.get(("gpu.matmul", rank)) or by[("gpu.straggler", rank)]
        assert rate["found"] > 0
    assert by[("coll.all_reduce", "ranks[0-1]")]["found"]["busbw_gbps"] > 0
    # Only local rank 0 reads NVML: the others' missing driver used to fail version.driver on every node.
    assert by[("version.driver", "")]["status"] == "ok" and by[("version.driver", "")]["found"] == "550.54.15"


def _python_without_torch(tmp_path) -> str:
    """The interpreter this venv was made from when it has neither torch nor Hydra, else an empty venv's."""
    base = getattr(sys, "_base_executable", "")
    if base and subprocess.run([base, "-c", "import torch, hydra"], capture_output=True).returncode != 0:
        if subprocess.run([base, "-c", "import torch"], capture_output=True).returncode != 0:
            return base
    bare = tmp_path / "bare"
    subprocess.run([base or PY, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    return str(bare / "bin/python")


def test_gpu_check_refuses_an_interpreter_without_the_project(tmp_path):
    """Issue 30: the script ran whatever python came first; a foreign one now stops it with exit 2 and the fix
    instead of a misleading "none of ['tiny'] fits"."""
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--dry", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": _python_without_torch(tmp_path)},
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "cannot import" in p.stderr and "--install-wheels" in p.stderr


def _repack_wheel(dist_name: str, out_dir) -> str:
    """A wheel of an installed distribution, rebuilt from its RECORD (the test has no package index)."""
    from importlib.metadata import distribution

    d = distribution(dist_name)
    files = [f for f in d.files if not str(f).startswith("..") and "__pycache__" not in str(f)]
    info = next(f for f in d.files if str(f).endswith(".dist-info/METADATA")).parent
    name, version = d.metadata["Name"].replace("-", "_"), d.version
    path = os.path.join(out_dir, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for f in files:
            z.write(f.locate(), str(f))
        if not any(str(f) == f"{info}/WHEEL" for f in files):
            z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return path


@pytest.mark.slow  # a venv and an offline pip install of three wheels (tests audit 2026-12-03, flaky 13)
def test_install_mode_uses_the_base_torch_and_the_carried_wheels(tmp_path):
    """Would-fail 4: on a GPU machine with CUDA torch preinstalled and no index, bench/gpu_venv.sh makes a
    venv that sees the base interpreter's torch and installs the CLI's pure-Python dependencies from a folder
    of wheels, offline. Stand-ins: this project's venv as the 'CUDA' interpreter, wheels repacked from it."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist_name in ("hydra-core", "omegaconf", "antlr4-python3-runtime"):
        _repack_wheel(dist_name, wheels)
    venv = tmp_path / "gpu venv"
    script = os.path.join(ROOT, "bench", "gpu_venv.sh")
    p = subprocess.run(
        ["bash", script, str(wheels), str(venv)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BASE_PYTHON": _python_without_torch(tmp_path)},
    )
    assert p.returncode == 2 and "has no torch" in p.stderr and not venv.exists(), p.stderr
    p = subprocess.run(
        ["bash", script, str(wheels), str(venv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BASE_PYTHON": PY, "PIP_NO_INDEX": "1"},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    probe = (
        "import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m).origin "
        "for m in ('hydra', 'omegaconf', 'antlr4', 'torch', 'launcher', 'meshrun_conf')}))"
    )
    where = json.loads(
        subprocess.run(
            [str(venv / "bin/python"), "-c", probe], capture_output=True, text=True, check=True, cwd=str(tmp_path)
        ).stdout
    )
    for mod in ("hydra", "omegaconf", "antlr4"):  # from the carried wheels, inside the new venv
        assert where[mod].startswith(str(venv)), where
    assert where["torch"] == torch.__file__  # the base interpreter's own torch, not a download
    assert os.path.dirname(os.path.dirname(where["launcher"])) == ROOT  # this checkout
    assert os.path.realpath(where["meshrun_conf"]) == os.path.join(ROOT, "conf", "__init__.py")  # its presets


def test_makefile_comment_matches_what_install_does(tmp_path):
    """The Makefile's install comment names a command and the scripts behind it: they exist, and the command as
    written reaches bench/gpu_venv.sh with DIR (its own refusal of a base interpreter without torch: exit 2,
    nothing made), so a renamed flag or script, or a flag the check script no longer passes on, fails here."""
    import re

    text = open(os.path.join(ROOT, "Makefile")).read()
    m = re.search(r"bash (bench/\S+\.sh) (--[\w-]+) DIR \((bench/\S+\.sh); DIR from (bench/\S+\.sh)\)", text)
    assert m, "the Makefile's comment on GPU machines without an index"
    check, flag, venv_script, wheels_script = m.groups()
    for script in (check, venv_script, wheels_script):
        assert os.path.isfile(os.path.join(ROOT, script)), script
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    wheels.mkdir()
    p = subprocess.run(
        ["bash", os.path.join(ROOT, check), flag, str(wheels)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BASE_PYTHON": _python_without_torch(tmp_path), "VENV": str(venv)},
    )
    assert p.returncode == 2 and "gpu_venv:" in p.stderr and "has no torch" in p.stderr, p.stderr
    assert not venv.exists()


# ---------------------------------------------------------------- MFU peak (would-fail 2)
def test_mfu_peak_on_cuda_is_the_warmed_up_saturating_probe(monkeypatch):
    import training.preflight.matmul as matmul
    import training.run.loop as loop

    calls = []
    monkeypatch.setattr(
        matmul,
        "measure_tflops",
        lambda device, n, iters=0, dtype=None: calls.append((device, n, iters, dtype)) or {"tflops": 700.0},
    )
    peak = loop.measure_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == 700.0e12
    assert calls and all(c == ("cuda:0", 8192, 0, torch.bfloat16) for c in calls)  # iters 0: ~0.2 s timed each


def test_matmul_probe_warms_up_before_timing(monkeypatch):
    """The first call (kernel selection, first-touch allocation) is never timed."""
    import training.preflight.matmul as matmul

    stamps = []
    real_mm, real_clock = torch.mm, time.perf_counter
    monkeypatch.setattr(torch, "mm", lambda a, b: stamps.append("mm") or real_mm(a, b))
    monkeypatch.setattr(matmul.time, "perf_counter", lambda: stamps.append("clock") or real_clock())
    out = matmul.measure_tflops("cpu", 64, iters=3)
    assert stamps[0] == "mm" and stamps.count("mm") == 4 and out["iters"] == 3


# ---------------------------------------------------------------- AdamW scratch (would-fail 3)
def test_adamw_scratch_is_one_block_on_accelerators(monkeypatch):
    """Meta tensors stand in for a GPU shard: the scratch is one DEVICE_BLOCK, not the shard's size."""
    from training.optim.adamw import ShardedAdamW

    assert ShardedAdamW.DEVICE_BLOCK * 4 == 64 * 2**20  # the bound on a GPU: 64 MiB of fp32
    monkeypatch.setattr(ShardedAdamW, "DEVICE_BLOCK", 4096)  # a small block keeps the meta ops' count small
    n = 3 * ShardedAdamW.DEVICE_BLOCK + 5
    layout = types.SimpleNamespace(params=[torch.empty(1, device="meta")], shard_size=n, segments=[])
    opt = ShardedAdamW(layout, 0.9, 0.95, 1e-8, 0.0)
    w, g = torch.empty(n, device="meta"), torch.empty(n, device="meta")
    opt.update(w, g, lr=1e-3, step=1)
    assert opt.scratch_bytes() == 4096 * 4


def test_adamw_blocks_do_not_change_the_update(monkeypatch):
    from training.optim.adamw import ShardedAdamW

    def run(block):
        torch.manual_seed(0)
        n = 1000
        layout = types.SimpleNamespace(params=[torch.empty(1)], shard_size=n, segments=[])
        opt = ShardedAdamW(layout, 0.9, 0.95, 1e-8, 0.0)
        monkeypatch.setattr(opt, "block_elements", lambda device: block)
        w = torch.randn(n)
        for step in (1, 2, 3):
            opt.update(w, torch.randn(n), lr=1e-2, step=step, grad_coef=0.5)
        return w, opt.scratch_bytes()

    whole, whole_bytes = run(1000)
    blocked, blocked_bytes = run(97)
    workers = min(torch.get_num_threads(), -(-1000 // 97))  # one scratch block per worker thread of the update
    assert torch.equal(whole, blocked) and blocked_bytes == 97 * 4 * workers < whole_bytes


# ---------------------------------------------------------------- preflight details
def _double(tmp_path, **values):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpus": 2, "nodes": {"*": values}}))
    return str(path)


def _node_checks(tmp_path, monkeypatch, visible=None, **values):
    from training.contract.config import Config
    from training.preflight.runner import node_checks

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = Config()
    cfg.cluster.device, cfg.cluster.gpus_per_node = "cuda", 2
    cfg.cluster.health.nvml_double = _double(tmp_path, **values)
    checks, facts = node_checks(cfg, "n1")
    return {(c.name, c.subject): c for c in checks}, facts


def test_preflight_double_faults_fail_and_mig_is_refused(tmp_path, monkeypatch):
    by, _ = _node_checks(tmp_path, monkeypatch, ecc_uncorrected=3, mig=1)
    assert by[("gpu.ecc_uncorrected_volatile", "gpu1")].status == "fail"
    assert by[("gpu.mig", "gpu0")].status == "fail" and "MIG" in by[("gpu.mig", "gpu0")].reason


def test_preflight_checks_only_the_jobs_gpus(tmp_path, monkeypatch):
    """NVML lists every GPU of the node; CUDA_VISIBLE_DEVICES (UUIDs or indices) names the job's."""
    by, facts = _node_checks(tmp_path, monkeypatch, visible="GPU-00000000-0000-0000-0000-000000000001")
    assert facts["gpu_count"] == 1 and ("gpu.temperature", "gpu1") in by and ("gpu.temperature", "gpu0") not in by
    by, facts = _node_checks(tmp_path, monkeypatch, visible="0")
    assert facts["gpu_count"] == 1 and ("gpu.temperature", "gpu0") in by and ("gpu.temperature", "gpu1") not in by


def test_throttle_reasons_on_drivers_before_r535():
    """A new nvidia-ml-py on an old driver: the clocks-event call is FUNCTION_NOT_FOUND, the throttle-reasons
    call answers, and a hardware slowdown still fails."""
    from helpers.doubles import fake_nvml, healthy_gpu

    from training.contract.config import PreflightConfig
    from training.preflight.gpu_nvml import check_gpus

    gpu = healthy_gpu(0)
    m = fake_nvml([gpu])

    def not_found(h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    m.nvmlDeviceGetCurrentClocksEventReasons = not_found
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: pynvml.nvmlClocksThrottleReasonHwSlowdown
    checks, _ = check_gpus(m, PreflightConfig(), 1, "n1", own_pids={1})
    throttle = [c for c in checks if c.name == "gpu.throttle"]
    assert throttle[0].status == "fail" and throttle[0].found == ["HW slowdown"]


def test_nvml_library_mismatch_is_a_reason_not_a_crash(monkeypatch):
    from training.preflight import gpu_nvml

    def mismatch():
        raise pynvml.NVMLLibraryMismatchError("mismatch")

    monkeypatch.setattr(pynvml, "nvmlInit", mismatch)
    nvml, why = gpu_nvml.load_nvml()
    assert nvml is None and "NVMLLibraryMismatchError" in why


def test_nvml_library_mismatch_in_a_query_is_a_warning_not_a_crash():
    """R21: on a driver before R510 pynvml's unversioned process query raises NVMLLibraryMismatchError (not an
    NVMLError); `nvml_query` makes it a reason, and the foreign-memory check warns that it could not look."""
    from helpers.doubles import fake_nvml, healthy_gpu

    from training.contract.config import PreflightConfig
    from training.preflight.gpu_nvml import check_gpus, nvml_query

    m = fake_nvml([healthy_gpu(0)])
    m.NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    def old_driver(h):
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called")

    m.nvmlDeviceGetComputeRunningProcesses = old_driver
    value, why = nvml_query(m, "nvmlDeviceGetComputeRunningProcesses", None)
    assert value is None and "Unversioned function called" in why
    checks, _ = check_gpus(m, PreflightConfig(), 1, "n1", own_pids={1})
    foreign = [c for c in checks if c.name == "gpu.foreign_memory"]
    assert foreign[0].status == "warn" and "cannot list the GPU's processes" in foreign[0].reason

    def broken(h):  # anything else still escapes: a real fault is not hidden as "not supported"
        raise RuntimeError("driver fault")

    m.nvmlDeviceGetComputeRunningProcesses = broken
    with pytest.raises(RuntimeError):
        nvml_query(m, "nvmlDeviceGetComputeRunningProcesses", None)


def test_crc_switch_falls_back_on_torch_without_serialization_config(monkeypatch):
    """R12: torch.utils.serialization.config is torch >= 2.6; pyproject admits 2.4. Without it the checkpoint
    writer turns torch.save's record CRCs off through torch.serialization.set_crc32_options, and without that
    too it leaves them on (a slower save); importing the writer never fails."""
    import torch.serialization as ser

    from training.checkpoint import crc_writer

    saved = ser.get_crc32_options()

    def switch_without_config(mp):
        with mp.context() as blocked:
            blocked.setitem(sys.modules, "torch.utils.serialization", None)  # as on torch 2.4: no such module
            return crc_writer._zip_crc_switch()

    get, put = switch_without_config(monkeypatch)
    assert (get, put) == (ser.get_crc32_options, ser.set_crc32_options)
    try:
        put(False)  # (torch 2.13's set_crc32_options writes the config this test hid from the writer)
        assert ser.get_crc32_options() is False
    finally:
        ser.set_crc32_options(saved)
    monkeypatch.delattr(ser, "set_crc32_options")
    get, put = switch_without_config(monkeypatch)
    put(False)  # nothing to switch: a no-op
    assert get() is True and ser.get_crc32_options() == saved


def test_engine_env_sets_the_allocator_and_gloo_interface_on_gpus():
    """R5: cuda ranks get expandable segments unless cluster.env sets the allocator itself; R2: the gloo group
    binds to NCCL's interface when NCCL_SOCKET_IFNAME names it exactly (gloo has no prefix or exclusion form);
    R1: the dgx_h100 preset leaves the site's interface, GID index and NVLS unset."""
    from helpers.cli import compose_cfg

    from launcher.ranks.processes import engine_env, gloo_ifname

    cfg = compose_cfg("cluster=dgx_h100", "parallel=tp8")
    assert not {"NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "NCCL_NVLS_ENABLE"} & set(cfg.cluster.env)
    env = engine_env(cfg)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "GLOO_SOCKET_IFNAME" not in env
    cfg.cluster.env = {"NCCL_SOCKET_IFNAME": "=ens1f0,ens1f1", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}
    env = engine_env(cfg)
    assert env["GLOO_SOCKET_IFNAME"] == "ens1f0,ens1f1" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"
    cfg.cluster.env = {"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "bond0"}  # the cluster's own wins
    assert engine_env(cfg)["GLOO_SOCKET_IFNAME"] == "bond0"
    assert [gloo_ifname(v) for v in ("eth", "^docker,lo", "", " =eth0 ")] == ["", "", "", "eth0"]
    cpu = engine_env(compose_cfg())
    assert "PYTORCH_CUDA_ALLOC_CONF" not in cpu and "GLOO_SOCKET_IFNAME" not in cpu


def test_pinned_offload_arena_is_planned_at_the_host_allocators_rounding():
    """R6: torch's host allocator rounds a pinned allocation up to a power of two. plan.json's host_offload stays
    the arena's bytes (the optimizer's memory_report equals it); host_offload_pinned is what a GPU rank's one
    pinned arena takes, and the preflight's host-memory check counts that. A CPU rank pins nothing."""
    from helpers.cli import compose_cfg

    from launcher.plan.estimate import make_plan
    from launcher.plan.memory import pinned_host_bytes
    from training.preflight import node_ops

    assert [pinned_host_bytes(n) for n in (0, 1, 2, 3, 406_233_088, 2**29, 2**29 + 1)] == [
        0, 1, 2, 4, 2**29, 2**29, 2**30,
    ]  # fmt: skip
    gpu = make_plan(compose_cfg("cluster=dgx_h100", "model=gpt_1p3b", "parallel=single", "parallel.offload=cpu"))
    mem = gpu.memory_bytes
    assert mem["host_offload"] > 0 and mem["host_offload_pinned"] == pinned_host_bytes(mem["host_offload"])
    assert mem["host_offload"] < mem["host_offload_pinned"] < 2 * mem["host_offload"]
    cfg = compose_cfg("cluster.preflight.host_memory_per_rank_gb=0")
    assert node_ops.host_memory_needed(cfg, 2, {"memory_bytes": mem})["offload"] == 2 * mem["host_offload_pinned"]
    cpu = make_plan(compose_cfg("parallel.offload=cpu")).memory_bytes
    assert cpu["host_offload_pinned"] == cpu["host_offload"] > 0
    none = make_plan(compose_cfg("cluster=dgx_h100", "model=gpt_1p3b", "parallel=single")).memory_bytes
    assert none["host_offload"] == none["host_offload_pinned"] == 0


def test_sibling_ranks_are_job_processes_not_foreign(tmp_path):
    """Likely 5: the job's other ranks (same parent: the launcher or srun's step daemon) hold GPU memory by the
    time the preflight runs; they are not 'other processes'."""
    sibling = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        out = subprocess.run(
            [
                PY,
                "-c",
                "import os, json; from training.preflight.runner import _job_pids; "
                "print(json.dumps([os.getpid(), sorted(_job_pids())]))",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            timeout=60,
        ).stdout
        me, pids = json.loads(out)
        assert {me, os.getpid(), sibling.pid} <= set(pids)
    finally:
        sibling.kill()
        sibling.wait()


def test_cold_started_slurm_ranks_are_job_processes_by_their_job_id(tmp_path):
    """Issue 43 item 8: cold-started Slurm ranks each have a parent of their own (their rank_task wrapper), so the
    sibling rule misses them; every process whose environment carries this job's SLURM_JOB_ID is the job's. A
    /proc of stand-ins: a cold rank of this job (another parent), a process of job 8, one whose environment
    cannot be read (another user's), and a sibling."""
    from training.preflight.runner import _job_pids

    parent = os.getppid()

    def proc(pid, ppid, env):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (python (rank)) S {ppid} 1 1 0")
        if env is not None:
            (d / "environ").write_bytes(b"\0".join(e.encode() for e in env) + b"\0")

    proc(101, 9001, ["PATH=/bin", "SLURM_JOB_ID=7", "SLURM_PROCID=1"])  # cold rank of this job
    proc(102, 9002, ["SLURM_JOB_ID=8"])  # another job on the node
    proc(103, 9003, ["SLURM_JOB_ID=77"])  # a prefix of nothing: not job 7
    proc(104, 9004, None)  # unreadable environment
    proc(105, parent, [])  # a sibling (same parent): the local launcher's rule
    (tmp_path / "self").mkdir()
    got = _job_pids(str(tmp_path), {"SLURM_JOB_ID": "7"})
    assert {101, 105} <= got and not {102, 103, 104} & got
    assert 101 not in _job_pids(str(tmp_path), {})  # no Slurm job: only the family


def test_a_stale_rank_of_an_earlier_attempt_of_the_same_job_is_foreign(tmp_path):
    """A requeued job keeps its SLURM_JOB_ID; a rank left over from the attempt before (still holding GPU memory)
    is not this attempt's: the job's processes must also carry this attempt's MESHRUN_ATTEMPT and
    SLURM_RESTART_COUNT (both set or unset alike)."""
    from training.preflight.runner import _job_pids

    def proc(pid, env):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (python) S {9000 + pid} 1 1 0")
        (d / "environ").write_bytes(b"\0".join(e.encode() for e in env) + b"\0")

    proc(201, ["SLURM_JOB_ID=7", "MESHRUN_ATTEMPT=1", "SLURM_RESTART_COUNT=1"])  # a cold rank of this attempt
    proc(202, ["SLURM_JOB_ID=7", "MESHRUN_ATTEMPT=0"])  # attempt 0's leftover (no restart count yet)
    proc(203, ["SLURM_JOB_ID=7", "MESHRUN_ATTEMPT=1"])  # not Slurm's count of this attempt: not the same
    proc(204, ["SLURM_JOB_ID=7", "MESHRUN_ATTEMPT=10", "SLURM_RESTART_COUNT=1"])  # a prefix of nothing
    me = {"SLURM_JOB_ID": "7", "MESHRUN_ATTEMPT": "1", "SLURM_RESTART_COUNT": "1"}
    got = _job_pids(str(tmp_path), me)
    assert 201 in got and not {202, 203, 204} & got
    # The first attempt: no restart count on either side; attempt 1's rank is not attempt 0's.
    first = _job_pids(str(tmp_path), {"SLURM_JOB_ID": "7", "MESHRUN_ATTEMPT": "0"})
    assert 202 in first and not {201, 203, 204} & first


def test_gpu_busbw_sweep_reaches_bus_bandwidth_sizes():
    from training.preflight.collectives import GPU_BUSBW_MB, sweep_sizes_mb

    assert sweep_sizes_mb([1.0, 8.0], on_gpu=False) == [1.0, 8.0]
    assert sweep_sizes_mb([1.0, 8.0], on_gpu=True)[-1] == GPU_BUSBW_MB >= 64
    assert sweep_sizes_mb([8.0, 512.0], on_gpu=True) == [8.0, 512.0]


def test_ib_congestion_drops_warn_and_link_errors_fail():
    from training.preflight.ib_sysfs import Port, _counter_check

    p = Port("mlx5_0", 1)
    p.counters = {"port_xmit_discards": 50, "symbol_error": 0}
    assert _counter_check(p, {"port_xmit_discards": 10, "symbol_error": 0}).status == "warn"
    p.counters["symbol_error"] = 2
    assert _counter_check(p, {"port_xmit_discards": 10, "symbol_error": 0}).status == "fail"


# ---------------------------------------------------------------- devices, threads, NUMA
def test_cuda_device_is_local_rank_modulo_visible_devices(monkeypatch):
    from training.parallel.mesh import local_cuda_index

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task=1: each task sees one GPU
    assert [local_cuda_index(r) for r in range(4)] == [0, 0, 0, 0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert local_cuda_index(3) == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        local_cuda_index(0)


def test_async_save_thread_runs_on_the_ranks_device(monkeypatch):
    """Likely 6: a new thread starts on GPU 0; the save thread sets the rank's device before any work."""
    from training.checkpoint.manager import writer_thread

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.get_ident(), torch.device(d))))
    pool = writer_thread(torch.device("cuda", 3))
    worker = pool.submit(threading.get_ident).result()
    pool.shutdown()
    assert seen == [(worker, torch.device("cuda", 3))] and worker != threading.get_ident()
    pool = writer_thread(torch.device("cpu"))
    pool.submit(lambda: None).result()
    pool.shutdown()
    assert len(seen) == 1  # CPU ranks touch no CUDA state


def test_numa_follows_the_physical_gpu_under_cgroup_renumbering():
    from launcher.ranks.numa import visible_gpu

    # --gpus-per-task=1 with ConstrainDevices: every task sees "0"; the step owns physical GPUs 4-7.
    assert [visible_gpu(r, "0", "4,5,6,7") for r in range(4)] == [4, 5, 6, 7]
    assert visible_gpu(1, "0,1", "2,3") == 3  # renumbered view of the step's two GPUs
    assert visible_gpu(1, "2,3", "2,3") == 3  # not renumbered
    assert visible_gpu(1, "0,1", None) == 1 and visible_gpu(0, "1", None) == 1  # no Slurm: as before


class _FakeEvent:
    """torch.cuda.Event stand-in: the 'device' records at a fake clock; elapsed_time in ms like CUDA's."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_compute_time_uses_events_on_the_compute_stream(monkeypatch):
    """Likely 8: no device-wide synchronize; each span is a pair of events, read after the last one."""
    from training.observe.busy_timer import BusyTimer

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")

    def forbidden(*a, **k):
        raise AssertionError("device-wide synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    timer = BusyTimer(torch.device("cuda", 0))
    for start, stop in ((1.0, 1.25), (2.0, 2.5)):
        _FakeEvent.clock[0] = start
        timer.start()
        _FakeEvent.clock[0] = stop
        timer.stop()
    assert timer.seconds() == pytest.approx(0.75)


# ---------------------------------------------------------------- collectives on older torch
def test_single_collectives_fall_back_on_older_torch(monkeypatch):
    import torch.distributed as dist

    import training.parallel.collectives as coll

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    try:
        importlib.reload(coll)
        assert coll._all_gather_base is dist.all_gather_into_tensor
        assert coll._reduce_scatter_base is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(coll)


def test_no_module_calls_the_new_collective_names_directly():
    import ast

    offenders = []
    for base in ("training", "launcher"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, base)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    for node in ast.walk(ast.parse(open(path).read())):
                        if (
                            isinstance(node, ast.Attribute)
                            and node.attr.endswith("_single")
                            and isinstance(node.value, ast.Name)
                            and node.value.id == "dist"
                            and node.attr != "all_to_all_single"
                        ):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not offenders, offenders


# ---------------------------------------------------------------- planner
def _cfg(**model):
    from training.contract.config import Config

    cfg = Config()
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_cuda_activation_profile_matches_what_a_16bit_layer_saves():
    """Likely 9, then issue 43: measured (saved-tensor hooks) bytes of one bf16 layer with math attention and
    dropout equal the planner's CUDA profile, which is Megatron's accounting again: 1-byte boolean dropout masks
    and only the 16-bit probabilities of the softmax (computed in fp32 inside; training/model/dropout_softmax.py)."""
    from launcher.plan.memory import device_profile, layer_activation_bytes
    from training.model.gpt import build_gpt
    from training.observe.saved_bytes import SavedBytes
    from training.parallel.mesh import ProcessMesh

    def saved(layers):
        cfg = _cfg(num_layers=layers, dropout=0.1, attention="math")
        torch.manual_seed(0)
        chunk = build_gpt(cfg, ProcessMesh.single(), torch.bfloat16)[0]
        chunk.train()
        tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
        with SavedBytes(chunk.parameters()) as counted:
            chunk(tokens, tokens)
        return counted.total

    cfg = _cfg(dropout=0.1, attention="math")
    cfg.train.precision, cfg.cluster.device, cfg.parallel.micro_batch = "bf16", "cuda", 1
    cuda = device_profile(cfg)
    assert cuda.mask_bytes == 1 and not cuda.softmax_fp32
    # The one difference of this layer between the devices: CPU's LayerNorm keeps a bf16 input's mean and
    # rstd in bf16, CUDA's in fp32 (the profile's 4 B statistics).
    assert saved(2) - saved(1) == layer_activation_bytes(cfg, dataclasses.replace(cuda, stats_bytes=2))


def test_fits_keeps_headroom_for_context_nccl_and_fragmentation():
    from launcher.plan.estimate import make_plan
    from launcher.plan.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION

    cfg = _cfg()
    cfg.cluster.gpus_per_node, cfg.parallel.global_batch = 1, 1
    cpu = make_plan(cfg)
    assert cpu.reserve_bytes == 0
    cfg.cluster.device = "cuda"
    cfg.cluster.gpu_memory_gb = (cpu.memory_bytes["total"] + CUDA_CONTEXT_BYTES // 2) / 1e9  # fits allocated only
    gpu = make_plan(cfg)
    assert gpu.reserve_bytes >= CUDA_CONTEXT_BYTES + FRAGMENTATION * gpu.gpu_memory_bytes - 1
    assert not gpu.fits and gpu.to_json()["headroom_bytes"] < 0


# ---------------------------------------------------------------- multi-process: resume CRC, communicators
def _ranks_case(root: str, timeout_s: float):
    import torch.distributed as dist

    from training.checkpoint import manager as mgr
    from training.checkpoint import storage
    from training.contract.config import Config
    from training.parallel.mesh import ProcessMesh

    made = []
    real_new_group = dist.new_group
    dist.new_group = lambda *a, **k: (
        made.append((a[0] if a else k.get("ranks"), k.get("backend"))) or real_new_group(*a, **k)
    )
    try:
        mesh = ProcessMesh.from_env(1, 1, 1, 2, timeout_s=timeout_s)
    finally:
        dist.new_group = real_new_group
    # Reading one file's CRC takes 1 s here; rank 0 alone (4 files) would keep rank 1 in a collective for
    # 4 s, past the 3 s timeout. Split, each rank reads 2.
    real_crc = storage._crc32
    read: list = []

    def slow_crc(path):
        read.append(os.path.basename(path))
        time.sleep(1.0)
        return real_crc(path)

    storage._crc32 = slow_crc
    cfg = Config()
    ck = mgr.CheckpointManager(root, mesh, cfg)
    t = time.monotonic()
    problems = ck._verify_shared(storage.step_dir(root, 7))
    took = time.monotonic() - t
    mesh.destroy()
    # The async saves' gloo group is a group of its own by design (another backend); the mesh's are counted.
    return {
        "groups": [list(g) for g, backend in made if backend is None],
        "problems": problems,
        "took": took,
        "read": read,
    }


def _fake_checkpoint(root, bad: str):
    from training.checkpoint import storage

    d = storage.step_dir(str(root), 7)
    os.makedirs(d)
    files = {}
    for name in (storage.DCP_METADATA, "__0_0.distcp", "__1_0.distcp", "extra.json"):
        data = os.urandom(1000)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        import zlib

        files[name] = {"size": len(data), "crc32": zlib.crc32(data) ^ (1 if name == bad else 0)}
    with open(os.path.join(d, storage.MANIFEST), "w") as f:
        json.dump({"files": files}, f)
    return d


def test_resume_verification_is_shared_and_fits_a_small_timeout(tmp_path):
    """Likely 7: every rank CRC-reads its share of the checkpoint, all ranks get every problem found, and the
    check stays within a collective timeout that one rank reading everything would exceed. Also: one
    communicator per distinct rank list (7 group kinds at dp=2 are 3 distinct lists, plus pp's own two)."""
    from training.checkpoint import storage

    d = _fake_checkpoint(tmp_path, bad="__1_0.distcp")
    assert storage.verify(d).problems == ["__1_0.distcp checksum mismatch"]
    parts = [storage.verify(d, (i, 2)).problems for i in range(2)]
    assert sorted(parts, key=len) == [[], ["__1_0.distcp checksum mismatch"]]
    results = run_distributed(_ranks_case, world_size=2, args=(str(tmp_path), 3.0), timeout_s=120)
    for r in results:
        assert r["problems"] == ["__1_0.distcp checksum mismatch"]
        # Shared: each rank CRC-read its 2 files (2 s), so neither waited in a collective anywhere near the 3 s
        # gloo timeout, which would have failed the rank (one rank reading all 4 keeps the other waiting 4 s).
        # Counted, not timed: a loaded machine slows both ranks alike and the wait stays short.
        assert len(r["read"]) == len(set(r["read"])) == 2, r["read"]
        assert sorted(r["groups"]) == [[0], [0], [0, 1], [1], [1]]  # pp's own [0], [1]; the rest shared
    assert sorted(results[0]["read"] + results[1]["read"]) == sorted(n for n in os.listdir(d) if n != storage.MANIFEST)
