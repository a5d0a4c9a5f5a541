"""OpenMP/MKL threads of a Slurm rank are capped by its job's CPUs (cluster.cpus_per_task, launcher/ranks/processes.py's
threads_per_rank): the dev cluster has no CPU binding (TaskPlugin=task/none), so each task's affinity is the whole
machine and, uncapped, one rank per node would start as many threads as this machine has cores. Read from the
running rank process itself (/proc/PID/environ), once it has logged a step."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers.slurm import metrics, submit

pytestmark = pytest.mark.slurm


def _rank_envs(run_dir: str) -> list:
    """The environment of every running engine process (training.main) of this run."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"training.main" in cmd and f"MESHRUN_RUN_DIR={run_dir}".encode() in env:
            out.append(dict(x.decode(errors="replace").split("=", 1) for x in env if b"=" in x))
    return out


def test_a_slurm_rank_gets_its_tasks_cpus_as_threads_not_the_machines(tmp_path, cluster, slurm_jobs):
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip(f"this machine has {cores} usable core: capped and uncapped thread counts would both be 1")
    run_dir = tmp_path / "run"
    job = submit(
        run_dir,
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "parallel.tp=1",
        "cluster.cpus_per_task=1",
        "train.steps=100000",
        "train.checkpoint_every=0",
        "train.progress=false",
    )
    slurm_jobs.append(job)
    deadline = time.time() + 180
    envs: list = []
    while not (envs and metrics(run_dir)):  # the rank runs and has taken a step: its environment is final
        assert time.time() < deadline, "the rank logged no step within 180 s"
        time.sleep(0.5)
        envs = _rank_envs(str(run_dir))
    subprocess.run(["scancel", job])
    (env,) = envs
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1", (env.get("OMP_NUM_THREADS"), cores)
    assert env.get("SLURM_CPUS_PER_TASK") == "1"
