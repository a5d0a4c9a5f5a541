"""A cancel mark (run.dir/cancel.json, launcher/manage/cancel.py) applies to the launch it was written in: a mark older
than the latest launch of the directory is stale and stops nothing; one written while an attempt waited in the
queue stops that attempt in the Slurm prologue (launcher/slurm/driver.py), run here in-process on real files."""

from __future__ import annotations

import json
import os

import pytest

from launcher.manage.cancel import write_mark
from launcher.records.readers import cancel_requested, cancelled_event
from launcher.slurm import driver
from training.contract.config import Config, config_to_dict
from training.contract.rundir.events import append_event, read_events
from training.contract.rundir.paths import CANCEL_FILE


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_to_dict(Config())))
    monkeypatch.setenv("SLURM_JOB_ID", "424242")  # a job id no queue holds: stop_time asks Slurm, finds none
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return str(d)


def test_a_mark_older_than_the_latest_launch_is_stale(run_dir, capsys):
    append_event(run_dir, "submitted", job_id="424241")
    old = write_mark(run_dir)  # cancels the first launch ...
    append_event(run_dir, "submitted", job_id="424242")  # ... a new launch of the directory comes after it
    assert os.path.exists(os.path.join(run_dir, CANCEL_FILE)) and cancel_requested(run_dir) is None
    assert driver.prologue(run_dir) == 0
    out = capsys.readouterr()
    assert "export MESHRUN_ATTEMPT=0" in out.out and "cancelled" not in out.err  # the attempt starts
    events = read_events(run_dir)
    assert [e["event"] for e in events][-1] == "started" and cancelled_event(events) is None
    assert old["time"] < max(e["time"] for e in events if e["event"] == "submitted")


def test_a_mark_written_while_the_attempt_was_queued_stops_it(run_dir, capsys):
    append_event(run_dir, "submitted", job_id="424242")
    append_event(run_dir, "started", attempt=0, job_id="424242")  # an earlier attempt of this launch (no launcher_pid)
    mark = write_mark(run_dir)
    assert cancel_requested(run_dir) == mark  # a Slurm attempt's start is no new launch: the mark holds
    assert driver.prologue(run_dir) == 0
    out = capsys.readouterr()
    assert "export MESHRUN_ATTEMPT" not in out.out and out.out.strip().endswith("exit 0")
    assert "cancelled (meshrun action=cancel)" in out.err
    ev = cancelled_event(read_events(run_dir))
    assert ev is not None and "before this attempt started" in ev["reason"]


def test_a_local_launchers_start_makes_an_older_mark_stale(run_dir):
    write_mark(run_dir)
    assert cancel_requested(run_dir) is not None  # no launch recorded yet: the mark holds
    append_event(run_dir, "started", attempt=0, launcher_pid=os.getpid())
    assert cancel_requested(run_dir) is None
