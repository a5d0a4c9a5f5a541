"""Integration tests against the real dev Slurm cluster (slurm/dev-cluster.sh): CPU ranks with gloo.

Skipped, with the reason, when the cluster cannot run here (no root, no apt, no Slurm)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from helpers.faults import reference as shared_reference
from helpers.faults import start_reference
from helpers.slurm import (
    COMMON,
    STEPS,
    hold_env,
    meshrun,
    metrics,
    rank_pid,
    submit,
    wait_final,
    wait_started,
    wait_step,
)

from launcher.manage.status import run_status
from training.contract.exit_codes import EXIT_SLURM
from training.contract.rundir.events import read_events

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module", autouse=True)
def _reference_run(tmp_path_factory, cluster):
    """The local reference starts with the module's first test and runs beside its Slurm job (these tests run one
    after another: waiting for its 4 CPU ranks first would be a wait of its own); one per test session, shared with
    the other Slurm modules that compare against the same configuration (tests/helpers/faults.py)."""
    start_reference(tmp_path_factory, *COMMON)


@pytest.fixture(scope="module")
def reference(_reference_run):
    """The same config run locally (4 CPU processes): the loss trajectory every Slurm run must match."""
    losses = shared_reference(*COMMON)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory, cluster):
    run_dir = tmp_path_factory.mktemp("slurm") / "run"
    t0 = time.time()
    job = submit(run_dir)
    submit_s = time.time() - t0
    return run_dir, job, wait_final(run_dir), submit_s


def test_two_nodes_two_ranks_match_local_run(slurm_run, reference):
    run_dir, job, status, submit_s = slurm_run
    assert submit_s < 30  # returns at once, does not wait for the job
    assert status["state"] == "COMPLETED" and status["job_id"] == job and status["last_step"] == STEPS
    started = [e for e in read_events(str(run_dir)) if e["event"] == "started"]
    assert len(started) == 1 and len(started[0]["nodes"]) == 2
    losses = metrics(run_dir)
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    # Every rank ran NUMA-bound (numactl) and on the node Slurm put it.
    recs = [json.load(open(os.path.join(run_dir, "slurm", "attempt_0", f"rank_{r}.json"))) for r in range(4)]
    assert [r["node"] for r in recs] == [started[0]["nodes"][0]] * 2 + [started[0]["nodes"][1]] * 2
    assert all(r["numa_node"] is not None and r["exit_code"] == 0 for r in recs)
    out = meshrun("action=status", f"run.dir={run_dir}")
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "COMPLETED"


def test_preemption_signal_requeues_and_resumes_exactly(tmp_path, reference, cluster):
    run_dir = tmp_path / "run"
    env = hold_env(tmp_path)  # every rank waits before step 4: USR2 lands mid-run however fast the steps are
    job = submit(run_dir, env=env)
    wait_step(run_dir, 3)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_started(run_dir, 2)
    open(env["HOLD_RELEASE"], "w").close()  # the requeued attempt goes on
    status = wait_final(run_dir)
    assert status["state"] == "COMPLETED" and status["attempt"] == 1 and status["job_id"] == job
    events = read_events(str(run_dir))
    kinds = [e["event"] for e in events]
    assert "signal" in kinds and kinds.count("started") == 2
    requeued = [e for e in events if e["event"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["cause"] == "stopped_early"
    losses = metrics(run_dir)  # asserts no step ran twice
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_killed_rank_fails_fast_and_resubmits_without_its_node(tmp_path, reference, cluster):
    run_dir = tmp_path / "run"
    env = hold_env(tmp_path)  # the ranks wait before step 4: the kill lands mid-run, not after the last step
    submit(run_dir, env=env)
    wait_step(run_dir, 3)
    os.kill(rank_pid(run_dir, 2), signal.SIGKILL)
    killed = time.time()
    open(env["HOLD_RELEASE"], "w").close()
    deadline = killed + 60
    while not any(e["event"] == "failed" for e in read_events(str(run_dir))):
        assert time.time() < deadline, "the job did not notice a dead rank within 60 s"
        time.sleep(0.2)
    status = wait_final(run_dir)
    events = read_events(str(run_dir))
    failed = [e for e in events if e["event"] == "failed"][0]
    first_nodes = [e for e in events if e["event"] == "started"][0]["nodes"]
    assert failed["rank"] == 2 and failed["node"] == first_nodes[1] and failed["exit_code"] == -9
    requeued = [e for e in events if e["event"] == "requeued"][0]
    assert requeued["excluded_nodes"] == [failed["node"]] and requeued["cause"] == "failure"
    second = [e for e in events if e["event"] == "started"][1]
    assert failed["node"] not in second["nodes"]
    assert status["state"] == "COMPLETED" and status["excluded_nodes"] == [failed["node"]]
    assert status["job_id"] == requeued["new_job_id"]
    losses = metrics(run_dir, last_wins=True)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_max_retries_reached_stops(tmp_path, cluster):
    run_dir = tmp_path / "run"
    env = hold_env(tmp_path)
    submit(run_dir, "cluster.max_retries=0", env=env)
    wait_step(run_dir, 3)
    os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
    open(env["HOLD_RELEASE"], "w").close()
    status = wait_final(run_dir)
    assert status["state"] == "FAILED" and "max_retries=0" in status["reason"]
    kinds = [e["event"] for e in read_events(str(run_dir))]
    assert kinds.count("started") == 1 and kinds[-2:] == ["failed", "stopped"]


# Every rank waits before its 4th step until it got a stop signal or the file named by HOLD_RELEASE exists (at
# most 120 s): a signal sent after step 3 lands mid-run however fast the steps are.
def test_sweep_submits_valid_points_as_one_job_array_and_skips_invalid(tmp_path, cluster, slurm_jobs):
    """4 points, micro_batch=3 invalid: 3 submitted as one job array; one array task preempted (USR2)
    requeues on its own and resumes without running a step twice; all 3 complete."""
    sweep_dir = tmp_path / "sweep"
    steps = 16
    env = hold_env(tmp_path)  # the preempted point is still running when USR2 lands: it waits for it
    res = meshrun(
        "-m",
        "cluster=slurm_dev",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "model=tiny",
        "data=synthetic",
        "parallel.tp=1",
        "parallel.sp=false",
        "parallel.zero=0",
        "parallel.global_batch=8",
        "parallel.micro_batch=1,2,4,3",
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        "train.log_every=1",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=300,
        env=env,
    )
    jobs = re.findall(r"submitted Slurm job (\d+_\d+); run dir (\S+)", res.stdout)
    slurm_jobs.extend(sorted({job.split("_")[0] for job, _ in jobs}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(jobs) == 3, res.stdout
    assert "micro_batch=3" in res.stdout + res.stderr
    assert len({job.split("_")[0] for job, _ in jobs}) == 1  # one sbatch: tasks <array>_0.._2
    summary = res.stdout.split("sweep summary")[-1]
    for job, _run_dir in jobs:
        assert job in summary  # the summary table lists the job ids
    preempted_job, preempted = jobs[1]
    wait_step(preempted, 3)
    subprocess.run(["scancel", "--signal=USR2", preempted_job], check=True)
    open(env["HOLD_RELEASE"], "w").close()  # the other points go on
    for job, run_dir in jobs:
        status = wait_final(run_dir)
        assert status["state"] == "COMPLETED" and status["job_id"] == job, (run_dir, status)
        assert sorted(metrics(run_dir)) == list(range(1, steps + 1))  # and no step twice
        assert os.path.exists(sweep_dir / "submitit" / f"{job}_0_log.out")  # where follow() reads
    events = read_events(preempted)
    assert [e["event"] for e in events].count("started") == 2
    assert all(e["job_id"] == preempted_job for e in events)
    requeued = [e for e in events if e["event"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["cause"] == "stopped_early"


def test_sweep_with_wait_ends_with_every_points_final_state(tmp_path, cluster):
    """wait=true in a sweep: the command returns once every point has ended, the summary and sweep.json
    carry each final state, and a point that failed (text data from a path the ranks cannot find,
    exit 2, not retried) makes the sweep exit 1."""
    sweep_dir = tmp_path / "sweep"
    res = meshrun(
        "-m",
        "cluster=slurm_dev",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "model=tiny",
        "parallel.tp=1",
        "parallel.sp=false",
        "parallel.zero=0",
        "parallel.global_batch=8",
        "train.steps=2",
        "data.kind=synthetic,text",
        f"data.paths=[{tmp_path / 'missing'}]",
        "wait=true",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=300,
    )
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    jobs = re.findall(r"submitted Slurm job (\d+_\d+); run dir (\S+)", res.stdout)
    assert len(jobs) == 2 and "waiting for 2 sweep point(s)" in res.stdout, res.stdout
    assert "1 sweep point(s) did not complete" in res.stderr
    sweep = json.load(open(sweep_dir / "sweep.json"))
    states = {r["run_dir"]: r["state"] for r in sweep["feasible"]}
    assert states == {jobs[0][1]: "COMPLETED", jobs[1][1]: "FAILED"}, states
    for _job, run_dir in jobs:  # returned only after both ended for good
        assert read_events(run_dir)[-1]["event"] in ("completed", "stopped")
    assert "missing" in run_status(jobs[1][1])["reason"]
    out = meshrun("action=status", f"run.dir={sweep_dir}")  # the whole sweep at once
    assert out.returncode == 0 and json.loads(out.stdout)["states"] == {"COMPLETED": 1, "FAILED": 1}, out.stdout


def test_bad_input_submits_nothing(tmp_path, cluster):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    res = meshrun("cluster=slurm_dev", *COMMON, f"run.dir={tmp_path / 'a'}", "cluster.partition=nope")
    assert res.returncode == 2 and "cluster.partition='nope' does not exist" in res.stderr
    marker = tmp_path / "pwned"
    res = meshrun(
        "cluster=slurm_dev", *COMMON, f"run.dir={tmp_path / 'b'}", f"cluster.partition='debug;touch {marker}'"
    )
    assert res.returncode == 2 and "cluster.partition" in res.stderr and not marker.exists()
    conf = tmp_path / "slurm.conf"
    real = open("/etc/slurm/slurm.conf").read()
    conf.write_text(re.sub(r"(?m)^SlurmctldHost=.*$", "SlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1", real))
    res = meshrun("cluster=slurm_dev", *COMMON, f"run.dir={tmp_path / 'c'}", env={"SLURM_CONF": str(conf)})
    assert res.returncode == EXIT_SLURM and "controller does not answer" in res.stderr, res.stderr
    for d in "abc":
        assert not (tmp_path / d / "events.jsonl").exists()
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert set(after) <= set(before)


def test_cpus_per_task_default_comes_from_the_partitions_nodes(tmp_path, cluster):
    """cluster.cpus_per_task=0: the dev nodes' 8 CPUs (sinfo) shared by the ranks per node, never 1."""
    for ranks, cpus in ((2, 4), (1, 8)):
        res = meshrun(
            "cluster=slurm_dev",
            *COMMON,
            "dry_run=true",
            f"cluster.gpus_per_node={ranks}",
            "parallel.tp=1",
            "cluster.cpus_per_task=0",  # the preset's 1 (its nodes share this machine's cores) set back
            f"run.dir={tmp_path / str(ranks)}",
        )
        assert res.returncode == 0, res.stderr[-2000:]
        assert f"#SBATCH --cpus-per-task={cpus}" in res.stdout.splitlines(), res.stdout


def test_time_limit_signal_requeues_and_resumes(tmp_path, cluster):
    """A 2-minute limit with an 80 s delay: the ranks stop themselves at limit - 80 s - 30 s (before
    Slurm's own USR2, which may come while they still start), save, requeue, resume. (The stop is due 10 s
    after the start, as with 1 minute and 20 s; the longer limit leaves a loaded machine's slow start and save
    100 s more before Slurm ends the job.)"""
    run_dir = tmp_path / "run"
    job = submit(
        run_dir,
        "cluster.nodes=1",
        "cluster.time_min=2",
        "cluster.signal_delay_s=80",
        "train.steps=100000",
        "+cluster.env.MESHRUN_PACE_STEP_S=2",  # waits for its stop: idles instead of spinning the shared cores
        "train.checkpoint_every=0",
        "train.progress=false",
    )
    try:
        deadline = time.time() + 180
        while True:
            events = read_events(str(run_dir))
            starts = [e for e in events if e["event"] == "started"]
            if len(starts) >= 2 and any(e["event"] == "resumed" for e in events):
                resumed = [e for e in events if e["event"] == "resumed"][0]
                if max(metrics(run_dir), default=0) > resumed["step"]:
                    break
            assert time.time() < deadline, f"no requeue/resume within 180 s: {events}"
            assert not any(e["event"] in ("failed", "stopped") for e in events), events
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job])
    sig = [e for e in events if e["event"] == "signal"][0]
    assert sig["name"] == "SIGUSR2" and resumed["step"] == sig["step"]
    # The stop came from the rank wrapper's own clock while the engine ran (it used to reach only
    # a child that did not handle the signal yet), before Slurm's own USR2 was due: that one comes no earlier
    # than limit - 80 s = stop_at + 30 s.
    clock = [e for e in events if e["event"] == "stop_requested"]
    assert clock and clock[0]["source"] == "clock" and clock[0]["time"] <= sig["time"]
    assert sig["time"] < clock[0]["stop_at"] + 20, (sig, clock)
    requeued = [e for e in events if e["event"] == "requeued"][0]
    assert requeued["cause"] == "stopped_early" and starts[1]["job_id"] == job
    steps = sorted(metrics(run_dir))  # asserts no step ran twice
    assert steps == list(range(1, steps[-1] + 1))


def write_ib_port(root, state, phys_state, hca="mlx5_0"):
    """One HCA port as the kernel writes it under /sys/class/infiniband."""
    port = os.path.join(str(root), hca, "ports", "1")
    os.makedirs(os.path.join(port, "counters"), exist_ok=True)
    for name, text in (
        ("state", state),
        ("phys_state", phys_state),
        ("rate", "400 Gb/sec (4X NDR)"),
        ("link_layer", "InfiniBand"),
        ("counters/symbol_error", "0"),
    ):
        with open(os.path.join(port, name), "w") as f:
            f.write(text + "\n")
    return str(root)


def test_preflight_gate_keeps_bad_node_out_and_requeues_without_it(tmp_path, reference, cluster):
    """Preflight gate: n2's IB port is Down (a fixture sysfs root for that node only). The gate stops the
    attempt before any step, the job is resubmitted without n2, passes the preflight and completes."""
    healthy = write_ib_port(tmp_path / "ib_ok", "4: ACTIVE", "5: LinkUp")
    down = write_ib_port(tmp_path / "ib_down", "1: DOWN", "3: Disabled")
    run_dir = tmp_path / "run"
    submit(
        run_dir,
        "cluster.preflight.mode=gate",
        "cluster.preflight.ib_hcas=[mlx5_0]",
        "cluster.preflight.ib_rate_gbps=400",
        f"cluster.preflight.ib_sysfs_root={healthy}",
        f"+cluster.preflight.ib_sysfs_root_by_node.n2={down}",
    )
    status = wait_final(run_dir)
    events = read_events(str(run_dir))
    starts = [e for e in events if e["event"] == "started"]
    assert "n2" in starts[0]["nodes"], f"Slurm did not place the first attempt on n2: {starts[0]}"
    first = [e for e in events if e.get("attempt") == 0]
    pre = [e for e in first if e["event"] == "preflight"]
    assert len(pre) == 1 and pre[0]["status"] == "fail" and pre[0]["bad_nodes"] == ["n2"], pre
    failed = [e for e in first if e["event"] == "failed"]
    assert failed and {e["node"] for e in failed} == {"n2"} and {e["exit_code"] for e in failed} == {4}
    assert all("ib.state mlx5_0/1" in e["reason"] for e in failed), failed
    assert not any(e["event"] == "checkpoint" for e in first)  # nothing trained on the bad attempt
    requeued = [e for e in events if e["event"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["cause"] == "failure" and requeued[0]["excluded_nodes"] == ["n2"]
    assert len(starts) == 2 and "n2" not in starts[1]["nodes"] and starts[1]["resume_step"] is None
    second = [e for e in events if e.get("attempt") == 1 and e["event"] == "preflight"]
    assert len(second) == 1 and second[0]["bad_nodes"] == [] and second[0]["status"] != "fail"
    assert status["state"] == "COMPLETED" and status["excluded_nodes"] == ["n2"]
    assert status["job_id"] == requeued[0]["new_job_id"]
    losses = metrics(run_dir)  # asserts no step ran twice
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    # The dev preset keeps the per-attempt gate cheap (docs/USER_CONTRACTS.md: gate is the default on Slurm).
    assert all(e["elapsed_s"] < 5 for e in pre + second), pre + second


BUG_AT_STEP_0 = """import sys
if "training.main" in getattr(sys, "orig_argv", []):  # only the rank processes, not submitit or the driver
    import training.run.loop

    def broken_step(self, *args, **kwargs):
        raise RuntimeError("injected bug: train_step fails at step 0")

    training.run.loop.Trainer.train_step = broken_step
"""


def test_exception_on_every_rank_at_step_0_is_a_bug_not_retried(tmp_path, cluster):
    """The same Python exception on every rank before any step is a bug: the job stops
    after its first attempt with a clear final state instead of being resubmitted node after node.
    The bug is injected into the rank processes through a sitecustomize on PYTHONPATH (the job
    inherits the submitter's environment, as on any Slurm cluster)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(BUG_AT_STEP_0)
    run_dir = tmp_path / "run"
    res = meshrun("cluster=slurm_dev", *COMMON, f"run.dir={run_dir}", env={"PYTHONPATH": str(inject)})
    assert res.returncode == 0 and "submitted Slurm job" in res.stdout, res.stderr[-3000:]
    status = wait_final(run_dir)
    events = read_events(str(run_dir))
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "stopped" and status["state"] == "FAILED", events
    assert "same error on every rank before any step" in status["reason"]
    assert "injected bug" in status["reason"]
    assert kinds.count("started") == 1 and "requeued" not in kinds  # not retried (max_retries=2)
    failed = [e for e in events if e["event"] == "failed"]
    assert failed and all("injected bug" in e["reason"] for e in failed)
    assert metrics(run_dir) == {}
    out = meshrun("action=status", f"run.dir={run_dir}")
    assert json.loads(out.stdout)["state"] == "FAILED"
