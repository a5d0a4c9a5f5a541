"""GPU health while training (training/observe/health.py) on CPU: the sampler against NVML doubles that speak
real pynvml (the preflight's, tests/launcher/launch/test_preflight_nvml.py, and the file-driven one a run uses,
training/preflight/nvml_double.py), and on the dev Slurm cluster: an ECC count that grows mid-run on one node
raises a `health` event and, with cluster.health.action=requeue, the job is checkpointed and resubmitted
without that node. The multi-rank engine path is tests/engine/test_diagnostics.py."""

from __future__ import annotations

import json
import os

import helpers.slurm as dev
import pynvml
import pytest
from helpers.doubles import fake_nvml, healthy_gpu

from training.contract.config import Config
from training.contract.rundir.events import read_events
from training.observe.health import ECC, THROTTLE, HealthSampler, ThroughputShare, load_health_nvml
from training.preflight.nvml_double import make_nvml_double


def _lines(run_dir):
    with open(os.path.join(run_dir, "health.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_ecc_growth_on_the_preflight_double_raises_one_health_event(tmp_path):
    gpus = [healthy_gpu(i) for i in range(2)]
    gpus[1]["ecc"][pynvml.NVML_VOLATILE_ECC] = 1  # errors before the run: the baseline, not a fault
    sampler = HealthSampler(fake_nvml(gpus), "n7", str(tmp_path), interval_s=1, throttle_samples=3)
    assert sampler.sample() == 0
    gpus[1]["ecc"][pynvml.NVML_VOLATILE_ECC] = 3  # grows mid-run
    assert sampler.sample() == ECC and sampler.sample() == ECC
    (event,) = [e for e in read_events(str(tmp_path)) if e["event"] == "health"]  # said once
    assert event["node"] == "n7" and event["kind"] == "ecc"
    assert event["reasons"] == ["gpu1: ecc_uncorrected grew from 1 to 3"]
    lines = _lines(str(tmp_path))
    assert len(lines) == 6 and {(ln["node"], ln["gpu"]) for ln in lines} == {("n7", 0), ("n7", 1)}
    assert lines[0]["temperature_c"] == 34 and lines[-1]["ecc_uncorrected"] == 3


def test_unsupported_queries_are_left_out_not_failures(tmp_path):
    g = healthy_gpu(0)
    g["unsupported"] = {"ecc", "remap", "reasons"}
    sampler = HealthSampler(fake_nvml([g]), "n1", str(tmp_path), interval_s=1, throttle_samples=1)
    assert sampler.sample() == 0 and sampler.sample() == 0
    line = _lines(str(tmp_path))[-1]
    assert "ecc_uncorrected" not in line and "throttle" not in line and line["temperature_c"] == 34


def test_throttling_must_persist_and_only_hardware_reasons_count(tmp_path):
    g = healthy_gpu(0)
    g["reasons"] = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonGpuIdle
    sampler = HealthSampler(fake_nvml([g]), "n1", str(tmp_path), interval_s=1, throttle_samples=2)
    assert [sampler.sample() for _ in range(3)] == [0, 0, 0]
    g["reasons"] = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert sampler.sample() == 0  # one sample is a blip
    g["reasons"] = 0
    assert sampler.sample() == 0
    g["reasons"] = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert [sampler.sample() for _ in range(2)] == [0, THROTTLE]
    (event,) = [e for e in read_events(str(tmp_path)) if e["event"] == "health"]
    assert event["kind"] == "throttle" and "HW thermal slowdown for 2 samples" in event["reasons"][0]


def test_file_double_is_reread_and_per_node(tmp_path):
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps({"gpus": 2, "nodes": {"*": {"power_w": 300}, "n2": {"temperature": 80}}}))
    n1, n2 = make_nvml_double(str(spec), "n1"), make_nvml_double(str(spec), "n2")
    a = HealthSampler(n1, "n1", str(tmp_path), 1, 3)
    b = HealthSampler(n2, "n2", str(tmp_path), 1, 3)
    assert a.sample() == 0 and b.sample() == 0
    assert b.summary["gpu_temperature_max_c"] == 80 and a.summary["gpu_temperature_max_c"] == 45
    assert a.summary["gpu_power_w"] == 600  # two GPUs at 300 W
    spec.write_text(json.dumps({"gpus": 2, "nodes": {"n2": {"remap_pending": 1, "retired_pages": 2}}}))
    assert a.sample() == 0 and b.sample() == ECC
    with pytest.raises(pynvml.NVMLError):
        n1.nvmlDeviceGetHandleByIndex(2)


def test_no_sampler_on_cpu_without_a_double():
    nvml, why = load_health_nvml(Config(), "n1")
    assert nvml is None and "CPU run" in why


def test_node_throughput_share_against_its_own_baseline():
    share = ThroughputShare(fraction=0.5, baseline_intervals=2, persist=2)
    ranks = {"a": 2, "b": 2}
    for _ in range(2):
        assert share.update({"a": 1.0, "b": 1.0}, ranks) == {}  # the baseline: half each
    assert share.update({"a": 1.0, "b": 1.0}, {"a": 2, "b": 2}) == {}
    assert share.update({"a": 0.2, "b": 0.2}, ranks) == {}  # the whole job slower: no node to blame
    assert share.update({"a": 1.0, "b": 4.0}, ranks) == {}  # b at a fifth of a's rate, once
    flagged = share.update({"a": 1.0, "b": 4.0}, ranks)
    assert list(flagged) == ["b"] and "below 0.5 x its baseline" in flagged["b"]
    assert ThroughputShare(0.5, 2, 1).update({"a": 1.0}, {"a": 1}) == {}  # one node: no share to compare


# ---- the dev Slurm cluster -------------------------------------------------------------------------
ECC_STEPS = 32


@pytest.mark.slurm
def test_growing_ecc_on_slurm_requeues_without_that_node(tmp_path, cluster):
    double = tmp_path / "gpus.json"
    # As many GPUs as the slurm_dev preset's gpus_per_node: the preflight reads the same double and checks the count.
    double.write_text(json.dumps({"gpus": 2, "nodes": {}}))
    run_dir = tmp_path / "run"
    dev.submit(
        run_dir,
        # Paced steps (MESHRUN_PACE_STEP_S, training/run/pacing.py): the run outlasts the time the monitor takes to see the count grow by
        # about 14 s while its ranks idle instead of training 80 steps; after the requeue it ends the same way.
        f"train.steps={ECC_STEPS}",
        "+cluster.env.MESHRUN_PACE_STEP_S=0.5",
        "train.checkpoint_every=40",
        f"cluster.health.nvml_double={double}",
        "cluster.health.interval_s=0.2",
        "cluster.health.action=requeue",
    )
    dev.wait_step(run_dir, 3, timeout=300)
    nodes = [e for e in read_events(str(run_dir)) if e["event"] == "started"][0]["nodes"]
    bad = nodes[1]
    tmp = tmp_path / "gpus.json.tmp"
    tmp.write_text(json.dumps({"gpus": 2, "nodes": {bad: {"ecc_uncorrected": 2}}}))
    os.replace(tmp, double)  # the node's uncorrectable ECC count grows while the job runs
    status = dev.wait_final(run_dir, timeout=420)
    events = read_events(str(run_dir))
    health = [e for e in events if e["event"] == "health"]
    assert health and {e["node"] for e in health} == {bad} and health[0]["kind"] == "ecc", events
    first = [e for e in events if e.get("attempt") == 0]
    saved = [e for e in first if e["event"] == "checkpoint" and e.get("reason") == "health"]
    assert len(saved) == 1, first
    failed = [e for e in first if e["event"] == "failed"]
    assert failed and {e["node"] for e in failed} == {bad} and {e["exit_code"] for e in failed} == {4}
    assert all("health: node" in e["reason"] for e in failed), failed
    requeued = [e for e in events if e["event"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["excluded_nodes"] == [bad]
    starts = [e for e in events if e["event"] == "started"]
    assert len(starts) == 2 and bad not in starts[1]["nodes"]
    assert starts[1]["resume_step"] == saved[0]["step"]
    assert status["state"] == "COMPLETED" and status["excluded_nodes"] == [bad]
    assert sorted(dev.metrics(run_dir)) == list(range(1, ECC_STEPS + 1))  # asserts no step ran twice


def test_the_sampler_reads_only_this_jobs_gpus(tmp_path, monkeypatch):
    """Risk 'health reads every NVML GPU': on a shared node another job's GPU (here gpu 0, its ECC count growing)
    is neither sampled nor watched for Xids; the job's GPUs come from SLURM_JOB_GPUS (every GPU of the job on the
    node, also under per-task binding), else CUDA_VISIBLE_DEVICES."""
    gpus = [healthy_gpu(i) for i in range(4)]
    monkeypatch.delenv("SLURM_JOB_GPUS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    sampler = HealthSampler(fake_nvml(gpus), "n1", str(tmp_path), interval_s=1, throttle_samples=1)
    assert sampler.gpus == [2, 3]
    assert sampler.sample() == 0
    gpus[0]["ecc"][pynvml.NVML_VOLATILE_ECC] = 5  # the other job's GPU
    assert sampler.sample() == 0
    assert {ln["gpu"] for ln in _lines(str(tmp_path))} == {2, 3}
    monkeypatch.setenv("SLURM_JOB_GPUS", "1,2,3")
    assert HealthSampler(fake_nvml(gpus), "n1", str(tmp_path), 1, 1).gpus == [1, 2, 3]
