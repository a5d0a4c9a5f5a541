"""In-job restart onto spare nodes and goodput accounting, on the real dev Slurm cluster (3 fake nodes).

One job on 2 nodes with 1 spare goes through every case in sequence (the failures are triggered inside the
ranks at fixed steps, so the sequence does not depend on how fast this machine runs):
  attempt 0: the second node is lost (both its rank wrappers and ranks die at once, as in
             tests/test_fault_matrix_slurm.py) -> the step restarts on the spare, same job id, no requeue;
  attempt 1: rank 0 raises a Python exception (blamed on no node) -> restarts in place, same nodes;
  attempt 2: the second node of the step is lost again, no spare left -> resubmitted, excluding it;
  attempt 3: Slurm's preemption signal (scancel --signal=USR2, what Slurm sends) -> save, requeue (same job);
  attempt 4: completes.
The losses equal an uninterrupted local run of the same layout; goodput's causes add up to the wall time, and
its lost steps are the steps computed twice (metrics.purged.jsonl).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import helpers.slurm as dev
import pytest
from helpers import jobs as noted_jobs

from launcher.manage.status import run_status
from launcher.records.goodput import CAUSES, compute
from launcher.slurm import in_job
from training.contract.config import ClusterConfig
from training.contract.rundir.events import read_events
from training.contract.rundir.paths import GOODPUT_FILE

# Faults by attempt, at the entry of a training step (state.step = steps completed): rows 1..K are logged.
INJECT = r"""import json, os, signal, subprocess, sys
if "training.main" in getattr(sys, "orig_argv", []):
    import training.run.loop

    _attempt = os.environ.get("MESHRUN_ATTEMPT")
    _node = os.environ.get("SLURM_NODEID")
    _rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    _real = training.run.loop.Trainer.train_step
    # Who started this rank: its wrapper (cold) or the node's warm agent (launcher/ranks/warm/slurm.py).
    with open(os.path.join(os.path.dirname(__file__), f"proc_{_attempt}_{_rank}.json"), "w") as _f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "node": os.environ.get("SLURMD_NODENAME")}, _f)

    def train_step(self, *args, **kwargs):
        done = self.state.step
        if _attempt in ("0", "2") and done == {0: 5, 2: 9}[int(_attempt)] and _node == "1":
            # The node is lost: its rank wrapper, its warm agent (when the rank came from one) and the rank vanish.
            for _pid in (os.environ.get("MESHRUN_WRAPPER_PID"), os.environ.get("MESHRUN_WARM_AGENT_PID")):
                if _pid:
                    os.kill(int(_pid), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if _attempt == "1" and done == 7 and _rank == "0":
            raise RuntimeError("injected: a bug-like failure on rank 0, no node to blame")
        if _attempt == "3" and done == 10 and _rank == "0" and not getattr(self, "_preempted", False):
            self._preempted = True  # as Slurm preempts: USR2 to every task of the job's steps
            subprocess.run(["scancel", "--signal=USR2", os.environ["SLURM_JOB_ID"]], check=True)
        return _real(self, *args, **kwargs)

    training.run.loop.Trainer.train_step = train_step
"""


@pytest.mark.slurm
def test_spare_replaces_a_lost_node_in_job_then_falls_back_and_goodput_adds_up(tmp_path, cluster):
    ref_dir = tmp_path / "reference"
    # The uninterrupted reference (4 local CPU ranks, the same layout), run while the Slurm job runs.
    ref = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "cluster=local",
            "cluster.gpus_per_node=4",
            *dev.COMMON,
            f"run.dir={ref_dir}",
        ],
        cwd=dev.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    run_dir = tmp_path / "run"
    try:
        # Five attempts: start-up kept short (no preflight, TensorBoard or progress bar: not what is tested here).
        res = dev.meshrun(
            "cluster=slurm_dev",
            *dev.COMMON,
            f"run.dir={run_dir}",
            "cluster.spare_nodes=1",
            "cluster.max_in_job_restarts=3",
            "cluster.preflight.mode=off",
            "train.tensorboard=false",
            "train.progress=false",
            env={"PYTHONPATH": str(inject)},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        job = noted_jobs.submitted[-1]
        status = _wait_final_noting(run_dir, timeout=420)
    finally:
        out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-3000:]
    events = read_events(str(run_dir))
    starts = [e for e in events if e["event"] == "started"]
    assert status["state"] == "COMPLETED", events
    # Attempts 0-2 in the first job's allocation of 3 nodes; 3-4 in the resubmitted job (2 nodes, requeued once).
    assert [(e["job_id"], e["restart_count"]) for e in starts][:3] == [(job, 0)] * 3, starts
    assert starts[0]["allocation"] == sorted(starts[0]["allocation"]) and len(starts[0]["allocation"]) == 3
    first, lost1 = starts[0]["nodes"], starts[0]["nodes"][1]
    spare = [n for n in starts[0]["allocation"] if n not in first]
    assert starts[0]["spares"] == spare and len(spare) == 1
    restarts = [e for e in events if e["event"] == "restarted_in_job"]
    assert [(e["attempt"], e["cause"], e["replaced_node"], e["spare"]) for e in restarts] == [
        (0, "node_lost", lost1, spare[0]),
        (1, "rank_failed", None, None),
    ], restarts
    # The spare takes the lost node's place; rank 0's node keeps its ranks; the in-place restart keeps the nodes.
    assert starts[1]["nodes"] == [first[0], spare[0]] and starts[2]["nodes"] == starts[1]["nodes"]
    assert (starts[1]["spares"], starts[1]["in_job_restarts"]) == ([], 1)
    assert restarts[1]["spares_left"] == 0 and restarts[1]["restart"] == 2
    # No requeue before the third failure; then the resubmission excludes the node lost in attempt 2.
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [(e["attempt"], e["cause"]) for e in requeued] == [(2, "failure"), (3, "stopped_early")], requeued
    lost2 = starts[2]["nodes"][1]
    assert lost2 in requeued[0]["excluded_nodes"] and "no in-job restart: no spare left" in requeued[0]["note"]
    new_job = requeued[0]["new_job_id"]
    assert [(e["job_id"], e["restart_count"]) for e in starts[3:]] == [(new_job, 0), (new_job, 1)]
    assert lost2 not in starts[3]["nodes"] + starts[4]["nodes"]
    # Resumed from the checkpoints before each failure: steps 4, 6, 8 and the preemption's save.
    resumed = [e["step"] for e in events if e["event"] == "resumed"]
    assert resumed[:3] == [4, 6, 8] and resumed[3] >= 10, resumed
    # Every rank of the in-job restarts was forked by its node's warm agent (its parent), started with the
    # allocation: on the spare it had imported everything before the node was lost.
    agents = {e["node"]: e for e in events if e["event"] == "warm_agent" and e["job_id"] == job}
    assert all(a["ready"] for a in agents.values()) and sorted(agents) == starts[0]["allocation"], agents
    assert agents[spare[0]]["time"] < restarts[0]["time"]
    for attempt in (1, 2):
        for rank in range(4):
            proc = json.loads((inject / f"proc_{attempt}_{rank}.json").read_text())
            assert proc["ppid"] == agents[proc["node"]]["pid"], (attempt, rank, proc, agents)
            if attempt == 1:  # (attempt 2's lost node left no record)
                record = json.loads((run_dir / "slurm" / "attempt_1" / f"rank_{rank}.json").read_text())
                assert (record["start"], record["pid"]) == ("warm", proc["pid"]), record
    # The losses of an uninterrupted run, every step once in metrics.jsonl.
    reference, losses = dev.metrics(ref_dir), dev.metrics(run_dir)
    assert sorted(losses) == list(range(1, dev.STEPS + 1)) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=0, abs=1e-6), (step, losses[step], loss)

    # Goodput: written by the last epilogue, the same as status computes; the causes add up to the wall time.
    # The last epilogue writes it after its `completed` event (with an sacct query): wait for that write.
    deadline = time.time() + 60
    while True:
        with open(run_dir / GOODPUT_FILE) as f:
            g = json.load(f)
        if g["finished"] or time.time() > deadline:
            break
        time.sleep(0.5)
    assert g["finished"] and g["attempts"] == 5
    assert abs(sum(g[c] for c in CAUSES) - g["wall_s"]) <= 0.01 * g["wall_s"], g
    assert g["wall_s"] == pytest.approx(events[-1]["time"] - events[0]["time"], abs=0.01)
    assert g["goodput"] == pytest.approx(g["productive"] / g["wall_s"], abs=1e-5) and 0 < g["goodput"] < 1
    # Lost steps: those computed twice (a purged row and a kept row of the same step).
    purged = [json.loads(line) for line in open(run_dir / "metrics.purged.jsonl")]
    recomputed = [r["step"] for r in purged if r["step"] in losses]
    assert g["lost_step_count"] == len(recomputed) == 3 and sorted(recomputed) == [5, 7, 9], purged
    assert g["lost_steps"] > 0 and g["restart_gap"] > 0 and g["checkpoint_blocking"] > 0 and g["startup"] > 0
    assert g["queue"] > 0  # the requeue (preemption) waited in Slurm's queue (sacct: Submit -> Start)
    status = run_status(str(run_dir))
    assert status["goodput_s"]["wall_s"] == pytest.approx(g["wall_s"], abs=0.01)
    assert status["goodput"] == pytest.approx(g["goodput"], abs=1e-4)
    assert (status["spares_left"], status["in_job_restarts_total"]) == (0, 2)


def _wait_final_noting(run_dir, timeout):
    """dev.wait_final, noting every resubmitted job for tests/conftest.py's cancel on failure."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        events = read_events(str(run_dir))
        for e in events:
            if e.get("new_job_id") and str(e["new_job_id"]) not in noted_jobs.submitted:
                noted_jobs.submitted.append(str(e["new_job_id"]))
        if events and events[-1]["event"] in ("completed", "stopped"):
            return run_status(str(run_dir))
        time.sleep(0.5)
    raise AssertionError(f"run {run_dir} not finished after {timeout} s; events: {read_events(str(run_dir))}")


# ------------------------------------------------------------------------------------------- pure decisions
def _c(**kw):
    return ClusterConfig(nodes=2, spare_nodes=1, max_in_job_restarts=2, **kw)


def test_plan_replaces_the_blamed_node_keeps_places_and_falls_back():
    alloc = ["n1", "n2", "n3"]
    r = in_job.plan(_c(), alloc, ["n1", "n2"], ["n2"], [], 0)
    assert (r.ok, r.step, r.replaced, r.spares_used) == (True, ["n1", "n3"], ["n2"], ["n3"])
    r = in_job.plan(_c(), alloc, ["n1", "n3"], [], ["n2"], 1)  # no node blamed: the same nodes
    assert (r.ok, r.step, r.spares_used) == (True, ["n1", "n3"], [])
    r = in_job.plan(_c(), alloc, ["n1", "n3"], ["n1"], ["n2"], 1)
    assert not r.ok and r.why.startswith("no spare left") and r.bad == ["n2", "n1"]
    r = in_job.plan(_c(), alloc, ["n1", "n2"], [], [], 2)
    assert not r.ok and "exhausted" in r.why
    # Slurm shows the step's node down (a real node loss) though no rank record blamed it: replaced.
    r = in_job.plan(_c(), alloc, ["n1", "n2"], [], [], 0, unusable=["n2"])
    assert (r.ok, r.step, r.replaced) == (True, ["n1", "n3"], ["n2"])


def test_config_errors_name_the_fix():
    assert "negative" in in_job.config_errors(ClusterConfig(spare_nodes=-1, max_in_job_restarts=1))[0]
    assert "negative" in in_job.config_errors(ClusterConfig(max_in_job_restarts=-1))[0]


def test_spare_nodes_alone_imply_in_job_restarts():
    """Asking for a spare means wanting in-job restarts (issue 47): no refusal, one restart per spare, the spares
    in the allocation; an explicit count wins; no spares and no count: off, as before."""
    spares = ClusterConfig(nodes=2, spare_nodes=1)
    assert in_job.config_errors(spares) == []
    assert in_job.enabled(spares) and in_job.restart_limit(spares) == 1 and in_job.allocation_nodes(spares) == 3
    explicit = ClusterConfig(nodes=2, spare_nodes=1, max_in_job_restarts=3)
    assert in_job.restart_limit(explicit) == 3
    off = ClusterConfig(nodes=2)
    assert not in_job.enabled(off) and in_job.allocation_nodes(off) == 2
    r = in_job.plan(spares, ["n1", "n2", "n3"], ["n1", "n2"], ["n2"], [], 0)
    assert (r.ok, r.step, r.spares_used) == (True, ["n1", "n3"], ["n3"])
    r = in_job.plan(spares, ["n1", "n2", "n3"], ["n1", "n3"], ["n3"], ["n2"], 1)
    assert not r.ok and "exhausted" in r.why and "one per spare" in r.why


def test_goodput_segments_add_up_and_count_recomputed_steps():
    t = 1000.0
    ev = [
        {"event": "submitted", "time": t, "job_id": "7"},
        {"event": "started", "attempt": 0, "job_id": "7", "restart_count": 0, "time": t + 10},
        {"event": "checkpoint", "attempt": 0, "time": t + 22.5, "blocked_s": 0.5},
        {"event": "restarted_in_job", "attempt": 0, "time": t + 30},
        {"event": "started", "attempt": 1, "job_id": "7", "restart_count": 0, "time": t + 32},
        {"event": "completed", "attempt": 1, "time": t + 50},
    ]
    kept = [
        {"step": 1, "time": t + 21, "step_time_s": 1.0, "attempt": 0},
        {"step": 2, "time": t + 23, "step_time_s": 1.0, "attempt": 0},
        {"step": 3, "time": t + 40, "step_time_s": 1.0, "attempt": 1, "eval_s": 0.25},
    ]
    purged = [{"step": 3, "time": t + 24, "step_time_s": 1.0, "attempt": 0}]
    g = compute(ev, kept, purged, {"7": [(t, t + 4)]}, now=t + 99)
    assert g["wall_s"] == 50 and sum(g[c] for c in CAUSES) == pytest.approx(50)
    assert g["queue"] == 4 and g["lost_steps"] == 1 and g["lost_step_count"] == 1
    assert g["checkpoint_blocking"] == 0.5 and g["eval"] == 0.25
    # startup: 4->10 before the prologue, 10->20 and 32->39 to the first steps, 40->50 after the last step.
    assert g["startup"] == pytest.approx(6 + 10 + 7 + 10)
    assert g["productive"] == pytest.approx(1 + 1.5 + 0.75) and g["restart_gap"] == pytest.approx(6 + 2)


def test_batch_script_loops_over_steps_in_one_allocation(tmp_path):
    """The sbatch text: nodes + spares with --no-kill, srun on the prologue's step nodes, the epilogue's
    EXIT_RESTART_IN_JOB starts the next step; valid bash (bash -n). Without in-job restarts: unchanged."""
    from helpers.slurm import dev_cfg

    from launcher.slurm.sbatch import job_spec, preflight_job_spec, sbatch_text
    from training.contract.exit_codes import EXIT_RESTART_IN_JOB

    script = sbatch_text(job_spec(dev_cfg(spare_nodes=1, max_in_job_restarts=2), str(tmp_path)))
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    lines = script.splitlines()
    loop, srun, done = (
        lines.index("while :; do"),
        next(i for i, x in enumerate(lines) if x.startswith("srun ")),
        lines.index("done"),
    )
    assert loop < srun < done and "prologue" in lines[loop + 1]
    assert f'if [ "$MESHRUN_EPILOGUE_RC" -eq {EXIT_RESTART_IN_JOB} ]; then continue; fi' in lines[srun:done]
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (
        in_job.step_args_line(["n1", "n3"], 2)
        == "MESHRUN_STEP_ARGS=(--nodes=2 --ntasks=4 --ntasks-per-node=2 --nodelist=n1,n3)"
    )
    plain = sbatch_text(job_spec(dev_cfg(), str(tmp_path)))
    assert "while :; do" not in plain and "#SBATCH --no-kill" not in plain and "#SBATCH --nodes=2" in plain
    pre = sbatch_text(preflight_job_spec(dev_cfg(spare_nodes=1, max_in_job_restarts=2), str(tmp_path)))
    assert "while :; do" not in pre and "srun()" not in pre


def test_cadence_counts_the_cheaper_in_job_restart_when_spares_exist():
    """checkpoint_every_min=auto's expected goodput: with 2 spares (and restarts allowed) 2 of every 3 node
    failures restart in the job (cluster.in_job_restart_min) and one requeues (cluster.restart_min)."""
    from helpers.slurm import dev_cfg

    from launcher.plan.cadence import advise, expected_goodput

    cfg = dev_cfg(node_mtbf_h=2.0, restart_min=30.0, in_job_restart_min=1.5)
    cfg.train.checkpoint_every_min = "auto"
    plain = advise(cfg)
    cfg.cluster.spare_nodes, cfg.cluster.max_in_job_restarts = 2, 5
    spares = advise(cfg)
    assert plain.restart_s == 1800 and spares.restart_s == pytest.approx((2 * 90 + 1800) / 3)
    assert "2 of 3 failures restart in the job" in spares.restart_source
    assert spares.goodput_optimal == pytest.approx(
        expected_goodput(spares.optimal_min * 60, spares.save_s, spares.restart_s, 3600.0)
    )
    assert spares.goodput_optimal > plain.goodput_optimal + 0.1
    cfg.cluster.max_in_job_restarts = 1  # one in-job restart per allocation: 1 of 2
    assert advise(cfg).restart_s == pytest.approx((90 + 1800) / 2)
