"""The dev Slurm cluster (slurm/dev-cluster.sh) as the tests use it: start it or skip with the reason, `meshrun` in a
subprocess that notes every job it submits (tests/helpers/jobs.py), waits on a run's events and metrics, a rank's
pid, an environment that holds every rank before step 4, and the dev cluster's config for the tests that need no
cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ROOT, jobs
from launcher.manage.status import run_status
from launcher.slurm.sbatch import with_cpus_per_task
from training.contract.config import ClusterConfig, Config
from training.contract.rundir.events import read_events

UNAVAILABLE = 77
STEPS = 12
COMMON = [
    "model=tiny",
    "data=synthetic",
    "parallel.tp=2",
    "parallel.pp=1",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
]


def ping() -> bool:
    try:
        return (
            shutil.which("scontrol") is not None
            and subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15).stdout.count("UP") > 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_cluster() -> bool:
    """The dev cluster, started if needed; a loud skip with the reason when it cannot run here (the `cluster`
    fixture of tests/conftest.py)."""
    if not ping():
        res = subprocess.run(
            ["bash", os.path.join(ROOT, "slurm", "dev-cluster.sh"), "up"], capture_output=True, text=True, timeout=600
        )
        if res.returncode == UNAVAILABLE:
            reason_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), "meshrun-slurm-unavailable")
            reason = open(reason_file).read().strip() if os.path.exists(reason_file) else res.stderr.strip()
            pytest.skip(f"SLURM TESTS SKIPPED: dev cluster unavailable: {reason}")
        if res.returncode != 0 or not ping():
            pytest.fail(f"slurm/dev-cluster.sh up failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return True


def meshrun(*overrides, env=None, timeout=120):
    """`meshrun` in a subprocess; every Slurm job it says it submitted is noted (tests/helpers/jobs.py), so a
    test that fails leaves none of them queued or running (tests/conftest.py cancels them)."""
    res = subprocess.run(
        [sys.executable, "-m", "launcher", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    jobs.note(res.stdout)
    return res


def submit(run_dir, *overrides, env=None):
    res = meshrun("cluster=slurm_dev", *COMMON, f"run.dir={run_dir}", *overrides, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(r"submitted Slurm job (\d+)", res.stdout)
    assert m, res.stdout
    return m.group(1)


def wait_final(run_dir, timeout=240):
    """Until events.jsonl ends the run (completed / stopped); returns the status."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        events = read_events(str(run_dir))
        if events and events[-1]["event"] in ("completed", "stopped"):
            return run_status(str(run_dir))
        time.sleep(0.5)
    raise AssertionError(
        f"run {run_dir} not finished after {timeout} s; events: {read_events(str(run_dir))}; "
        f"status {run_status(str(run_dir))}"
    )


def wait_started(run_dir, count, timeout=180):
    """Until events.jsonl holds `count` started events (attempts); returns them."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        starts = [e for e in read_events(str(run_dir)) if e["event"] == "started"]
        if len(starts) >= count:
            return starts
        time.sleep(0.2)
    raise AssertionError(f"{count} attempts not started in {timeout} s: {read_events(str(run_dir))}")


def wait_held(env, attempt, ranks, timeout=180):
    """Until each of `ranks` of attempt `attempt` waits in HOLD (it marks HOLD_RELEASE.held_<attempt>_<rank>)."""
    deadline = time.time() + timeout
    marks = [f"{env['HOLD_RELEASE']}.held_{attempt}_{r}" for r in ranks]
    while not all(os.path.exists(m) for m in marks):
        assert time.time() < deadline, f"ranks {ranks} of attempt {attempt} not held in {timeout} s"
        time.sleep(0.2)


def wait_step(run_dir, step, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        losses = metrics(run_dir, last_wins=True)
        if losses and max(losses) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def metrics(run_dir, last_wins=False):
    """step -> loss; with last_wins=False a step logged twice is an error."""
    out = {}
    path = os.path.join(str(run_dir), "metrics.jsonl")
    if not os.path.exists(path):
        return out
    for line in open(path):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not last_wins:
            assert rec["step"] not in out, f"step {rec['step']} was run twice"
        out[rec["step"]] = rec["loss"]
    return out


def rank_pid(run_dir, rank):
    """pid of `python -m training.main RUN_DIR` of one rank (all fake nodes live on this machine)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if b"training.main" not in cmd or str(run_dir).encode() not in cmd:
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no process for rank {rank} of {run_dir}")


HOLD = """import os, sys
if "training.main" in getattr(sys, "orig_argv", []):
    import time
    import training.run.loop
    from training.run import signals
    real = training.run.loop.Trainer.train_step

    def step(self, *args, **kwargs):
        if self.state.step == 3:
            mark = f"{os.environ['HOLD_RELEASE']}.held_{os.environ.get('MESHRUN_ATTEMPT', '0')}_{os.environ.get('RANK')}"
            open(mark, "w").close()
            deadline = time.monotonic() + float(os.environ.get("HOLD_MAX_S", "120"))
            while (signals.received() is None and not os.path.exists(os.environ["HOLD_RELEASE"])
                   and time.monotonic() < deadline):
                time.sleep(0.02)
        return real(self, *args, **kwargs)

    training.run.loop.Trainer.train_step = step
"""


def hold_env(tmp_path, through_signals: bool = False) -> dict:
    """The environment that makes every rank wait before step 4 (HOLD); create env["HOLD_RELEASE"] to let go.
    Each rank marks that it waits (wait_held), in every attempt that reaches step 3 (a requeued one resumed at
    step 3 waits again).
    through_signals: a stop signal does not end the wait either (the ranks stay until released or killed, up to
    15 min: on a loaded machine the caller's own launches can outlast the 120 s a plain hold waits)."""
    inject = tmp_path / "inject_hold"
    inject.mkdir()
    text = HOLD.replace("signals.received() is None and ", "") if through_signals else HOLD
    assert text != HOLD or not through_signals
    (inject / "sitecustomize.py").write_text(text)
    env = {"PYTHONPATH": f"{inject}{os.pathsep}{ROOT}", "HOLD_RELEASE": str(tmp_path / "release")}
    if through_signals:
        env["HOLD_MAX_S"] = "900"
    return env


def dev_cfg(**cluster) -> Config:
    cfg = Config()
    base = dict(
        name="slurm_dev",
        kind="slurm",
        partition="debug",
        nodes=2,
        gpus_per_node=2,
        device="cpu",
        time_min=10,
        signal_delay_s=45,
        max_retries=2,
        env={"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5_0"},
    )
    base.update(cluster)
    cfg.cluster = ClusterConfig(**base)
    cfg.parallel.tp = 2
    # As submit() leaves it: cpus_per_task=0 resolved from the dev cluster's nodes (8 CPUs, 2 ranks each).
    return with_cpus_per_task(cfg, node_cpus=8)
