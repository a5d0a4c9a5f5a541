"""The warm agent and the rank wrapper's request (training/run/warm_agent.py, launcher/slurm/warm_client.py):
one real agent (torch and the engine imported), real forked ranks, no Slurm. What a rank does is injected through
sitecustomize, which the agent runs again in every rank it forks (as every cold rank's interpreter does).

On the dev cluster, tests/slurm/test_in_job_restart.py checks that the in-job restarts' ranks were forked by their
node's agent and that the losses equal an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.launch.processes import start_pump
from launcher.slurm import rank_task, warm_client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/slurm/this file

# In a forked rank only (the agent's own start has no training.main in its argv): act as WARM_TEST says.
INJECT = r"""import os, signal, sys, time
if "training.main" in getattr(sys, "orig_argv", []) and os.environ.get("WARM_TEST"):
    mode = os.environ["WARM_TEST"]
    out = os.environ["WARM_TEST_OUT"]
    with open(out + ".info", "w") as f:
        f.write(repr({"ppid": os.getppid(), "cwd": os.getcwd(), "value": os.environ.get("WARM_TEST_VALUE"),
                      "agent": os.environ.get("MESHRUN_WARM_AGENT_PID"), "argv": sys.argv[1:],
                      "umask": os.umask(0o22), "usr2": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN,
                      "threads_imported": "torch" in sys.modules}))
    if mode == "exit":
        print("rank says: failing with 7", file=sys.stderr)
        sys.exit(7)
    if mode == "signal":
        time.sleep(1.0)  # still "importing": a stop signal now must not be lost
        signal.signal(signal.SIGUSR2, lambda *a: open(out + ".usr2", "a").write("x"))
        time.sleep(3.0)
        sys.exit(3)
    if mode == "sleep":
        time.sleep(120)
"""


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    base = tmp_path_factory.mktemp("warm")
    (base / "inject").mkdir()
    (base / "inject" / "sitecustomize.py").write_text(INJECT)
    env = {
        **os.environ,
        "SLURM_JOB_ID": f"warmtest{os.getpid()}",
        "SLURMD_NODENAME": "wn1",
        "PYTHONPATH": os.pathsep.join([str(base / "inject"), ROOT]),
    }
    run_dir = base / "run"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "training.run.warm_agent", str(run_dir)], env=env, cwd=ROOT)
    yield proc, env, base
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def _start(env, base, mode, **extra):
    rank_env = {**env, "WARM_TEST": mode, "WARM_TEST_OUT": str(base / mode), **extra}
    child, why = warm_client.start(rank_env, str(base / "run"), None)
    assert child is not None, why
    return child


def _info(base, mode):
    path = base / f"{mode}.info"
    for _ in range(600):
        if path.exists() and path.read_text().endswith("}"):
            return eval(path.read_text())  # noqa: S307 - our own repr
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


@pytest.mark.slow  # an agent that imports torch, and the rank it forks
def test_a_forked_rank_runs_as_its_wrapper_asked_and_its_end_comes_back(agent, tmp_path):
    proc, env, base = agent
    # Exit code, standard error through the wrapper's pipe, environment, working directory, argv, parent.
    child = _start(env, base, "exit", WARM_TEST_VALUE="v1")
    tail: list = []
    pump = start_pump(child.stderr, [], tail)
    code = child.wait()
    pump.join(timeout=10)
    assert code == 7, b"".join(tail)[-3000:]
    assert b"rank says: failing with 7" in b"".join(tail)
    info = _info(base, "exit")
    assert info["ppid"] == child.agent_pid == proc.pid and info["agent"] == str(proc.pid)
    assert info["value"] == "v1" and info["cwd"] == os.getcwd() and info["argv"] == [str(base / "run")]
    assert info["usr2"] and info["threads_imported"]  # stop signal ignored at the start; torch already imported

    # A stop signal the wrapper got while the rank still ignored it: relayed once its handler is installed.
    child = _start(env, base, "signal")
    fwd = rank_task._Forwarder()
    fwd.relay = True
    fwd.attach(child.pid)
    fwd.on_signal(signal.SIGUSR2, None)
    assert child.wait() == 3
    fwd.done.set()
    assert (base / "signal.usr2").read_text() == "x"

    # The wrapper dies (srun's SIGKILL, a lost node): its rank goes too.
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from launcher.slurm import warm_client; "
            "c, why = warm_client.start(eval(sys.argv[1]), sys.argv[2], None); "
            "print(c.pid, flush=True); time.sleep(120)",
            repr({**env, "WARM_TEST": "sleep", "WARM_TEST_OUT": str(base / "sleep")}),
            str(base / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    rank_pid = int(wrapper.stdout.readline())
    _info(base, "sleep")
    wrapper.kill()
    wrapper.wait()
    for _ in range(200):
        if not os.path.exists(f"/proc/{rank_pid}") or " Z" in _state(rank_pid):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"rank {rank_pid} still runs after its wrapper died")
    assert proc.poll() is None  # the agent serves on


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1][:3]
    except OSError:
        return " Z"


def test_no_agent_means_a_cold_start_with_the_reason(monkeypatch):
    monkeypatch.setattr(warm_client, "CONNECT_WAIT_S", 0.2)
    child, why = warm_client.start({"SLURM_JOB_ID": "none", "SLURMD_NODENAME": "nowhere"}, "/tmp", None)
    assert child is None and why.startswith("no warm agent answers on nowhere")


def test_the_batch_script_starts_one_agent_per_node_in_every_job_before_its_prologue(tmp_path):
    from helpers.slurm import dev_cfg
    from launcher.slurm.sbatch import job_spec, preflight_job_spec, sbatch_text

    in_job = dev_cfg(spare_nodes=1, max_in_job_restarts=2)
    warm = sbatch_text(job_spec(in_job, str(tmp_path))).splitlines()
    agent = [i for i, line in enumerate(warm) if "training.run.warm_agent" in line]
    assert len(agent) == 1 and agent[0] < warm.index("while :; do")  # before the loop: one step for every attempt
    line = warm[agent[0]]
    assert line.startswith("command srun --overlap --no-kill") and line.endswith("&") and "--gpus" not in line
    # The step holds the CPUs of the node's training tasks (2 ranks x 4 CPUs here): a step confined to
    # its CPUs (task/cgroup) must leave its forked ranks the CPUs they would have had.
    assert in_job.cluster.cpus_per_task == 4 and " --ntasks-per-node=1 --cpus-per-task=8 " in line
    cuda = dev_cfg(spare_nodes=1, max_in_job_restarts=2, device="cuda", gpus_per_node=8, cpus_per_task=12)
    assert "--gpus-per-node=8 " in warm_client.batch_lines(cuda, "python")[1]
    assert "--cpus-per-task=96 " in warm_client.batch_lines(cuda, "python")[1]
    # Without in-job restarts too: one agent step, then the prologue of the one attempt.
    plain = sbatch_text(job_spec(dev_cfg(), str(tmp_path / "plain"))).splitlines()
    agent = [i for i, line in enumerate(plain) if "training.run.warm_agent" in line]
    prologue = [i for i, line in enumerate(plain) if "launcher.slurm.driver prologue" in line]
    assert len(agent) == 1 and len(prologue) == 1 and agent[0] < prologue[0] and "while :; do" not in plain
    assert warm_client.batch_lines(dev_cfg(spare_nodes=1, max_in_job_restarts=2, warm_start=False), "python") == []
    assert warm_client.batch_lines(dev_cfg(warm_start=False), "python") == []
    boxed = dev_cfg(spare_nodes=1, max_in_job_restarts=2)
    boxed.cluster.container.image = "nvcr.io#nvidia/pytorch:24.05-py3"
    assert warm_client.batch_lines(boxed, "python") == []
    pre = sbatch_text(preflight_job_spec(dev_cfg(spare_nodes=1, max_in_job_restarts=2), str(tmp_path)))
    assert "warm_agent" not in pre
