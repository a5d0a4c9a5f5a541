"""The warm agent and the rank wrapper's request (training/run/warm_agent.py, launcher/ranks/warm/slurm.py):
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

from launcher.ranks.processes import start_pump
from launcher.ranks.warm import slurm as warm_client
from launcher.slurm import rank_task

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
            "import sys, time; from launcher.ranks.warm import slurm as warm_client; "
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


def _agent_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _raw_request(env, payload: bytes, nfds: int, close_early: bool = False):
    """A crafted client: the length-prefixed payload with nfds descriptors of /dev/null; the reply or None."""
    import socket
    import struct

    from training.contract.warm_start import socket_name

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_name(env, env["SLURMD_NODENAME"]))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(nfds)]
    try:
        head = struct.pack("!I", len(payload) + (64 if close_early else 0))
        socket.send_fds(sock, [head + payload], fds)
        if close_early:
            return None
        sock.settimeout(30)
        try:
            return sock.recv(4096)
        except OSError:
            return None
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


@pytest.mark.slow  # the module's agent (torch imported); its ranks exit 2 at once (no run directory)
def test_malformed_requests_neither_kill_nor_leak_nor_stall_the_agent(agent, tmp_path):
    """The hostile audit's W5-W7: a request that is not an object, or of the wrong field types, is dropped with a
    message (the agent used to die of AttributeError); bad JSON or a body that never comes leaves no descriptor
    open (9 -> 809 after 200); a client that trickles a byte every few seconds is dropped after REQUEST_TIMEOUT_S
    in all, not per byte (38 s)."""
    import socket
    import struct

    from training.contract.warm_start import socket_name
    from training.run.warm_agent import REQUEST_TIMEOUT_S

    proc, env, base = agent
    _start(env, base, "exit").wait()  # the agent serves (imports done): what follows is its steady state
    before = _agent_fds(proc.pid)
    for payload in (b"[1, 2, 3]", b'{"env": "x", "run_dir": 1}', b'{"env": {"A": 1}, "run_dir": "r", "cwd": "/"}'):
        reply = _raw_request(env, payload, 3)
        assert reply and b"error" in reply, (payload, reply)
        assert proc.poll() is None, payload
    for _ in range(30):
        _raw_request(env, b"{not json", 4)
        _raw_request(env, b"{}", 4, close_early=True)
    time.sleep(0.5)
    assert proc.poll() is None
    assert _agent_fds(proc.pid) <= before + 2, (before, _agent_fds(proc.pid))

    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(socket_name(env, env["SLURMD_NODENAME"]))
    t0 = time.monotonic()
    slow.sendall(struct.pack("!I", 100))
    served_at = None
    good = None
    while time.monotonic() - t0 < 3 * REQUEST_TIMEOUT_S:
        try:
            slow.sendall(b" ")
        except OSError:
            break  # dropped by the agent
        if good is None and time.monotonic() - t0 > 1.0:
            import threading

            good = threading.Thread(target=lambda: _start(env, base, "exit").wait())
            good.start()
        if good is not None and not good.is_alive() and served_at is None:
            served_at = time.monotonic() - t0
            break
        time.sleep(REQUEST_TIMEOUT_S / 4)
    slow.close()
    if good is not None:
        good.join(timeout=60)
        served_at = served_at or time.monotonic() - t0
    assert served_at is not None and served_at < REQUEST_TIMEOUT_S + 8, served_at
    assert proc.poll() is None


def test_a_squatter_on_the_agents_name_gets_nothing(tmp_path):
    """The hostile audit's W3/W4: another user binds the agent's abstract name first (any user can compute it on
    Slurm). The wrapper must start the rank cold without sending its environment (its secrets), descriptors or
    anything else, and must not accept a forged pid; locally, even this user's own process that is not the agent
    the launcher started is refused."""
    import socket

    from launcher.ranks.warm import fork as warm
    from training.contract.warm_start import socket_name

    env = {"SLURM_JOB_ID": f"squat{os.getpid()}", "SLURMD_NODENAME": "sq1", "HF_TOKEN": "hf_SECRET_VALUE"}
    name = socket_name(env, "sq1")
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: another user where the test may switch (root in CI), else this user
        try:
            os.close(ready_r)
            os.close(got_r)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(name)
            srv.listen(8)
            os.write(ready_w, b"x")
            data = b""
            srv.settimeout(20)
            for _ in range(2):
                conn, _ = srv.accept()
                conn.settimeout(2)
                try:
                    conn.sendall(b'\x00\x00\x00\x1c{"pid": 1, "agent_pid": 1}')
                    msg, fds, _f, _a = socket.recv_fds(conn, 1 << 20, 8)
                    data += msg + b"fds=%d;" % len(fds)
                except OSError:
                    pass
                conn.close()
            os.write(got_w, data)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(got_w)
    assert os.read(ready_r, 1) == b"x"
    try:
        child, why = warm_client.start(env, str(tmp_path), None)
        assert child is None and "not trusted" in why, why
        # Locally the launcher knows its agent's pid: a listener of this very user that is not it is refused too.
        child, why = warm.fork_rank(name, env, str(tmp_path), [0, 1, 2], connect_s=1, agent_pid=os.getpid())
        assert child is None and "not trusted" in why, why
    finally:
        os.waitpid(pid, 0)
    with os.fdopen(got_r, "rb") as f:
        got = f.read()
    assert got == b"", got  # nothing was sent: no secret, no descriptor


def test_the_local_agents_name_is_not_in_its_command_line(tmp_path):
    """W4: the local agent's socket name (its token) was in argv, which every user reads in /proc/PID/cmdline: a
    watcher bound it first in 5 of 5 runs. It is in the agent's environment now (readable by its user only)."""
    from launcher.ranks.warm.local import LocalAgent

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(tmp_path / "agent.log", "wb") as log:
        agent = LocalAgent(str(run_dir), {**os.environ, "PYTHONPATH": ROOT}, log)
    try:
        assert agent.pid is not None and agent.proc is not None
        time.sleep(0.2)
        assert agent.proc.poll() is None, (tmp_path / "agent.log").read_text()
        with open(f"/proc/{agent.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        token = agent.name[1:].rsplit(".", 1)[1]
        assert b"training.run.warm_agent" in cmdline and token.encode() not in cmdline, cmdline
        for _ in range(200):  # it binds its name (taken from the environment) before importing torch
            with open("/proc/net/unix", "rb") as f:
                if ("@" + agent.name[1:]).encode() in f.read():
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the local agent never listened on its name")
    finally:
        agent.stop()
