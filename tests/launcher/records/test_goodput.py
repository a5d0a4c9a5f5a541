"""Goodput outside Slurm (launcher/records/goodput.py): a real local run's goodput.json adds up to its wall time, a
sweep's status adds its runs' seconds per cause, the report draws the attempts and writes goodput.json.
The Slurm case (queue wait from sacct, a preemption, killed ranks, lost steps) is tests/test_in_job_restart.py."""

from __future__ import annotations

import json
import os

import helpers.slurm as dev
import pytest

from launcher.manage.report import build_report
from launcher.manage.status import run_status, sweep_status
from launcher.records.goodput import CAUSES, compute
from training.contract.rundir.paths import GOODPUT_FILE


@pytest.mark.slow  # CPU ranks started by the CLI
def test_a_local_run_writes_goodput_that_adds_up_to_its_wall_time(tmp_path):
    run_dir = tmp_path / "run"
    res = dev.meshrun(
        "cluster=local",
        "cluster.gpus_per_node=1",
        "model=tiny",
        "data=synthetic",
        "parallel.tp=1",
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.eval_every=2",
        "train.progress=false",
        "train.tensorboard=false",
        f"run.dir={run_dir}",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    with open(run_dir / GOODPUT_FILE) as f:
        g = json.load(f)
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    assert g["finished"] and g["wall_s"] == pytest.approx(events[-1]["time"] - events[0]["time"], abs=1e-3)
    assert sum(g[c] for c in CAUSES) == pytest.approx(g["wall_s"], abs=0.01)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    # Every step kept: productive covers at least the steps' own measured times; nothing lost, no queue.
    assert g["productive"] >= sum(r["step_time_s"] for r in rows) - 0.01
    assert g["lost_steps"] == 0 and g["lost_step_count"] == 0 and g["queue"] == 0
    evals = [r["eval_s"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and g["eval"] == pytest.approx(sum(evals), abs=0.01)
    saves = [e["blocked_s"] for e in events if e["event"] == "checkpoint"]
    assert saves and g["checkpoint_blocking"] == pytest.approx(sum(saves), abs=0.01)
    st = run_status(str(run_dir))
    assert st["goodput"] == pytest.approx(g["goodput"], abs=1e-6) and st["goodput_s"]["wall_s"] == g["wall_s"]

    # The report draws the attempts and names the goodput among its facts.
    _, report = build_report(str(run_dir))
    drawn = [f.path for f in report.figures if f.name == "goodput"]
    assert drawn and os.path.getsize(drawn[0]) > 0
    assert any(k == "goodput" and f"{100 * g['goodput']:.1f} %" in v for k, v in report.facts)


def _run(run_dir, t0, productive, lost):
    """A finished local run: 1 s of start-up, `productive` kept steps of 1 s, `lost` purged ones."""
    os.makedirs(run_dir)
    events = [
        {"event": "started", "attempt": 0, "job_id": "local", "time": t0},
        {"event": "completed", "attempt": 0, "job_id": "local", "time": t0 + 1 + productive + lost},
    ]
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(
            json.dumps({"step": s, "loss": 1.0, "time": t0 + 1 + s, "step_time_s": 1.0, "attempt": 0}) + "\n"
            for s in range(1, productive + 1)
        )
    with open(os.path.join(run_dir, "metrics.purged.jsonl"), "w") as f:
        f.writelines(
            json.dumps(
                {"step": productive + s, "loss": 1.0, "time": t0 + 1 + productive + s, "step_time_s": 1.0, "attempt": 0}
            )
            + "\n"
            for s in range(1, lost + 1)
        )
    return events


def test_a_sweep_sums_its_runs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _run(a, 1000.0, 6, 0)
    _run(b, 2000.0, 2, 2)
    with open(tmp_path / "sweep.json", "w") as f:
        json.dump({"feasible": [{"num": 0, "run_dir": a, "status": "ok"}, {"num": 1, "run_dir": b, "status": "ok"}]}, f)
    st = sweep_status(str(tmp_path))
    g = st["goodput_s"]
    assert (g["wall_s"], g["productive"], g["lost_steps"], g["startup"], g["lost_step_count"], g["runs"]) == (
        12.0,
        8.0,
        2.0,
        2.0,
        2,
        2,
    )
    assert st["goodput"] == pytest.approx(8 / 12)
    assert [pt["goodput"] for pt in st["points"]] == [pytest.approx(6 / 7), pytest.approx(2 / 5)]


def test_a_running_run_counts_up_to_now_and_nothing_before_it_starts():
    assert compute([{"event": "submitted", "time": 5.0}], [], [], now=9.0) is None
    ev = [{"event": "submitted", "time": 100.0}, {"event": "started", "attempt": 0, "job_id": "9", "time": 103.0}]
    g = compute(ev, [], [], {"9": [(100.0, 102.0)]}, now=110.0)
    assert not g["finished"] and g["wall_s"] == 10 and g["queue"] == 2 and g["startup"] == 1 + 7


def test_goodput_is_the_quotient_of_the_figures_the_file_shows():
    # Times whose sub-millisecond parts the file rounds away: productive 10.0004 s of a 60.0004 s wall.
    ev = [
        {"event": "submitted", "time": 0.0},
        {"event": "started", "attempt": 0, "job_id": "9", "time": 0.0},
        {"event": "completed", "attempt": 0, "job_id": "9", "time": 60.0004},
    ]
    rows = [{"attempt": 0, "step": 1, "time": 10.0004, "step_time_s": 10.0004}]
    g = compute(ev, rows, [], now=70.0)
    assert g["finished"] and (g["wall_s"], g["productive"]) == (60.0, 10.0)
    # What a reader computes from goodput.json is what it says (10.0004 / 60.0004 would give 0.166673).
    assert g["goodput"] == round(g["productive"] / g["wall_s"], 6) == 0.166667
