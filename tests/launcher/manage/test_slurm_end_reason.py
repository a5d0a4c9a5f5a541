"""Issue 46: `meshrun action=status` of a Slurm run whose job ended without meshrun recording an end (the whole job
cancelled with scancel, its batch script killed, a node failure) gives Slurm's accounting as the reason, never
none. Slurm's commands are stand-ins on PATH that answer as Slurm 22.05's do (the dev cluster's sacct printed
these lines: tests/slurm/test_kills_slurm.py runs the real ones)."""

from __future__ import annotations

import os

from launcher.manage.status import run_status
from training.contract.rundir.events import append_event


def _slurm(tmp_path, monkeypatch, sacct_lines):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/bash\nexit 0\n")  # the job left the queue
    calls = tmp_path / "sacct.calls"
    # -o JobID,State (the state query) or -o JobID,State,ExitCode,Reason (the end's reason).
    (bin_dir / "sacct").write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\nout=$(cat <<"EOF"\n' + "\n".join(sacct_lines) + "\nEOF\n)\n"
        'case " $* " in *ExitCode*) printf "%s\\n" "$out";; *) printf "%s\\n" "$out" | cut -d"|" -f1,2;; esac\n'
    )
    for name in ("squeue", "sacct"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def _run(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    append_event(run_dir, "submitted", job_id="41", excluded_nodes=[], attempt=0)
    append_event(run_dir, "started", job_id="41", nodes=["n1", "n2"], attempt=0)
    return run_dir


def test_a_job_cancelled_in_slurm_has_sacct_s_reason(tmp_path, monkeypatch):
    _slurm(
        tmp_path,
        monkeypatch,
        ["41|CANCELLED by 0|0:0|None", "41.batch|CANCELLED|0:15|", "41.extern|COMPLETED|0:0|", "41.0|CANCELLED|0:15|"],
    )
    status = run_status(_run(tmp_path))
    assert status["state"] == "CANCELLED", status
    assert status["reason"].startswith("Slurm ended job 41 as CANCELLED by 0, exit code 0"), status
    assert "batch script: CANCELLED, signal 15" in status["reason"] and "meshrun recorded no end" in status["reason"]


def test_a_killed_batch_script_is_named_by_its_signal(tmp_path, monkeypatch):
    _slurm(tmp_path, monkeypatch, ["41|FAILED|0:9|None", "41.batch|FAILED|0:9|", "41.0|CANCELLED|0:15|"])
    status = run_status(_run(tmp_path))
    assert status["state"] == "FAILED" and status["reason"].startswith("Slurm ended job 41 as FAILED, signal 9"), status
