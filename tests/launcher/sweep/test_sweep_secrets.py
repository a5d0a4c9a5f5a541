"""A secret given on a sweep's command line (+cluster.env.HF_TOKEN=...) never reaches a file anyone else reads
or the terminal: not sweep.json, multirun.yaml, point.json, config.json/yaml, submitit's pickles, nor the point
lines and the summary, with every Hydra launcher. Each point's run directory keeps the value in secrets.json
(0600), where its ranks read it, on Slurm too, and a later relaunch of the point resolves the placeholder
from there with no secret on its command line or in its environment.

Plans start no ranks: they run in this process through the console entry point (tests/helpers/cli.py), except
the sweeps under the joblib and submitit launchers (workers and jobs of their own: a real `python -m launcher`)
and the Slurm test's submissions."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import helpers.slurm as dev
import pytest
from helpers import ROOT
from helpers.cli import run_cli

from training.contract.rundir.secret_env import PLACEHOLDER

SECRET = "hf_sw33p-s3cr3t-4c2e"
OWN_PROCESSES = ("joblib", "submitit_local")  # launchers whose points run in processes they start
LAUNCHERS = {  # Hydra launchers: points in this process, in joblib workers, in submitit jobs
    "meshrun": [],
    "basic": ["hydra/sweeper=basic", "hydra/launcher=basic"],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    "submitit_local": ["hydra/launcher=submitit_local"],
}


def meshrun(*args, cwd):
    """A command that starts no rank, in this process."""
    return run_cli(*args, cwd=str(cwd))


def meshrun_subprocess(*args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
    )


def files_holding(root, value: str) -> list:
    """Every file under root whose bytes contain value."""
    found = []
    for dirpath, _, names in os.walk(str(root)):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    if value.encode() in f.read():
                        found.append(path)
            except OSError:
                pass
    return sorted(found)


def assert_only_in_secrets_files(root, run_dirs):
    """The value is in each run directory's secrets.json (0600, nothing else in it) and in no other file."""
    want = sorted(os.path.join(str(d), "secrets.json") for d in run_dirs)
    assert files_holding(root, SECRET) == want
    for path in want:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        assert json.load(open(path)) == {"HF_TOKEN": SECRET}


# Launchers that start worker processes are in the slow set (`make check` keeps the in-process ones).
@pytest.mark.parametrize(
    "launcher",
    [pytest.param(name, marks=[pytest.mark.slow] if name in OWN_PROCESSES else []) for name in LAUNCHERS],
)
def test_sweep_keeps_a_secret_out_of_its_files_and_output(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    p = (meshrun_subprocess if launcher in OWN_PROCESSES else meshrun)(
        "-m",
        "action=plan",
        f"+cluster.env.HF_TOKEN={SECRET}",
        "+cluster.env.NCCL_DEBUG=WARN",
        "parallel.tp=1,2",
        *LAUNCHERS[launcher],
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert SECRET not in p.stdout + p.stderr
    assert "sweep summary: 2 feasible" in p.stdout
    data = json.load(open(sweep / "sweep.json"))
    run_dirs = [pt["run_dir"] for pt in data["points"]]
    assert len(run_dirs) == 2
    assert_only_in_secrets_files(tmp_path, run_dirs)
    for pt in data["points"]:  # what each point was given, with the placeholder where the value was
        assert f"+cluster.env.HF_TOKEN='{PLACEHOLDER}'" in pt["overrides"], pt["overrides"]
        assert "+cluster.env.NCCL_DEBUG=WARN" in pt["overrides"]  # not a secret: kept as given
        env = json.load(open(os.path.join(pt["run_dir"], "config.json")))["cluster"]["env"]
        assert env == {"HF_TOKEN": PLACEHOLDER, "NCCL_DEBUG": "WARN"}


def test_single_run_resume_keeps_the_secret_given_before(tmp_path):
    """A plan with a secret, then the same run.dir planned again without it: secrets.json keeps the value;
    a new value given to a plan of the existing run is written nowhere."""
    run_dir = tmp_path / "run"
    p = meshrun("action=plan", f"+cluster.env.HF_TOKEN={SECRET}", f"run.dir={run_dir}", cwd=tmp_path)
    assert p.returncode == 0 and SECRET not in p.stdout + p.stderr, p.stderr[-3000:]
    assert_only_in_secrets_files(tmp_path, [run_dir])
    p = meshrun("action=plan", f"run.dir={run_dir}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_only_in_secrets_files(tmp_path, [run_dir])
    # A plan writes nothing into an existing run (launcher/launch/gate.py): a new value given to it goes nowhere.
    p = meshrun("action=plan", "+cluster.env.HF_TOKEN=other-value", f"run.dir={run_dir}", cwd=tmp_path)
    assert "other-value" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert json.load(open(run_dir / "secrets.json")) == {"HF_TOKEN": SECRET}
    assert files_holding(tmp_path, "other-value") == []


def test_a_swept_secret_is_refused(tmp_path):
    """Sweeping over secret values would name each value in the point's directory and overrides: exit 2."""
    p = meshrun(
        "-m", "action=plan", "+cluster.env.HF_TOKEN=aaa-1,bbb-2", f"hydra.sweep.dir={tmp_path / 's'}", cwd=tmp_path
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "cluster.env.HF_TOKEN" in p.stderr and "aaa-1" not in p.stdout + p.stderr
    assert not (tmp_path / "s").exists()


def test_slurm_sweep_dry_run_keeps_the_secret_out_of_the_job_arrays(tmp_path):
    """No cluster needed: the job arrays' batch scripts, printed, hold neither value nor placeholder; each
    point's secrets.json holds the value its array task's ranks will read."""
    sweep = tmp_path / "sweep"
    p = meshrun(
        "-m",
        "cluster=slurm_dev",
        "dry_run=true",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "cluster.cpus_per_task=1",
        "model=tiny",
        "data=synthetic",
        "parallel.tp=1",
        "parallel.zero=0",
        "parallel.global_batch=8",
        f"+cluster.env.WANDB_API_KEY={SECRET}",
        "parallel.micro_batch=1,2",
        "cluster.time_min=10,11",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("# job array of ") == 2
    assert SECRET not in p.stdout + p.stderr
    for script in p.stdout.split("# job array of ")[1:]:
        assert "WANDB_API_KEY" not in script.split("sweep summary")[0] and "#SBATCH --array=0-1%2" in script
    data = json.load(open(sweep / "sweep.json"))
    run_dirs = [pt["run_dir"] for pt in data["points"]]
    assert len(run_dirs) == 4
    want = sorted(os.path.join(d, "secrets.json") for d in run_dirs)
    assert files_holding(tmp_path, SECRET) == want
    assert all(json.load(open(w)) == {"WANDB_API_KEY": SECRET} for w in want)


# A rank reports whether it got the value, from a sitecustomize the ranks import (all fake nodes are this
# machine, and Slurm passes PYTHONPATH on with the submitter's environment).
PROBE = """import os, sys
if "training.main" in getattr(sys, "orig_argv", []) and os.environ.get("RANK") == "0":
    with open(os.path.join(os.environ["PROBE_DIR"], "probe-" + os.environ.get("SLURM_JOB_ID", "x")), "w") as f:
        f.write(repr(os.environ.get("HF_TOKEN")))
"""


@pytest.mark.slurm
def test_slurm_array_rank_reads_the_secret_and_a_relaunch_resolves_it(tmp_path, cluster, slurm_jobs):
    """A two-point sweep on the dev cluster (one job array): each task's rank gets HF_TOKEN from its point's
    secrets.json (the job's environment has no HF_TOKEN); then `meshrun run.dir=POINT train.steps=4` with
    no secret anywhere on its command line relaunches the point, and its rank gets the value
    again (from secrets.json alone: that command line gave no value)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(PROBE)
    probes = tmp_path / "probes"
    probes.mkdir()
    env = {"PYTHONPATH": f"{inject}{os.pathsep}{ROOT}", "PROBE_DIR": str(probes)}
    env_without = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    sweep = tmp_path / "sweep"
    common = [
        "cluster=slurm_dev",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "model=tiny",
        "data=synthetic",
        "parallel.tp=1",
        "parallel.sp=false",
        "parallel.zero=0",
        "parallel.global_batch=8",
        "train.checkpoint_every=2",
        "train.log_every=1",
    ]

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "launcher", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env_without, **env},
        )

    p = run(
        "-m",
        *common,
        "train.steps=2",
        f"+cluster.env.HF_TOKEN={SECRET}",
        "parallel.micro_batch=1,2",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = re.findall(r"submitted Slurm job (\d+)_\d+; run dir (\S+)", p.stdout)
    slurm_jobs.extend(sorted({job for job, _ in jobs}))
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(jobs) == 2 and len({job for job, _ in jobs}) == 1, p.stdout  # one job array, two tasks
    assert SECRET not in p.stdout + p.stderr
    for _, point in jobs:
        assert dev.wait_final(point)["state"] == "COMPLETED"
    got = [open(probes / f).read() for f in sorted(os.listdir(probes))]
    assert got == [repr(SECRET)] * 2, got
    point = jobs[0][1]
    p = run(f"run.dir={point}", "train.steps=4")  # the saved config (cluster=slurm_dev=... would replace it)
    job = re.search(r"submitted Slurm job (\d+)", p.stdout)
    slurm_jobs.extend([job.group(1)] if job else [])
    assert p.returncode == 0 and job, p.stdout[-2000:] + p.stderr[-3000:]
    assert dev.wait_final(point)["state"] == "COMPLETED"
    assert open(probes / f"probe-{job.group(1)}").read() == repr(SECRET)
    assert_only_in_secrets_files(sweep, [d for _, d in jobs])  # logs, events, checkpoints, batch scripts
