"""Issue 28: a requeue after a stop with a checkpoint does not preflight again the nodes that passed minutes ago
(cluster.preflight.requeue_reuse_min, launcher/slurm/preflight_reuse.py). The rule on event lists, then the Slurm
prologue (launcher/slurm/driver.py) run in-process on real files: what it exports and records."""

from __future__ import annotations

import json
import os

import pytest

from launcher.slurm import driver
from launcher.slurm.preflight_reuse import requeue_passed
from training.contract.config import Config, config_to_dict
from training.contract.rundir.events import append_event, read_events

T = 1_000_000.0


def _history(cause="stopped_early", preflight_time=T, nodes=None, extra=()):
    return [
        {"event": "started", "attempt": 0, "time": T - 10},
        {
            "event": "preflight",
            "attempt": 0,
            "time": preflight_time,
            "nodes": nodes or {"n1": "ok", "n2": "warn"},
            "bad_nodes": [],
        },
        *extra,
        {"event": "requeued", "attempt": 0, "cause": cause, "time": T + 100},
    ]


def test_the_rule_reuses_only_recent_passes_after_a_stop_with_a_checkpoint():
    window = 1800.0
    assert requeue_passed(_history(), 1, ["n1", "n2"], window, T + 200) == ["n1", "n2"]
    assert requeue_passed(_history(), 1, ["n1", "n3"], window, T + 200) == ["n1"]  # n3 was never checked
    assert requeue_passed(_history(), 1, ["n1", "n2"], window, T + window + 1) == []  # too long ago
    assert requeue_passed(_history(), 1, ["n1", "n2"], 0.0, T + 200) == []  # the key's default: off
    assert requeue_passed(_history(cause="failure"), 1, ["n1", "n2"], window, T + 200) == []
    assert requeue_passed(_history(cause="no_progress"), 1, ["n1", "n2"], window, T + 200) == []
    bad = _history(nodes={"n1": "ok", "n2": "fail"})
    assert requeue_passed(bad, 1, ["n1", "n2"], window, T + 200) == ["n1"]
    failed_since = _history(extra=[{"event": "failed", "attempt": 0, "node": "n2", "time": T + 50}])
    assert requeue_passed(failed_since, 1, ["n1", "n2"], window, T + 200) == ["n1"]
    # Attempt 1 reused both nodes and ran no preflight; attempt 2 after another stop: the pass of attempt 0 counts,
    # and a later attempt's preflight that only reused n1 (it checked n3) does not make n1's pass newer.
    chain = _history() + [
        {"event": "started", "attempt": 1, "time": T + 110, "preflight_passed": ["n1"]},
        {"event": "preflight", "attempt": 1, "time": T + 120, "nodes": {"n1": "ok", "n3": "ok"}, "bad_nodes": []},
        {"event": "requeued", "attempt": 1, "cause": "stopped_early", "time": T + 200},
    ]
    assert requeue_passed(chain, 2, ["n1", "n3"], window, T + window + 5) == ["n3"]
    assert requeue_passed(chain, 2, ["n1", "n3"], window, T + 300) == ["n1", "n3"]


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "run"
    d.mkdir()
    cfg = Config()
    cfg.cluster.preflight.mode = "gate"
    cfg.cluster.preflight.requeue_reuse_min = 30
    (d / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    monkeypatch.setenv("SLURM_JOB_ID", "424243")  # a job id no queue holds: stop_time asks Slurm, finds none
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return str(d)


@pytest.mark.parametrize("cause", ["stopped_early", "failure"])
def test_the_prologue_exports_and_records_the_reused_nodes(run_dir, capsys, cause):
    append_event(run_dir, "submitted", job_id="424243")
    append_event(run_dir, "started", attempt=0, job_id="424243", nodes=["n1", "n2"])
    append_event(run_dir, "preflight", attempt=0, status="ok", nodes={"n1": "ok", "n2": "ok"}, bad_nodes=[])
    append_event(run_dir, "requeued", attempt=0, cause=cause, job_id="424243")
    assert driver.prologue(run_dir) == 0
    out = capsys.readouterr().out
    started = [e for e in read_events(run_dir) if e["event"] == "started"][-1]
    assert started["attempt"] == 1
    if cause == "stopped_early":
        assert "export MESHRUN_PREFLIGHT_PASSED=n1,n2" in out and started["preflight_passed"] == ["n1", "n2"]
    else:
        assert "MESHRUN_PREFLIGHT_PASSED" not in out and "preflight_passed" not in started


def test_started_names_the_checkpoint_the_attempt_resumes_from_not_the_last_logged_step(run_dir, capsys):
    """Issue 46 item 4: after a rank was killed at step 29 of a run whose newest checkpoint is step 9, the next
    attempt's `started` said resume_step 29 (the last metrics row); it resumes from step 9. The prologue now
    names the checkpoint (the newest on the `latest` line) and keeps the last logged step as last_step."""
    from training.checkpoint import storage

    for step, previous in ((6, None), (9, 6)):
        os.makedirs(storage.step_dir(run_dir, step))
        storage.write_json_durable(
            os.path.join(storage.step_dir(run_dir, step), storage.MANIFEST), {"previous": previous, "files": {}}
        )
    storage.set_latest(run_dir, 9)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "loss": 1.0, "time": T + s, "attempt": 0}) + "\n" for s in range(1, 30))
    append_event(run_dir, "submitted", job_id="424243")
    append_event(run_dir, "started", attempt=0, job_id="424243", nodes=["n1", "n2"])
    append_event(run_dir, "requeued", attempt=0, cause="failure", job_id="424243")
    assert driver.prologue(run_dir) == 0
    capsys.readouterr()
    started = [e for e in read_events(run_dir) if e["event"] == "started"][-1]
    assert started["resume_step"] == 9 and started["last_step"] == 29, started
