"""Issue 46's soak: one Slurm run through a seeded sequence of faults of every kind, one per attempt, each at a
known point (tests/helpers/faults.py), with in-job restarts on. The run must end COMPLETED with steps 1..N once each
in metrics.jsonl, every loss the uninterrupted run's, and goodput.json adding up.

The seed is printed with any failure; MESHRUN_SOAK_SEED=<seed> replays a sequence."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import pytest
from helpers.faults import faults_env, reference, release, start_reference, wait_held
from helpers.slurm import COMMON, STEPS, metrics, submit

from training.contract.rundir.events import read_events

pytestmark = pytest.mark.slurm

KINDS = ["kill_step", "kill_save", "kill_resume", "in_job", "preempt", "batch_kill", "drain"]
"""in_job: a Python exception (no node to blame: an in-job restart on the same nodes), then a rank SIGKILLed in the
first step after that restart."""


def fault_sequence(seed: int):
    """attempt -> {"kind", "rank"}: every kind once in a seeded order. A kill during a resume needs a checkpoint
    to resume: never first, nor right after a first attempt killed in its first save."""
    rng = random.Random(seed)
    kinds = KINDS[:]
    rng.shuffle(kinds)
    if kinds[0] == "kill_resume" or (kinds[1] == "kill_resume" and kinds[0] == "kill_save"):
        i = kinds.index("kill_resume")
        kinds[i], kinds[2] = kinds[2], kinds[i]
    seq = []
    for kind in kinds:
        seq += [("raise_step", "kill_first_step")] if kind == "in_job" else [(kind,)]
    flat = [k for group in seq for k in group]
    return {a: {"kind": k, "rank": rng.randrange(4)} for a, k in enumerate(flat)}


def _job(run_dir):
    """The run's current Slurm job (a resubmission changes it)."""
    job = None
    for e in read_events(str(run_dir)):
        if e["event"] == "submitted":
            job = str(e["job_id"])
        if e["event"] == "requeued" and e.get("new_job_id"):
            job = str(e["new_job_id"])
    return job


def _started(run_dir, attempt, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in read_events(str(run_dir)):
            if e["event"] == "started" and e["attempt"] == attempt:
                return e
        time.sleep(0.2)
    raise AssertionError(f"attempt {attempt} did not start in {timeout} s: {read_events(str(run_dir))}")


def _goodput(run_dir):
    try:
        return json.load(open(run_dir / "goodput.json"))
    except (OSError, ValueError):
        return {}


def _node(name, state, reason=""):
    cmd = ["scontrol", "update", f"nodename={name}", f"state={state}"] + ([f"reason={reason}"] if reason else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _act(run_dir, env, attempt, kind):
    """The faults the test makes from outside while the attempt's ranks wait: the preemption signal, the batch
    script killed alone, a node drained mid-run (then the preemption: the requeued attempt must not start on it;
    the node is resumed once it started, or once the job has waited 5 s because no other node is left)."""
    wait_held(env, attempt, range(4))
    job = _job(run_dir)
    if kind == "batch_kill":
        subprocess.run(["scancel", "--signal=KILL", "--batch", job], check=True)
        return
    drained = None
    if kind == "drain":
        drained = _started(run_dir, attempt)["nodes"][1]
        _node(drained, "drain", "meshrun soak test")
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    if drained is None:
        return
    try:
        deadline = time.time() + 5
        while time.time() < deadline:
            nxt = [e for e in read_events(str(run_dir)) if e["event"] == "started" and e["attempt"] == attempt + 1]
            if nxt:
                assert drained not in nxt[0]["nodes"], (drained, nxt)
                break
            time.sleep(0.2)
    finally:
        _node(drained, "resume")


def test_soak_every_fault_kind_in_one_run_loses_nothing(tmp_path, tmp_path_factory, cluster):
    seed = int(os.environ.get("MESHRUN_SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"soak seed {seed} (replay: MESHRUN_SOAK_SEED={seed})")
    try:
        _soak(tmp_path, tmp_path_factory, seed)
    except BaseException as exc:
        raise AssertionError(f"soak seed {seed} (replay with MESHRUN_SOAK_SEED={seed}): {exc}") from exc


def _soak(tmp_path, tmp_path_factory, seed):
    start_reference(tmp_path_factory, *COMMON)
    plan = fault_sequence(seed)
    env = faults_env(tmp_path, plan)
    run_dir = tmp_path / "run"
    t0 = time.time()
    submit(
        run_dir,
        "train.checkpoint_every=1",  # every attempt that runs a step leaves a checkpoint to resume
        "cluster.max_retries=8",
        "cluster.max_in_job_restarts=2",
        env=env,
    )
    for attempt, fault in sorted(plan.items()):
        _started(run_dir, attempt)
        if fault["kind"] in ("preempt", "batch_kill", "drain"):
            _act(run_dir, env, attempt, fault["kind"])
    deadline = time.time() + 300
    while not any(e["event"] in ("completed", "stopped") for e in read_events(str(run_dir))):
        assert time.time() < deadline, f"not finished: {read_events(str(run_dir))}"
        time.sleep(0.5)
    for attempt in plan:
        release(env, attempt)
    events = read_events(str(run_dir))
    print(f"soak: {len(plan)} faults, {time.time() - t0:.0f} s; events: {[e['event'] for e in events]}")
    assert events[-1]["event"] == "completed", events
    starts = [e for e in events if e["event"] == "started"]
    assert len(starts) == len(plan) + 1, [(e["attempt"], e["job_id"]) for e in starts]
    for attempt, fault in plan.items():
        mine = [e for e in events if e.get("attempt") == attempt]
        kinds = [e["event"] for e in mine]
        if fault["kind"].startswith("kill_"):
            failed = [e for e in mine if e["event"] == "failed"]
            assert os.path.exists(os.path.join(env["FAULTS_DIR"], f"killed_{attempt}_{fault['rank']}")), fault
            assert [(e["rank"], e["exit_code"]) for e in failed] == [(fault["rank"], -9)], (attempt, fault, mine)
            assert failed[0]["node"] == starts[attempt]["nodes"][fault["rank"] // 2], (failed, starts[attempt])
            assert failed[0]["reason"].startswith("killed by SIGKILL"), failed
        elif fault["kind"] == "raise_step":
            assert "restarted_in_job" in kinds, (attempt, mine)
            assert starts[attempt + 1]["job_id"] == starts[attempt]["job_id"]  # the same allocation
        elif fault["kind"] == "batch_kill":
            failed = [e for e in mine if e["event"] == "failed"]
            assert [e["rank"] for e in failed] == [-1] and "--batch" in failed[0]["reason"], mine
        else:  # preempt, drain: a stop after a checkpoint, requeued free of charge
            assert [e["cause"] for e in mine if e["event"] == "requeued"] == ["stopped_early"], (attempt, mine)
    losses = metrics(run_dir)  # asserts no step ran twice
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)
    want = reference(*COMMON)
    for step, loss in want.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    deadline = time.time() + 60  # the epilogue writes goodput.json after the completed event
    while not (g := _goodput(run_dir)).get("finished"):
        assert time.time() < deadline, g
        time.sleep(0.5)
    assert g["finished"] and g["attempts"] == len(starts), g
    causes = ("queue", "startup", "productive", "lost_steps", "checkpoint_blocking", "eval", "restart_gap")
    assert sum(g[c] for c in causes) == pytest.approx(g["wall_s"], rel=1e-3, abs=0.05), g
    assert g["productive"] > 0 and g["goodput"] == pytest.approx(g["productive"] / g["wall_s"], rel=1e-3), g
