"""Elastic shrink and growth on Slurm: cluster.elastic.min_nodes.

Pure tests of the decision (launcher/slurm/elastic.py, launcher/slurm/requeue.py) and of the up-front validation;
the checkpoint resharded from dp=3 to dp=2 with ZeRO-1 shards (2 spawns); one scenario on the real dev cluster:
a 3-node job loses a node (its rank killed, the node drained), resumes on 2 nodes with dp=2, grows back to 3
once the node returns, and its losses equal an uninterrupted run's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import helpers.slurm as dev
import pytest
from helpers.checkpoint import load_worker, save_worker
from helpers.dist import run_distributed

from launcher.launch.gate import validate_for_launch
from launcher.plan.validate import validate
from launcher.slurm.elastic import elastic_checks, plan_resize, pool, with_nodes
from launcher.slurm.requeue import decide
from training.contract.config import Config
from training.contract.layout_text import layout_fields
from training.contract.rundir.events import read_events


def _cfg(nodes=3, global_batch=6, min_nodes=2, wait_min=0.0) -> Config:
    cfg = Config()
    c, p = cfg.cluster, cfg.parallel
    c.kind, c.partition, c.nodes, c.gpus_per_node = "slurm", "debug", nodes, 1
    p.tp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, False, 1, 1, global_batch
    c.elastic.min_nodes, c.elastic.wait_min = min_nodes, wait_min
    return cfg


# ------------------------------------------------------------------------------- validation up front
def test_every_shrunk_layout_is_validated_before_submission():
    assert elastic_checks(_cfg(global_batch=6, min_nodes=1)) == []  # 1, 2 and 3 nodes all divide 6
    errors = elastic_checks(_cfg(global_batch=9, min_nodes=2))  # 3 nodes divide 9, 2 do not
    assert len(errors) == 1 and "shrink to 2 node(s) (dp=2)" in errors[0] and "global_batch 9" in errors[0]
    assert "cluster.elastic.min_nodes=3" in errors[0]  # the fix names the smallest valid count
    report = validate_for_launch(_cfg(global_batch=9, min_nodes=2))
    assert any("cluster.elastic.min_nodes=2" in i.message for i in report.errors)
    assert "exceeds cluster.nodes=3" in elastic_checks(_cfg(min_nodes=4))[0]
    assert "wait_min" in elastic_checks(_cfg(wait_min=-1.0))[0]
    assert elastic_checks(_cfg(global_batch=9, min_nodes=0)) == []  # off: nothing to check


def test_a_shrunk_layout_that_does_not_fit_is_refused_with_the_planners_reason():
    """ZeRO-1 shards the optimizer over dp: on fewer nodes each GPU holds more of it. A memory between the
    3-node and the 1-node need fits the full job only."""
    cfg = _cfg(min_nodes=1)
    cfg.model.hidden_size, cfg.model.num_layers = 512, 8
    need = {n: validate(with_nodes(cfg, n)).plan.memory_bytes["total"] for n in (1, 3)}
    assert need[1] > need[3]
    cfg.cluster.gpu_memory_gb = (need[1] + need[3]) / 2 / 1e9
    assert not validate(cfg).errors
    errors = elastic_checks(cfg)
    assert len(errors) == 1 and "shrink to 1 node(s)" in errors[0] and "cluster.gpu_memory_gb" in errors[0]


# ------------------------------------------------------------------------------- the decision
def _states(**kw):
    return lambda partition: dict(kw)


SUBMITTED = [{"event": "submitted", "nodes": 3}]


def test_a_lost_node_is_excluded_down_to_min_nodes():
    recs = [
        {"rank": 0, "node": "n1", "exit_code": -9, "ended": 2.0},
        {"rank": 1, "node": "n2", "exit_code": -9, "ended": 1.0},
        {"rank": 2, "node": "n3", "exit_code": -9, "ended": 2.0},
    ]
    layout_ = {0: "n1", 1: "n2", 2: "n3"}
    full = decide(recs, 3, layout_, True, 0, 2, [], ["n1", "n2", "n3"], 3)
    assert full.action == "resubmit" and full.exclude == [] and "not excluding n2" in full.note  # today's rule
    elastic = decide(recs, 3, layout_, True, 0, 2, [], ["n1", "n2", "n3"], 2)  # nodes_needed = min_nodes
    assert elastic.action == "resubmit" and elastic.exclude == ["n2"]


def test_shrinks_at_once_when_too_few_nodes_are_up():
    cfg = _cfg(wait_min=30.0)
    r = plan_resize(
        cfg,
        SUBMITTED,
        ["n1", "n2", "n3"],
        ["n2"],
        ["n2"],
        states_fn=_states(n1="alloc", n2="drng", n3="alloc"),
        sleep=pytest.fail,
    )  # no wait: none to come
    assert r.event == "shrunk" and r.exclude == ["n2"] and r.readmitted == []
    assert (r.old["nodes"], r.old["dp"], r.old["grad_accum"]) == (3, 3, 2)
    assert (r.new["nodes"], r.new["dp"], r.new["grad_accum"]) == (2, 2, 3)
    assert r.new["global_batch"] == r.old["global_batch"] == 6
    assert r.cfg.cluster.nodes == 2 and r.cfg.parallel.dp is None  # derived dp stays derived


def test_waits_for_busy_nodes_up_to_wait_min_then_shrinks():
    calls = []

    def states(partition):
        calls.append(1)  # n4 runs another job, then frees up on the third look
        return dict(n1="alloc", n2="alloc", n3="alloc", n4="idle" if len(calls) >= 3 else "alloc")

    r = plan_resize(
        _cfg(wait_min=5.0), SUBMITTED, ["n1", "n2", "n3"], ["n2"], ["n2"], states_fn=states, sleep=lambda s: None
    )
    assert r is None or r.event is None  # same node count on n1, n3, n4: nothing to resize
    assert len(calls) == 3
    r = plan_resize(
        _cfg(wait_min=0.0),
        SUBMITTED,
        ["n1", "n2", "n3"],
        ["n2"],
        ["n2"],
        states_fn=_states(n1="alloc", n2="alloc", n3="alloc", n4="alloc"),
        sleep=pytest.fail,
    )
    assert r.event == "shrunk" and r.new["nodes"] == 2  # wait_min=0: shrink at once
    r = plan_resize(
        _cfg(wait_min=5.0),
        SUBMITTED,
        ["n1", "n2", "n3"],
        ["n2"],
        ["n2"],
        job_end=time.time(),
        states_fn=_states(n1="alloc", n2="alloc", n3="alloc", n4="alloc"),
        sleep=pytest.fail,
    )
    assert r.new["nodes"] == 2  # never waits past the job's own time limit


def test_grows_back_when_the_excluded_node_returns_and_not_before():
    shrunk = with_nodes(_cfg(), 2)
    assert (
        plan_resize(shrunk, SUBMITTED, ["n1", "n3"], ["n2"], states_fn=_states(n1="alloc", n2="drain", n3="alloc"))
        is None
    )
    r = plan_resize(shrunk, SUBMITTED, ["n1", "n3"], ["n2"], states_fn=_states(n1="alloc", n2="idle", n3="alloc"))
    assert r.event == "grown" and r.readmitted == ["n2"] and r.exclude == [] and r.new["dp"] == 3
    # A node excluded by this very decision is never re-admitted by it, whatever Slurm shows.
    assert pool(dict(n1="alloc", n2="idle"), ["n1", "n2"], ["n2"], ["n2"], growing=True).readmit == []


def test_layout_keeps_an_explicit_dp_consistent():
    cfg = _cfg()
    cfg.parallel.dp = 3
    assert with_nodes(cfg, 2).parallel.dp == 2 and layout_fields(with_nodes(cfg, 2))["ranks"] == 2


# ------------------------------------------------------------------------------- checkpoint dp=3 -> dp=2, ZeRO-1
@pytest.mark.slow
def test_zero1_checkpoint_saved_at_dp3_loads_at_dp2_exactly(tmp_path):
    """training/checkpoint/ reshards the ZeRO-1 optimizer shards (uneven at dp=3) to dp=2: every rank's
    weights and Adam states equal the slice the new layout expects (tests/engine/test_checkpoint_reshard.py's check)."""
    run_dir = str(tmp_path)
    run_distributed(save_worker, 3, args=(run_dir, 1, 3, 1), timeout_s=180)
    run_distributed(load_worker, 2, args=(run_dir, [(1, 2, 1)]), timeout_s=180)


# ------------------------------------------------------------------------------- the dev cluster
KILL_RANK_1_AT_STEP_5 = """import os, signal, sys
if "training.main" in getattr(sys, "orig_argv", []) and os.environ.get("MESHRUN_ATTEMPT") == "0" \\
        and os.environ.get("RANK") == "1":
    import training.run.loop

    real = training.run.loop.Trainer.train_step

    def train_step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.state.step == 5:  # the node is lost: its rank dies without a word
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    training.run.loop.Trainer.train_step = train_step
"""
STEPS = 12
RUN = [
    "model=tiny",
    "data=synthetic",
    "parallel.tp=1",
    "parallel.pp=1",
    "parallel.sp=false",
    "parallel.micro_batch=1",
    "parallel.global_batch=6",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.progress=false",
    "cluster.gpus_per_node=1",
]


def _wait_event(run_dir, kind, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in read_events(str(run_dir)) if e["event"] == kind]
        if found:
            return found[0]
        assert not any(e["event"] == "stopped" for e in read_events(str(run_dir))), read_events(str(run_dir))
        time.sleep(0.3)
    raise AssertionError(f"no {kind} event within {timeout} s: {read_events(str(run_dir))}")


def _node_state(node):
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout.strip()


@pytest.mark.slurm
def test_lost_node_shrinks_to_two_nodes_then_grows_back_with_the_same_losses(tmp_path, cluster):
    # The uninterrupted reference: one local process, the same global batch, run beside the Slurm job.
    ref_dir, ref_out = tmp_path / "reference", tmp_path / "reference.out"
    with open(ref_out, "wb") as sink:  # a file, not a pipe: nobody reads its output while it runs
        ref = subprocess.Popen(
            [sys.executable, "-m", "launcher", "cluster=local", *RUN, "parallel.zero=0", f"run.dir={ref_dir}"],
            cwd=dev.ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILL_RANK_1_AT_STEP_5)
    run_dir = tmp_path / "run"
    drained = None
    jobs = []
    try:
        # exit_interval=8: the shrunk job stops after its step-8 checkpoint, a requeue that may grow the run.
        res = dev.meshrun(
            "cluster=slurm_dev",
            *RUN,
            "parallel.zero=1",
            "cluster.nodes=3",
            "cluster.elastic.min_nodes=2",
            "cluster.elastic.wait_min=0",
            "train.exit_interval=8",
            f"run.dir={run_dir}",
            env={"PYTHONPATH": str(inject)},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        jobs.append(re.search(r"submitted Slurm job (\d+)", res.stdout).group(1))
        first = _wait_event(run_dir, "started", 240)
        assert len(first["nodes"]) == 3, first
        drained = first["nodes"][1]  # rank 1's node (block distribution, one rank per node)
        subprocess.run(
            ["scontrol", "update", f"nodename={drained}", "state=drain", "reason=meshrun elastic test"], check=True
        )
        shrunk = _wait_event(run_dir, "shrunk", 240)
        jobs.append(shrunk["new_job_id"])
        # The node returns while the shrunk job runs: its step-8 stop grows the run back.
        subprocess.run(["scontrol", "update", f"nodename={drained}", "state=resume"], check=True)
        drained = None
        grown = _wait_event(run_dir, "grown", 300)
        jobs.append(grown["new_job_id"])
        status = dev.wait_final(run_dir, timeout=300)
    except BaseException:
        ref.kill()
        raise
    finally:
        if drained:  # other tests need all 3 nodes
            subprocess.run(["scontrol", "update", f"nodename={drained}", "state=resume"])
        for job in jobs:
            subprocess.run(["scancel", job])
    assert ref.wait(timeout=300) == 0, ref_out.read_text()[-3000:]
    reference = dev.metrics(ref_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))
    events = read_events(str(run_dir))
    assert status["state"] == "COMPLETED", events
    assert [len(e["nodes"]) for e in events if e["event"] == "started"] == [3, 2, 3], events
    failed = [e for e in events if e["event"] == "failed"]
    assert failed and failed[0]["rank"] == 1 and failed[0]["exit_code"] == -9
    old, new = shrunk["old_layout"], shrunk["new_layout"]
    assert (old["nodes"], old["dp"], new["nodes"], new["dp"]) == (3, 3, 2, 2), shrunk
    assert old["global_batch"] == new["global_batch"] == 6 and new["grad_accum"] == 3
    assert shrunk["excluded_nodes"] == [first["nodes"][1]]
    assert (grown["old_layout"]["dp"], grown["new_layout"]["dp"]) == (2, 3)
    assert grown["readmitted_nodes"] == [first["nodes"][1]] and grown["excluded_nodes"] == []
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [e["cause"] for e in requeued] == ["failure", "stopped_early"], requeued
    # Resumed from the step-4 checkpoint (dp=3 -> 2) and the step-8 one (dp=2 -> 3): nothing lost beyond them.
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4, 8]
    assert status["layout"]["nodes"] == 3 and status["layout"]["dp"] == 3 and status["excluded_nodes"] == []
    losses = dev.metrics(run_dir, last_wins=True)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, abs=1e-4), (step, losses[step], loss)
    assert _node_state(first["nodes"][1]) not in ("drain", "drng")
