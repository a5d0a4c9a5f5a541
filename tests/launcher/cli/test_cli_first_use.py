"""A GPU user's first hour at the CLI: `meshrun --version` is meshrun's, Slurm jobs carry cluster.job_name and
cluster.comment (and sbatch_extra's job-name points there), and Ctrl-C while wait=true follows a job is one line
and exit 130 with the job left running."""

from __future__ import annotations

import os
import shlex
import signal
import threading
from importlib.metadata import version

import pytest
from helpers import ROOT
from helpers.cli import run_cli

from training.contract.exit_codes import EXIT_INTERRUPTED, EXIT_INVALID

DRY = ("cluster=slurm_dev", "dry_run=true", "model=tiny", "cluster.cpus_per_task=4")


def test_version_is_meshruns():
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"meshrun {version('meshrun')}"
    assert "Hydra" not in res.stdout + res.stderr


def test_job_name_and_comment_reach_sbatch(tmp_path):
    named = run_cli(*DRY, f"run.dir={tmp_path / 'a'}", "cluster.job_name=llama8b-first", "cluster.comment=ticket-42")
    assert named.returncode == 0, named.stderr
    assert "#SBATCH --job-name=llama8b-first\n" in named.stdout and "#SBATCH --comment=ticket-42\n" in named.stdout
    default = run_cli(*DRY, f"run.dir={tmp_path / 'my_run.1'}", cwd=ROOT)
    assert default.returncode == 0, default.stderr
    assert "#SBATCH --job-name=meshrun-my_run.1\n" in default.stdout and "--comment" not in default.stdout
    from launcher.slurm.sbatch import default_job_name

    assert default_job_name("runs/a:b$c/") == "meshrun-a-b-c"  # what a job name keeps plainly


@pytest.mark.parametrize(
    "override,message",
    [
        ("+cluster.sbatch_extra.job-name=mine", "use cluster.job_name=mine instead"),
        ("+cluster.sbatch_extra.comment=x", "use cluster.comment=x instead"),
        ("+cluster.sbatch_extra.time=1:00:00", "use cluster.time_min instead (minutes)"),
        ("+cluster.sbatch_extra.output=x", "remove it"),
        ("cluster.job_name='a b'", "cluster.job_name='a b' contains characters"),
        ("cluster.comment=50%", "cluster.comment='50%' contains characters"),
    ],
)
def test_refused_names_say_what_to_type(override, message, tmp_path):
    res = run_cli(*DRY, f"run.dir={tmp_path / 'r'}", override, cwd=ROOT)
    assert res.returncode == EXIT_INVALID and message in res.stderr, res.stderr
    assert not os.path.exists(tmp_path / "r" / "submitit")


def test_ctrl_c_while_following_is_one_line_and_130(monkeypatch, capsys, tmp_path):
    """The real follow loop (launcher/manage/follow.py) on a job that stays RUNNING; a real SIGINT arrives while it
    polls (were it not caught, the test would end in KeyboardInterrupt, not SystemExit). The job is Slurm's: nothing is cancelled (no scancel is called), and the line names both commands."""
    import launcher.manage.follow as follow
    import launcher.manage.status as status

    run_dir = str(tmp_path / "run dir")
    polled = threading.Event()

    def running(_run_dir):
        polled.set()
        return {"state": "RUNNING", "job_id": "4242", "last_step": 3}

    monkeypatch.setattr(status, "run_status", running)
    monkeypatch.setattr(follow, "cancel_job", lambda *a, **k: pytest.fail("following must not cancel"), raising=False)
    timer = threading.Thread(target=lambda: polled.wait(10) and os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(SystemExit) as stop:
        follow.follow_or_detach(run_dir, "4242", poll_s=0.05)  # what follow_run runs after submit() with wait=true
    timer.join()
    assert stop.value.code == EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "job 4242 keeps running" in err[0]
    assert f"meshrun action=logs run.dir='{run_dir}' logs.follow=true" in err[0]
    assert f"meshrun action=cancel run.dir='{run_dir}'" in err[0]


def test_spare_nodes_alone_are_not_refused(tmp_path):
    """cluster.spare_nodes=1 with max_in_job_restarts left at 0: the job asks for the spare and restarts in-job
    (--no-kill, the batch loop) instead of exit 2."""
    res = run_cli(*DRY, "cluster.nodes=2", "cluster.spare_nodes=1", f"run.dir={tmp_path / 'r'}", cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --nodes=3\n" in res.stdout and "#SBATCH --no-kill\n" in res.stdout


@pytest.mark.parametrize(
    "args,said,fixed",
    [
        (["plan", "model=tiny"], "did you mean action=plan?", ["action=plan", "model=tiny"]),
        (["action=plna"], "did you mean plan?", ["action=plan"]),
        (["action=plan", "model=tiny-moe"], "did you mean tiny_moe?", ["action=plan", "model=tiny_moe"]),
        (["action=plan", "parallel.cp_comm=allgather"], "did you mean all_gather?", None),
        (["-m", "action=plan", "parallel.schedule=gpipe,1f1bb"], "did you mean 1f1b?", None),
        (["action=plan", "model=nothing_like_it"], "expected one of [gpt2_125m,", ["--help"]),
        (["action=plan", "parallel.tpp=1"], "did you mean parallel.tp?", ["action=plan", "parallel.tp=1"]),
        (["action=plan", "+parallel.tpp=1"], "did you mean parallel.tp?", ["action=plan", "parallel.tp=1"]),
    ],
)
def test_meshrun_speaks_first_and_alone_with_a_typeable_fix(args, said, fixed, tmp_path):
    """Bare words, unknown actions, presets and near-miss values: meshrun's message, not Hydra's grammar or search
    path; the `fix:` line is a command that runs (exit 0)."""
    res = run_cli(*args, f"run.dir={tmp_path / 'r'}", cwd=str(tmp_path))
    assert res.returncode == EXIT_INVALID and said in res.stderr, res.stderr
    assert not (tmp_path / "r").exists()  # nothing written
    for hydra_speaks in ("missing EQUAL", "HYDRA_FULL_ERROR", "provider=", "Traceback"):
        assert hydra_speaks not in res.stderr
    fix = [line for line in res.stderr.splitlines() if line.startswith("fix: meshrun ")]
    assert len(fix) == 1, res.stderr
    words = shlex.split(fix[0][len("fix: meshrun ") :])
    if fixed is not None:
        assert words[: len(fixed)] == fixed
    again = run_cli(*words, cwd=str(tmp_path))
    assert again.returncode == 0, again.stderr


def test_own_presets_are_left_to_hydra(tmp_path):
    """A preset from --config-dir is not in the packaged list: no did-you-mean, it composes."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "team_tiny.yaml").write_text("defaults:\n  - tiny\n  - _self_\nname: team_tiny\n")
    res = run_cli("--config-dir", str(tmp_path / "conf"), "action=plan", "model=team_tiny", cwd=str(tmp_path))
    assert "did you mean" not in res.stderr


def test_a_missing_dataset_names_the_command_that_makes_it(tmp_path):
    prefix = str(tmp_path / "corpus")
    res = run_cli("action=plan", "data=indexed", f"data.prefixes=[{prefix}]", f"run.dir={tmp_path / 'r'}", cwd=ROOT)
    assert res.returncode == EXIT_INVALID, res.stderr
    assert f"fix: meshrun action=prepare prepare.output={prefix} " in res.stderr
    assert "see the message" not in res.stderr


@pytest.mark.slow  # a local training run (one process, 3 steps)
def test_plan_only_leaves_latest_and_runs_lists_every_run(tmp_path):
    """A plan, then a dry run, leave runs/latest alone (it names launched runs only); action=runs lists the
    folder newest first with its state, step/total, loss and job id (a 3-step run trained here, on one process)."""
    import json

    tiny = ["model.num_layers=1", "parallel=single", "cluster.gpus_per_node=1", "data=synthetic", "train.steps=3"]
    plan = run_cli("action=plan", *tiny, cwd=str(tmp_path))
    assert plan.returncode == 0, plan.stderr
    assert not os.path.lexists(tmp_path / "runs" / "latest")
    assert os.listdir(tmp_path / "runs") == [".plans"]  # a plan without run.dir is not a run
    planned = "planned"
    named = run_cli("action=plan", *tiny, "run.dir=runs/planned", cwd=str(tmp_path))
    assert named.returncode == 0, named.stderr
    empty = run_cli("action=runs", "runs.dir=nowhere", cwd=str(tmp_path))
    assert empty.returncode == 0 and "no runs in nowhere yet" in empty.stdout
    (tmp_path / "afile").write_text("")
    wrong = run_cli("action=runs", "runs.dir=afile", cwd=str(tmp_path))
    assert wrong.returncode == EXIT_INVALID and "fix: meshrun action=runs runs.dir=runs" in wrong.stderr
    import subprocess
    import sys

    trained = subprocess.run(
        [sys.executable, "-m", "launcher", *tiny, "train.tensorboard=false"],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "] 3/3 loss " in trained.stderr and "\r" not in trained.stderr  # rank 0 shown, plain, off a terminal
    (ran,) = [d for d in os.listdir(tmp_path / "runs") if d not in (planned, "latest", ".plans")]
    assert os.readlink(tmp_path / "runs" / "latest") == ran
    listing = run_cli("action=runs", cwd=str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    head, first, second = listing.stdout.splitlines()
    assert head.split() == ["state", "step", "loss", "job", "age", "run"]
    loss = [json.loads(line) for line in open(tmp_path / "runs" / ran / "metrics.jsonl") if '"loss"' in line][-1]
    assert first.split()[:4] == ["COMPLETED", "3/3", f"{loss['loss']:.4f}", "local"]
    assert first.split()[-1] == os.path.join("runs", ran)
    assert second.split()[:2] == ["PLANNED", "-/3"] and second.split()[-1] == os.path.join("runs", planned)


@pytest.mark.slow  # a local training run under a pseudo-terminal
def test_progress_is_redrawn_in_place_on_a_terminal_and_plain_in_the_log(tmp_path):
    """meshrun on a terminal (a pty), 40 steps on one process: rank 0's bar is redrawn in place (a carriage return
    before each redraw) at least 10 times before the end, and the run's log holds the same as plain lines."""
    import pty
    import select
    import subprocess
    import sys
    import time

    main, child = pty.openpty()
    args = ["model.num_layers=1", "parallel=single", "cluster.gpus_per_node=1", "data=synthetic", "train.steps=40"]
    args.append("train.eval_every=20")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", *args, "train.tensorboard=false", f"run.dir={tmp_path / 'run'}"],
        cwd=str(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=child,
        stderr=child,
    )
    os.close(child)
    seen = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child side closed: the run has ended
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    assert proc.wait(timeout=60) == 0, seen[-3000:].decode("utf-8", "replace")
    redraws = [part for part in seen.split(b"\r") if part.startswith(b"[")]
    assert len(redraws) >= 10 and b" 40/40 " in redraws[-1], seen[-2000:]
    assert any(b" 20/40 " in part for part in redraws)  # mid-run, not only at the end
    assert seen.index(b"step 20: eval loss ") < seen.index(b" 30/40 ")  # the evaluation shows when it happens
    log = (tmp_path / "run" / "logs" / "rank_0.log").read_bytes()
    assert b"\r" not in log and log.count(b"/40 ") >= 10
