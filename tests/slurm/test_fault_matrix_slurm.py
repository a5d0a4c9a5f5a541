"""Fault-and-abuse matrix, launcher and Slurm half: one test per scenario, each asserting what is
lost (nothing beyond the last checkpoint), what is written, the exit code and the message.

Pure tests run everywhere; local runs spawn real ranks (marked slow); Slurm scenarios run on the real dev
cluster (tests/slurm/test_slurm_cluster.py's fixtures) and are skipped with the reason when it cannot run here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import helpers.slurm as dev
import pytest
from helpers.cli import run_cli
from helpers.slurm import COMMON, ROOT, dev_cfg, meshrun, metrics, submit, wait_final, wait_step

from launcher.records.readers import RETRY_CAUSES, retries_used
from launcher.slurm.requeue import decide
from launcher.slurm.sbatch import SlurmConfigError, array_job_spec, job_spec, sbatch_text, validate_for_slurm
from training.contract import slurm_env
from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from training.contract.rundir.events import read_events
from training.contract.rundir.lock import read_holder
from training.contract.rundir.paths import LOCK_FILE
from training.contract.rundir.secret_env import PLACEHOLDER

PY = sys.executable
LOCAL = [
    "model=tiny",
    "data=synthetic",
    "parallel=single",
    "cluster.gpus_per_node=1",
    "train.progress=false",
    "train.warmup_steps=1",
    "train.log_every=1",
]


def local(run_dir, *overrides, env=None, timeout=180):
    return meshrun(*LOCAL, f"run.dir={run_dir}", *overrides, env=env, timeout=timeout)


def local_cli(run_dir, *overrides):
    """`local` inside this process (tests/helpers/cli.py run_cli), for commands that start no ranks."""
    return run_cli(*LOCAL, f"run.dir={run_dir}", *overrides, cwd=ROOT)


def all_bytes(root) -> bytes:
    """Every file under root, concatenated (to look for a value that must not be there)."""
    out = b""
    for dirpath, _, files in os.walk(str(root)):
        for name in files:
            try:
                out += open(os.path.join(dirpath, name), "rb").read()
            except OSError:
                pass
    return out


# ------------------------------------------------------------------------------- 10: node lists
HOSTLISTS = [
    "rack[1-2]-node[01-02]",
    "n[1-3]",
    "a[01-02,05],b7",
    "n[9-11]",
    "n[001-2]",
    "n1[0-1]",
    "gpu-[1-2]-[3-4]",
    "a,b,c",
    "n[1-2],",
]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol to compare against")
@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_node_lists_expand_exactly_as_slurm_does(hostlist):
    """`scontrol show hostnames` parses locally (no controller needed): the parser must agree with it."""
    want = subprocess.run(
        ["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=20
    ).stdout.split()
    assert slurm_env.expand_hostlist(hostlist) == want
    assert slurm_env.first_host(hostlist) == want[0]


def test_node_lists_slurm_refuses_are_errors_not_guesses():
    for bad in ("x[8-11]y", "n[10-8]", "n[1-2"):
        with pytest.raises(ValueError):
            slurm_env.expand_hostlist(bad)


# ------------------------------------------------------------------------------- 4: the sbatch script
def _payloads(canary):
    # With and without blanks (${IFS} stands in for one: paths with blanks are refused on Slurm).
    return [
        f"x\ntouch {canary}",
        f"x\n#SBATCH --wrap=touch {canary}",
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"x'; touch {canary}; '",
        f'x"; touch {canary}; "',
        f"x\r\ntouch {canary}",
        f"$(touch${{IFS}}{canary})",
        f"`touch${{IFS}}{canary}`",
        f"x';touch${{IFS}}{canary};'",
        f'x";touch${{IFS}}{canary};"',
        f"x\ntouch${{IFS}}{canary}",
    ]


def _fields():
    """Every config value that reaches the batch script, with how to set it on a Config."""

    def cl(name):
        return lambda cfg, v: setattr(cfg.cluster, name, v)

    return {
        "partition": cl("partition"),
        "account": cl("account"),
        "qos": cl("qos"),
        "exclude": cl("exclude"),
        "mem": cl("mem"),
        "sbatch_extra.value": lambda cfg, v: cfg.cluster.sbatch_extra.update(constraint=v),
        "sbatch_extra.key": lambda cfg, v: cfg.cluster.sbatch_extra.update({v: "1"}),
        "env.value": lambda cfg, v: cfg.cluster.env.update(MESHRUN_PROBE=v),
        "env.name": lambda cfg, v: cfg.cluster.env.update({v: "1"}),
        "container.image": lambda cfg, v: setattr(cfg.cluster.container, "image", v),
        "container.mounts": lambda cfg, v: (
            setattr(cfg.cluster.container, "image", "img.sqsh"),
            setattr(cfg.cluster.container, "mounts", [v]),
        ),
        "run.dir": lambda cfg, v: setattr(cfg.run, "dir", v),
    }


def _stubs(tmp_path):
    """srun/sbatch/squeue/scontrol/sacct on PATH that only record their arguments (a canary of their own); the
    warm agents' srun step (started in the background before the prologue) records into srun.warm.args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "sbatch", "squeue", "scontrol", "sacct", "sinfo"):
        path = bin_dir / name
        path.write_text(
            f'#!/bin/bash\nout="{tmp_path}/{name}.args"; case " $* " in *" --job-name=meshrun-warm "*) '
            f'out="{tmp_path}/{name}.warm.args";; esac\nprintf "%s\\n" "$@" > "$out"\n'
            f'printf %s "$MESHRUN_PROBE" > "{tmp_path}/{name}.probe"\n'
            f'for v in ${{!MESHRUN_PROBE_@}}; do printf %s "${{!v}}" > "{tmp_path}/{name}.probe_${{v#MESHRUN_PROBE_}}"; done\n'
            "exit 0\n"
        )
        path.chmod(0o755)
    return str(bin_dir)


def _run_script_up_to_srun(cfg, run_dir, tmp_path):
    """The whole generated batch script, executed by bash up to and including srun (a stub); the teardown
    is cut. The prologue runs for real on run_dir."""
    from training.contract.rundir.config_files import write_config

    os.makedirs(run_dir, exist_ok=True)
    write_config(cfg, run_dir)
    script = sbatch_text(job_spec(cfg, run_dir))
    script = script.split("\n# teardown")[0]
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {**os.environ, "PATH": _stubs(tmp_path) + os.pathsep + os.environ["PATH"]}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)


@pytest.mark.parametrize("field", sorted(_fields()))
def test_hostile_values_in_the_batch_script_run_no_command(field, tmp_path):
    """Every value that reaches the batch script, with newline, quote and substitution payloads: either
    rejected by the checks (exit 2 through meshrun) or carried verbatim; the executed script never runs
    the canary, whichever it is."""
    set_value = _fields()[field]
    accepted = []
    for i, payload in enumerate(_payloads(tmp_path / "pwned")):
        cfg = dev_cfg()
        cfg.run.dir = str(tmp_path / f"run{i}")
        set_value(cfg, payload if field != "run.dir" else str(tmp_path / f"run{i}{payload}"))
        if validate_for_slurm(cfg):
            with pytest.raises(SlurmConfigError):
                job_spec(cfg, cfg.run.dir)
            continue
        accepted.append(payload)
        if field == "env.value":
            continue  # every accepted value goes into one script below (one prologue run, not one per value)
        res = _run_script_up_to_srun(cfg, cfg.run.dir, tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        assert (tmp_path / "srun.args").exists(), "the script did not reach srun"
        if field == "run.dir":
            assert f"--output\n{cfg.run.dir}/submitit/%j_%t_log.out" in (tmp_path / "srun.args").read_text()
        (tmp_path / "srun.args").unlink()
        assert not (tmp_path / "pwned").exists(), (field, payload)
    if field == "env.value" and accepted:  # each accepted value in a variable of its own, one script for all
        cfg = dev_cfg()
        cfg.run.dir = str(tmp_path / "run_env")
        cfg.cluster.env.update({f"MESHRUN_PROBE_{i}": v for i, v in enumerate(accepted)})
        assert not validate_for_slurm(cfg)
        res = _run_script_up_to_srun(cfg, cfg.run.dir, tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        assert (tmp_path / "srun.args").exists(), "the script did not reach srun"
        for i, payload in enumerate(accepted):
            assert (tmp_path / f"srun.probe_{i}").read_text() == payload  # arrived verbatim
    assert not (tmp_path / "pwned").exists()
    # Slurm names never carry these characters: refused. Env values and paths are quoted and carried instead.
    assert (len(accepted) > 0) == (field in ("env.value", "run.dir")), accepted


def test_newline_at_the_end_of_a_value_is_rejected():
    """re.match's `$` matches before a trailing newline: every check must see the whole string."""
    for name in ("partition", "account", "qos", "exclude"):
        cfg = dev_cfg(**{name: "debug\n"})
        assert any(f"cluster.{name}" in e for e in validate_for_slurm(cfg)), name
    assert validate_for_slurm(dev_cfg(mem="64G\n"))
    assert validate_for_slurm(dev_cfg(env={"A\n": "1"}))


def test_run_and_sweep_dirs_with_control_characters_exit_2(tmp_path):
    for key, value in (("run.dir", f"'{tmp_path}/a\tb'"), ("hydra.sweep.dir", f"'{tmp_path}/s\x1bx'")):
        args = ["-m", "action=plan", "parallel.tp=1,2"] if key.startswith("hydra") else ["action=plan"]
        res = run_cli(*args, f"{key}={value}", cwd=str(tmp_path))  # in this process: the same cli()
        assert res.returncode == EXIT_INVALID and "control character" in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []  # nothing created


def test_array_of_hostile_run_dirs_selects_each_verbatim(tmp_path):
    dirs = [str(tmp_path / name) for name in ("p$(touch pwned)0", "p`touch pwned`1", "p'2")]
    spec = array_job_spec(dev_cfg(), dirs, str(tmp_path / "submitit"))
    setup = "\n".join(line for line in spec.parameters["setup"] if "prologue" not in line)
    path = tmp_path / "s.sh"
    path.write_text(setup + '\nprintf %s "$MESHRUN_RUN_DIR" > "$0.$SLURM_ARRAY_TASK_ID"')
    for task in range(3):
        subprocess.run(
            ["bash", str(path)], check=True, cwd=str(tmp_path), env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task)}
        )
        assert (tmp_path / f"s.sh.{task}").read_text() == dirs[task]
    assert not (tmp_path / "pwned").exists()


def test_failing_prologue_stops_the_job_before_srun_with_a_message(tmp_path):
    """A prologue that fails (here: run_dir has no config.json) ends the attempt before srun, exit 1,
    and says so; `eval "$(...)" || exit 1` saw eval's status, 0, and went on to srun."""
    cfg = dev_cfg()
    run_dir = str(tmp_path / "run")
    cfg.run.dir = run_dir
    os.makedirs(run_dir)
    script = sbatch_text(job_spec(cfg, run_dir)).split("\n# teardown")[0]
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(
        ["bash", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": _stubs(tmp_path) + os.pathsep + os.environ["PATH"]},
    )
    assert res.returncode == EXIT_FAILED
    assert "the prologue failed" in res.stderr and "config.json" in res.stderr
    assert not (tmp_path / "srun.args").exists()


def test_slurm_commands_time_out(tmp_path, monkeypatch):
    """A controller that never answers: squeue (slurm_command) and sbatch (submitit, through `timeout`) give
    up after their timeout with a clear error instead of hanging meshrun."""
    from launcher.slurm import submit as submit_mod

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sbatch"):
        (bin_dir / name).write_text("#!/bin/bash\nsleep 600\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    t0 = time.time()
    with pytest.raises(slurm_env.SlurmUnavailable, match="did not answer in 1 s"):
        slurm_env.slurm_command(["squeue"], timeout=1)
    monkeypatch.setattr(submit_mod, "SBATCH_TIMEOUT_S", 1)
    cfg = dev_cfg()
    with pytest.raises(slurm_env.SlurmUnavailable, match="did not answer within 1 s"):
        submit_mod.submit_job(cfg, str(tmp_path / "run"))
    assert time.time() - t0 < 30


# ------------------------------------------------------------------------------- 8, 11, 1: requeue decisions
LAYOUT = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
ARGS = dict(
    world_size=4,
    rank_nodes=LAYOUT,
    progressed=True,
    retries_used=0,
    max_retries=2,
    excluded=[],
    partition_nodes=["n1", "n2", "n3"],
    nodes_needed=2,
)


def rec(rank, code, error="", cause="", ended=0.0):
    return {"rank": rank, "node": LAYOUT[rank], "exit_code": code, "error": error, "cause": cause, "ended": ended}


def test_the_rank_killed_by_a_signal_is_the_cause_not_the_peer_whose_collective_error_came_first():
    """Issue 46 item 1, as the dev cluster showed it after a preemption requeue: rank 3 (n2) was SIGKILLed, and
    rank 1's gloo "Connection closed by peer" record ended first (a warm-started rank's end comes back through its
    agent, later than the peer's). The cause is rank 3, killed by SIGKILL, and its node is excluded; rank 1's
    error is a consequence. Before, rank 1 was blamed as the program's and no node was excluded."""
    from launcher.slurm.requeue import decide

    records = [
        rec(
            1,
            1,
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
            "exception",
            1.0,
        ),
        rec(0, -15, "", "", 1.5),
        rec(3, -9, "return func(*args, **kwargs)", "", 2.0),
        rec(2, -15, "", "", 2.2),
    ]
    d = decide(records, **ARGS)
    assert [f.rank for f in d.failures] == [3] and d.exclude == ["n2"], d
    assert d.failures[0].reason.startswith("killed by SIGKILL"), d.failures[0].reason
    # No signal death: the first rank with an error of its own, not a peer's consequence.
    records = [
        rec(1, 1, "RuntimeError: Connection closed by peer", "exception", 1.0),
        rec(2, 1, "ValueError: bad batch", "exception", 2.0),
    ]
    d = decide(records, **ARGS)
    assert [f.rank for f in d.failures] == [2] and d.exclude == [], d
    # A rank that exits 1 without a message still has a reason, never an empty one.
    d = decide([rec(2, 1, "", "", 1.0)], **ARGS)
    assert d.failures[0].reason, d


def test_the_failed_event_lists_the_peers_errors_as_consequences():
    """Issue 46: the decision names the other failed ranks (a peer's collective error, srun's SIGTERM) as
    consequences, for the `failed` event; a rank that finished or stopped is none."""
    records = [
        rec(1, 1, "RuntimeError: Connection closed by peer", "exception", 1.0),
        rec(0, -15, "", "", 1.5),
        rec(3, -9, "", "", 2.0),
        rec(2, 3, "", "", 2.2),
    ]
    d = decide(records, **ARGS)
    assert [f.rank for f in d.failures] == [3] and d.consequences == [0, 1], d
    d = decide([rec(2, 1, "ValueError: bad batch", "exception", 1.0)] + [rec(r, 3) for r in (0, 1, 3)], **ARGS)
    assert [f.rank for f in d.failures] == [2] and d.consequences == [], d


def test_a_failure_reason_is_the_exception_line_never_a_wrappers_frame():
    """Issue 46 item 4: the `failed` event of a SIGKILLed rank carried `return func(*args, **kwargs)`, a frame of
    a traceback its log printed earlier. The reason is the exception's type and message, or nothing."""
    from launcher.ranks.exits import last_error_line

    log = (
        "step 3 loss 5.1\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in wrapper\n    return func(*args, **kwargs)\n'
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited\n"
        '  File "y.py", line 9, in f\n    return func(*args, **kwargs)\n'
    )
    assert last_error_line(log).startswith("torch.distributed.DistBackendError: NCCL error"), last_error_line(log)
    assert last_error_line("step 1\nstep 2\n    return func(*args, **kwargs)\n") == ""
    assert last_error_line("error: cannot read config.json\n") == "error: cannot read config.json"


def test_lost_node_is_excluded_not_the_first_survivor_to_report():
    """n2 vanished (no record from either of its ranks); n1's ranks then failed in a collective. Before,
    the first survivor's node (n1) was excluded."""
    survivors = [
        rec(0, 1, "RuntimeError: Connection closed by peer", "exception", 3.0),
        rec(1, 1, "RuntimeError: Connection closed by peer", "exception", 4.0),
    ]
    d = decide(survivors, **ARGS)
    assert d.action == "resubmit" and d.exclude == ["n2"] and {f.rank for f in d.failures} == {2, 3}
    assert all(f.node == "n2" and f.exit_code is None for f in d.failures)


def test_lost_node_is_excluded_when_srun_killed_the_survivors():
    """n2 vanished; srun (--kill-on-bad-exit) then sent SIGTERM to n1's ranks before their collectives failed:
    that is the consequence, the vanished node is still the one excluded (the race the dev-cluster test below
    hits). A SIGKILL stays evidence against its own node."""
    survivors = [rec(0, -15, "", "", 3.0), rec(1, -15, "", "", 4.0)]
    d = decide(survivors, **ARGS)
    assert d.action == "resubmit" and d.exclude == ["n2"] and {f.rank for f in d.failures} == {2, 3}


def test_exception_on_one_rank_excludes_no_healthy_node():
    """A rank that raised (exit 1: a configuration problem, a bug) says nothing against its node."""
    # srun (--kill-on-bad-exit) then killed the others: they ended later.
    d = decide(
        [rec(2, 1, "ValueError: bad value in config", "exception", 1.0)]
        + [rec(r, -15, "", "", 2.0) for r in (0, 1, 3)],
        **ARGS,
    )
    assert d.action == "resubmit" and d.exclude == [] and "no node excluded" in d.note
    d = decide([rec(2, 1, "RuntimeError: CUDA error: uncorrectable ECC error encountered", "exception", 1.0)], **ARGS)
    assert d.exclude == ["n2"]  # hardware named: the node goes


def test_failed_save_requeues_from_the_previous_checkpoint_with_its_whole_message():
    msg = (
        "saving checkpoint step_4 in /x/checkpoints failed: OSError: [Errno 28] No space left on device "
        + "p" * 600
        + " (no space left: free space under run.dir or point run.dir at a larger filesystem); the previous "
        "checkpoint (step_2) is untouched"
    )
    records = [rec(r, 1, msg, "save_failed") for r in range(4)]
    d = decide(records, **ARGS)
    assert d.action == "requeue" and d.cause == "save_failed" and d.exclude == []
    assert "no space left: free space under run.dir" in d.reason  # not cut
    d = decide(records, **{**ARGS, "retries_used": 2})
    assert d.action == "stop" and "max_retries=2" in d.reason and "No space left" in d.reason


def test_stop_without_a_new_checkpoint_costs_a_retry():
    stopped = [rec(r, 3) for r in range(4)]
    assert decide(stopped, **ARGS, saved=True).cause == "stopped_early"
    d = decide(stopped, **ARGS, saved=False)
    assert d.action == "requeue" and d.cause == "no_progress"
    d = decide(stopped, **{**ARGS, "retries_used": 2}, saved=False)
    assert d.action == "stop" and "retries exhausted" in d.reason
    events = [{"event": "requeued", "cause": c} for c in ("stopped_early", "no_progress", "save_failed", "failure")]
    assert retries_used(events) == 3 and set(RETRY_CAUSES) == {"failure", "no_progress", "save_failed"}


# ------------------------------------------------------------------------------- 3: one owner per run dir
@pytest.mark.slow
def test_second_launch_on_a_running_run_dir_exits_2_and_a_dead_holder_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    # Its rank waits before step 4 (never released: it is killed), so it is still running however fast steps are;
    # the wait outlasts the stop signal the launcher's death sends its ranks, so they hold the lock until killed.
    hold = dev.hold_env(tmp_path, through_signals=True)
    first = subprocess.Popen(
        [PY, "-m", "launcher", *LOCAL, f"run.dir={run_dir}", "train.steps=400", "train.checkpoint_every=0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **hold},
    )
    try:
        deadline = time.time() + 120
        # Step 3 logged: the ranks are in the hold (before step 4), where the launcher's death finds them; a kill
        # at step 1 or 2 would let them stop at the next step on its signal and free the lock.
        while 3 not in metrics(run_dir, last_wins=True):
            assert time.time() < deadline and first.poll() is None, "the first run did not reach its hold"
            time.sleep(0.2)
        before = {n: os.path.getmtime(run_dir / n) for n in ("config.json", "plan.json")}
        events_before = (run_dir / "events.jsonl").read_bytes()
        # The later launches run in this process (tests/helpers/cli.py: the same cli()); the holder is the
        # other process, so the lock's cross-process refusal is what they meet.
        res = local_cli(run_dir, "train.steps=8", "train.lr=0.5")
        assert res.returncode == EXIT_INVALID, res.stderr[-2000:]
        assert f"is in use by pid {first.pid}" in res.stderr and "Nothing was written" in res.stderr
        assert {n: os.path.getmtime(run_dir / n) for n in before} == before  # nothing rewritten
        assert (run_dir / "events.jsonl").read_bytes().startswith(events_before)
        assert json.load(open(run_dir / "config.json"))["train"]["lr"] != 0.5
        # The launcher dies without a word (kill -9); its ranks still hold the lock until they are gone.
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        res = local_cli(run_dir, "action=plan")
        assert res.returncode == EXIT_INVALID and "in use" in res.stderr
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # The ranks run in sessions of their own (launcher/launch/local.py) and wait in the hold through signals:
        # kill them too, found by the run directory on their command line.
        _kill_ranks_of(run_dir)
    deadline = time.time() + 30
    while True:  # the ranks' exit releases the kernel lock
        res = local_cli(run_dir, "action=plan")
        if res.returncode == EXIT_OK or time.time() > deadline:
            break
        time.sleep(0.5)
    assert res.returncode == EXIT_OK, res.stderr[-2000:]
    taken = [e for e in read_events(str(run_dir)) if e["event"] == "lock_taken_over"]
    assert len(taken) == 1 and f"pid {first.pid}" in taken[0]["previous_holder"]
    assert read_holder(str(run_dir)).get("released")


def _kill_ranks_of(run_dir) -> None:
    """SIGKILL every `training.main RUN_DIR` process of this run directory."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"training.main" in argv and str(run_dir).encode() in argv:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


FROZEN_CLOCK = '''import datetime
_real = datetime.datetime


class _Frozen(_real):
    """Every launch reads the same wall-clock instant, to the microsecond."""

    @classmethod
    def now(cls, tz=None):
        return _real(2026, 1, 2, 3, 4, 5, 7, tzinfo=tz)


datetime.datetime = _Frozen
'''


def test_default_run_dirs_differ_for_launches_in_the_same_second(tmp_path):
    """Both launches read the same instant (a frozen clock in each, to the microsecond): the run directories
    still differ, by the launches' pids."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FROZEN_CLOCK)
    env = {**os.environ, "PYTHONPATH": str(inject)}
    meshrun_bin = os.path.join(os.path.dirname(PY), "meshrun")
    procs = [
        subprocess.Popen(
            [meshrun_bin, "action=plan"],
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    # plan-only actions write under runs/.plans (action=runs lists no plan as a run) and never move runs/latest
    assert sorted(os.listdir(tmp_path / "runs")) == [".plans"]
    plans = tmp_path / "runs" / ".plans"
    dirs = sorted(os.listdir(plans))
    assert dirs == sorted(f"2026-01-02_03-04-05-000007-{p.pid}" for p in procs), dirs
    for d in dirs:
        assert os.path.exists(plans / d / "plan.json")
        assert not os.path.exists(plans / d / LOCK_FILE) or read_holder(str(plans / d))["released"]


# ------------------------------------------------------------------------------- 9: secrets
SECRET = "s3cr3t-value-7f1d"
PROBE = """import os, sys
if "training.main" in getattr(sys, "orig_argv", []) and os.environ.get("RANK") == "0":
    with open(os.path.join(os.environ["PROBE_DIR"], "probe"), "w") as f:
        f.write(str(os.environ.get("HF_TOKEN") == os.environ["PROBE_EXPECT"]))
"""


@pytest.mark.slow
def test_secret_env_values_never_reach_files_or_output(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(PROBE)
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": str(inject), "PROBE_DIR": str(tmp_path), "PROBE_EXPECT": SECRET}
    res = subprocess.run(
        [
            "bash",
            "-c",
            'umask 002; exec "$@"',
            "x",
            PY,
            "-m",
            "launcher",
            *LOCAL,
            f"run.dir={run_dir}",
            "train.steps=2",
            "train.checkpoint_every=1",
            f"+cluster.env.HF_TOKEN={SECRET}",
            "+cluster.env.NCCL_DEBUG=WARN",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "probe").read_text() == "True"  # the rank got the value
    assert SECRET not in res.stdout + res.stderr
    stored = run_dir / "secrets.json"
    assert json.load(open(stored)) == {"HF_TOKEN": SECRET}
    assert stat.S_IMODE(os.stat(stored).st_mode) == 0o600
    os.unlink(stored)
    assert SECRET.encode() not in all_bytes(run_dir)  # config.json/yaml, checkpoints, logs, events
    assert json.load(open(run_dir / "config.json"))["cluster"]["env"]["HF_TOKEN"] == PLACEHOLDER
    assert stat.S_IMODE(os.stat(run_dir / "events.jsonl").st_mode) == 0o664  # the user's umask (002)
    dry = run_cli(  # in this process: a dry run starts nothing
        "cluster=slurm_dev",
        "dry_run=true",
        "cluster.cpus_per_task=4",
        *COMMON,
        f"run.dir={tmp_path / 'dry'}",
        f"+cluster.env.WANDB_API_KEY={SECRET}",
        cwd=ROOT,
    )
    assert dry.returncode == 0 and "#SBATCH" in dry.stdout, dry.stderr[-2000:]
    assert SECRET not in dry.stdout + dry.stderr and SECRET.encode() not in all_bytes(tmp_path / "dry/config.json")


# ------------------------------------------------------------------------------- 13: local failure path
FAIL_RANK_1 = """import os, sys
if "training.main" in getattr(sys, "orig_argv", []) and os.environ.get("RANK") == "1":
    import training.run.loop
    real = training.run.loop.Trainer.train_step

    def step(self, *args, **kwargs):
        if self.state.step == 2:
            raise RuntimeError("injected failure on rank 1 at step 3")
        return real(self, *args, **kwargs)

    training.run.loop.Trainer.train_step = step
"""


@pytest.mark.slow
def test_local_rank_failure_stops_the_others_with_its_code_and_events(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAIL_RANK_1)
    run_dir = tmp_path / "run"
    t0 = time.time()
    res = meshrun(
        "model=tiny",
        "data=synthetic",
        "parallel.tp=1",
        "parallel.sp=false",
        "parallel.zero=0",
        "cluster.gpus_per_node=2",
        "train.steps=8",
        "train.checkpoint_every=2",
        "train.progress=false",
        "train.log_every=1",
        f"run.dir={run_dir}",
        env={"PYTHONPATH": str(inject)},
        timeout=180,
    )
    assert res.returncode == EXIT_FAILED, res.stderr[-2000:]
    assert "rank 1 exited with code 1; stopped the other ranks" in res.stderr
    assert time.time() - t0 < 120
    events = read_events(str(run_dir))
    failed = [e for e in events if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["rank"] == 1 and failed[0]["exit_code"] == EXIT_FAILED
    assert "injected failure" in open(run_dir / "logs" / "rank_1.log").read()
    assert "RuntimeError: injected failure on rank 1 at step 3" in failed[0]["reason"], failed  # the error line
    assert not any(e["event"] == "completed" for e in events)
    # Nothing lost beyond the last checkpoint: step_2 is complete and named by latest.
    assert re.findall(r"\d+", open(run_dir / "checkpoints" / "latest").read()) == ["2"]
    assert sorted(metrics(run_dir)) == [1, 2]
    out = meshrun("action=status", f"run.dir={run_dir}")
    assert json.loads(out.stdout)["state"] == "FAILED"
    assert read_holder(str(run_dir)).get("released")  # the directory is free again


KILLED_AFTER_PEER = """import os, signal, sys, time
if "training.main" in getattr(sys, "orig_argv", []):
    import training.run.loop
    real = training.run.loop.Trainer.train_step

    def step(self, *args, **kwargs):
        if self.state.step == 2:
            if os.environ.get("RANK") == "0":
                raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer (injected)")
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    training.run.loop.Trainer.train_step = step
"""


@pytest.mark.slow
def test_local_launcher_blames_the_killed_rank_not_the_peer_that_ended_first(tmp_path):
    """Issue 46: rank 0 ends first with a peer's collective error, rank 1 is SIGKILLed half a second later. The
    local launcher blames rank 1 (the Slurm epilogue's rule, launcher/slurm/requeue.py root_cause) and lists
    rank 0 as a consequence; before, it blamed the first rank it saw end."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILLED_AFTER_PEER)
    run_dir = tmp_path / "run"
    two = [a if a != "cluster.gpus_per_node=1" else "cluster.gpus_per_node=2" for a in LOCAL]
    res = meshrun(
        *two,
        f"run.dir={run_dir}",
        "train.steps=6",
        "train.checkpoint_every=2",
        env={"PYTHONPATH": str(inject)},
        timeout=180,
    )
    assert res.returncode == EXIT_FAILED, res.stderr[-2000:]
    assert "rank 1 was killed by SIGKILL" in res.stderr, res.stderr[-2000:]
    failed = [e for e in read_events(str(run_dir)) if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["rank"] == 1 and failed[0]["consequences"] == [0], failed
    assert "killed by SIGKILL" in failed[0]["reason"], failed


# ------------------------------------------------------------------------------- Slurm scenarios
def _copy_checkout(dst):
    for name in ("launcher", "training", "hydra_plugins"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=shutil.ignore_patterns("__pycache__"))


ONE_RANK = [
    "model=tiny",
    "data=synthetic",
    "cluster.gpus_per_node=1",
    "parallel.tp=1",
    "parallel.sp=false",
    "parallel.zero=0",
    "parallel.global_batch=8",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.progress=false",
]
SLURM1 = ["cluster=slurm_dev", "cluster.nodes=1", *ONE_RANK]


@pytest.fixture(scope="module")
def resume_none_job(tmp_path_factory, cluster):
    """A run with a checkpoint at step 2, then submitted again with train.resume=none, exit_interval=2, 3 steps,
    from a copy of the checkout that is broken right after the submission (resume once, one owner, code snapshot)."""
    base = tmp_path_factory.mktemp("resume_none")
    src, run_dir = base / "src", base / "run"
    _copy_checkout(src)
    env = {"PYTHONPATH": str(src)}
    first = subprocess.run(
        [PY, "-m", "launcher", *ONE_RANK, f"run.dir={run_dir}", "train.steps=2"],
        cwd=str(src),
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert first.returncode == 0, first.stderr[-2000:]
    res = subprocess.run(
        [
            PY,
            "-m",
            "launcher",
            *SLURM1,
            f"run.dir={run_dir}",
            "train.steps=3",
            "train.resume=none",
            "train.exit_interval=2",
        ],
        cwd=str(src),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    # Break the checkout the job was submitted from: attempts must not import it.
    (src / "training" / "loop.py").write_text("raise RuntimeError('edited after submission')\n")
    second = meshrun(*SLURM1, f"run.dir={run_dir}", "train.steps=3")  # while the job holds the directory
    return run_dir, job, second, wait_final(run_dir, timeout=300)


@pytest.mark.slurm
def test_explicit_resume_applies_to_the_first_attempt_only(resume_none_job):
    run_dir, job, _, status = resume_none_job
    events = read_events(str(run_dir))
    mine = [e for e in events if e.get("job_id") == job]
    starts = [e for e in mine if e["event"] == "started"]
    assert status["state"] == "COMPLETED" and len(starts) == 2, events
    # Attempt 0 started fresh (none) and stopped at step 2; attempt 1 resumed that checkpoint, not step 0.
    resumed = [e for e in mine if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [2] and resumed[0]["attempt"] == starts[1]["attempt"]
    requeued = [e for e in mine if e["event"] == "requeued"]
    assert [e["cause"] for e in requeued] == ["stopped_early"]
    req = json.load(open(run_dir / "resume_request.json"))
    assert req["resume"] == "none" and req["consumed"]["attempt"] == starts[0]["attempt"]
    # The fresh start (none) moved the first run's rows aside (training/observe/metrics.py: nothing deleted, every
    # step once in metrics.jsonl); then this launch's steps, none redone by the requeued attempt.
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["attempt"] for r in rows] == [starts[0]["attempt"]] * 2 + [starts[1]["attempt"]]
    purged = [json.loads(line) for line in open(run_dir / "metrics.purged.jsonl")]
    assert [r["step"] for r in purged] == [1, 2]


@pytest.mark.slurm
def test_a_job_runs_the_code_as_it_was_at_submission(resume_none_job):
    run_dir, job, _, status = resume_none_job
    assert status["state"] == "COMPLETED"  # though its source tree was broken right after sbatch
    code = os.path.join(str(run_dir), "code")
    starts = [e for e in read_events(str(run_dir)) if e["event"] == "started" and e.get("job_id") == job]
    assert starts and all(e["code"] == code for e in starts)
    snap = json.load(open(os.path.join(code, "snapshot.json")))
    assert set(snap["packages"]) >= {"launcher", "training", "meshrun_conf"} and "commit" not in snap  # no git
    from launcher.slurm.snapshot import git_info

    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_info()["commit"] == head  # the real checkout is a repository: its commit is recorded


@pytest.mark.slurm
def test_second_submission_on_a_held_run_dir_exits_2_naming_the_job(resume_none_job):
    run_dir, job, second, status = resume_none_job
    assert second.returncode == EXIT_INVALID and f"Slurm job {job}" in second.stderr, second.stderr[-2000:]
    assert "submitted Slurm job" not in second.stdout
    assert read_holder(str(run_dir)) == {**read_holder(str(run_dir)), "job_id": job}
    assert read_holder(str(run_dir)).get("released")  # the completed job let go


SAVE_FAILS_ONCE = """import errno, os, sys
if "training.main" in getattr(sys, "orig_argv", []):
    import training.checkpoint.storage as storage
    real = storage.commit

    def commit(tmp, final, *args, **kwargs):
        marker = os.path.join(os.environ["INJECT_DIR"], "failed_once")
        if final.endswith("step_4") and not os.path.exists(marker):
            open(marker, "w").close()
            raise OSError(errno.ENOSPC, "No space left on device (injected)", final)
        return real(tmp, final, *args, **kwargs)

    storage.commit = commit
"""


@pytest.mark.slurm
def test_transient_save_failure_requeues_from_the_previous_checkpoint(tmp_path, cluster):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SAVE_FAILS_ONCE)
    run_dir = tmp_path / "run"
    res = meshrun(
        *SLURM1, f"run.dir={run_dir}", "train.steps=6", env={"PYTHONPATH": str(inject), "INJECT_DIR": str(inject)}
    )
    assert res.returncode == 0, res.stderr[-3000:]
    status = wait_final(run_dir, timeout=300)
    events = read_events(str(run_dir))
    requeued = [e for e in events if e["event"] == "requeued"]
    assert status["state"] == "COMPLETED" and [e["cause"] for e in requeued] == ["save_failed"], events
    assert "No space left on device (injected)" in requeued[0]["reason"]
    assert "no space left: free space under run.dir" in requeued[0]["reason"]  # the hint survives
    assert requeued[0]["excluded_nodes"] == [] and requeued[0]["retry"] == 1
    assert [e["step"] for e in events if e["event"] == "resumed"] == [2]  # nothing lost beyond step_2
    assert not any(e["event"] == "stopped" for e in events)


@pytest.mark.slurm
def test_slurm_signal_alone_stops_a_run_at_a_short_time_limit(tmp_path, cluster):
    """The ranks' own clock off (MESHRUN_SELF_STOP=0): Slurm's --signal=USR2@100 at a 3-minute limit must
    reach the engine, which saves and stops; the job requeues and resumes with no step lost. (Slurm sends the
    warning once, from a check that runs about every 30 s and fires up to one period early: with 110 s of
    warning at a 2-minute limit it went out in the job's first seconds, while the rank wrapper still started
    with USR2 ignored, and was lost. Due 80 s after the start, it reaches ranks that have long installed
    their handler; the test waits for the `resumed` event, not for a time.)"""
    run_dir = tmp_path / "run"
    res = meshrun(
        "cluster=slurm_dev",
        *COMMON,
        f"run.dir={run_dir}",
        "cluster.nodes=1",
        "cluster.time_min=3",
        "cluster.signal_delay_s=100",
        "train.steps=100000",
        "+cluster.env.MESHRUN_PACE_STEP_S=2",  # waits about 80 s for Slurm's signal: idles instead of spinning
        "train.checkpoint_every=0",
        "train.progress=false",
        env={"MESHRUN_SELF_STOP": "0"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    try:
        deadline = time.time() + 300
        while True:
            events = read_events(str(run_dir))
            if any(e["event"] == "resumed" for e in events):
                break
            assert time.time() < deadline, f"no requeue/resume within 300 s: {events}"
            assert not any(e["event"] in ("failed", "stopped") for e in events), events
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job])
    assert not any(e["event"] == "stop_requested" for e in events)  # Slurm's signal, not the clock
    sig = [e for e in events if e["event"] == "signal"][0]
    resumed = [e for e in events if e["event"] == "resumed"][0]
    assert sig["name"] == "SIGUSR2" and resumed["step"] == sig["step"]
    assert [e["cause"] for e in events if e["event"] == "requeued"] == ["stopped_early"]
    steps = sorted(metrics(run_dir, last_wins=True))
    assert steps == list(range(1, steps[-1] + 1))


def _node_pids(run_dir, node):
    """Every process of this run on a fake node: the rank wrappers (submitit) and their ranks."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if (
            f"SLURMD_NODENAME={node}".encode() in env
            and f"MESHRUN_RUN_DIR={run_dir}".encode() in env
            and (b"submitit" in cmd or b"training.main" in cmd)
        ):
            pids.append(int(pid))
    return pids


@pytest.mark.slurm
def test_lost_node_is_the_one_excluded(tmp_path, cluster):
    """Every process of the run on the second node dies at once (the node is lost): the job is resubmitted
    without that node, not without the first survivor that reported an error, and completes."""
    run_dir = tmp_path / "run"
    env = dev.hold_env(tmp_path)  # the ranks wait before step 4: the node is lost mid-run
    submit(run_dir, env=env)
    wait_step(run_dir, 3)
    nodes = [e for e in read_events(str(run_dir)) if e["event"] == "started"][0]["nodes"]
    pids = _node_pids(run_dir, nodes[1])
    assert pids, f"no process of {run_dir} on {nodes[1]}"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    open(env["HOLD_RELEASE"], "w").close()
    status = wait_final(run_dir, timeout=300)
    events = read_events(str(run_dir))
    requeued = [e for e in events if e["event"] == "requeued"]
    assert requeued and requeued[0]["excluded_nodes"] == [nodes[1]], events
    failed = [e for e in events if e["event"] == "failed"]
    assert failed and {e["node"] for e in failed} == {nodes[1]}
    assert status["state"] == "COMPLETED"
