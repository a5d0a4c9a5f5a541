"""The client side of a warm rank start (pure Python, no torch): ask a warm agent (training/run/warm_agent.py)
to fork a rank, and hold the forked rank as a Popen-like `WarmChild`. Used by the Slurm rank wrapper
(launcher/ranks/warm/slurm.py) and by the local launcher (launcher/ranks/warm/local.py); the wire protocol is
training/contract/warm_start.py.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO

from launcher.ranks.proc_tree import parent_of
from training.contract.warm_start import recv, send


class WarmChild:
    """A rank forked by a warm agent, as much of subprocess.Popen as the rank wrapper and the local launcher use:
    pid, returncode, poll(), wait(), send_signal(), terminate(), kill(), and the rank's output stream (stdout
    locally, stderr in a Slurm rank wrapper). Its exit code comes from the agent, which is its parent."""

    def __init__(
        self,
        sock: socket.socket,
        pid: int,
        agent_pid: int,
        stderr: IO[bytes] | None = None,
        stdout: IO[bytes] | None = None,
    ) -> None:
        self.sock, self.pid, self.agent_pid, self.stderr, self.stdout = sock, pid, agent_pid, stderr, stdout
        self.returncode: int | None = None
        self.lost = ""
        self.args = ["warm", str(pid)]

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is not None and not select.select([self.sock], [], [], max(0.0, timeout))[0]:
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            msg, _ = recv(self.sock)
            code = int(msg["exit"])
        except (EOFError, OSError, KeyError, ValueError, TypeError) as exc:
            # The agent died before the rank ended (the node is going down): the rank's own end is unknown.
            self.lost = f"the warm agent's connection ended without the rank's exit code ({exc})"
            code = -int(signal.SIGKILL)
        self.sock.close()
        self.returncode = code
        return code

    def poll(self) -> int | None:
        """The exit code once the agent has sent it (or its connection ended), else None; never blocks long:
        the agent writes the whole message at once."""
        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: not to a pid that may have been reused since
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that holds the other end of a connected Unix socket, as the kernel records them
    (SO_PEERCRED: not something the peer can claim)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def untrusted_agent(sock: socket.socket, agent_pid: int | None) -> str:
    """Why the process listening on the agent's name is not this user's agent, else "". An abstract socket name
    can be bound by any user of the network namespace (on Slurm it is predictable from the job id and the node):
    the rank's environment (its secrets), its streams and its lock go only to a listener of this process's own
    user, and, where the launcher started the agent itself, to that very process."""
    try:
        pid, uid = peer_credentials(sock)
    except OSError as exc:
        return f"its credentials cannot be read ({exc})"
    if uid != os.getuid():
        return f"the socket is held by uid {uid} (pid {pid}), not by this user (uid {os.getuid()})"
    if agent_pid is not None and pid != agent_pid:
        return f"the socket is held by pid {pid}, not by the agent this launcher started (pid {agent_pid})"
    return ""


def fork_rank(
    name: str,
    env: dict,
    run_dir: str,
    streams: Sequence[int],
    keep: Sequence[int] = (),
    numa_node: int | None = None,
    connect_s: float = 5.0,
    reply_s: float = 300.0,
    where: str = "",
    gone: Callable[[], str] | None = None,
    agent_pid: int | None = None,
) -> tuple[WarmChild | None, str]:
    """Ask the agent listening on `name` to fork the rank with env, this process's working directory, umask and
    CPU affinity, the descriptors `streams` as its stdin, stdout, stderr and `keep` (at most one) kept open;
    (None, why) when it cannot (the caller starts the rank cold). The caller closes its own copies of the
    descriptors. A WarmChild without streams: the caller attaches the read end of its pipe. `gone`, when given,
    says why waiting for the agent is pointless (it exited), else "". Nothing is sent to a listener that is not
    this user's (nor, given `agent_pid`, that process), and the forked pid must be a child of the agent: the
    caller signals it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.time() + connect_s
    while True:
        try:
            sock.connect(name)
            break
        except OSError as exc:
            why = gone() if gone is not None else ""
            if why or time.time() >= deadline:
                sock.close()
                return None, why or f"no warm agent answers{where} ({exc})"
            time.sleep(0.1)
    distrust = untrusted_agent(sock, agent_pid)
    if distrust:
        sock.close()
        return None, f"the warm agent{where} is not trusted: {distrust}"
    peer_pid = peer_credentials(sock)[0]
    try:
        umask = os.umask(0)
        os.umask(umask)
        request = {
            "env": env,
            "run_dir": run_dir,
            "cwd": os.getcwd(),
            "umask": umask,
            "affinity": sorted(os.sched_getaffinity(0)),
            "numa_node": numa_node,
            "python": sys.executable,
        }
        send(sock, request, list(streams) + list(keep))
        sock.settimeout(reply_s)
        reply, _ = recv(sock)
        sock.settimeout(None)
        if not isinstance(reply, dict) or "pid" not in reply:
            error = reply.get("error") if isinstance(reply, dict) else None
            raise ValueError(error or f"unexpected reply {reply}")
        pid, said_agent = int(reply["pid"]), int(reply["agent_pid"])
        # A rank that already ended may be reaped (gone from /proc): only a live pid of another parent is refused.
        if said_agent != peer_pid or parent_of(pid) not in (peer_pid, None):
            raise ValueError(f"the reply names pid {pid} of agent {said_agent}, not a child of the agent {peer_pid}")
    except (OSError, EOFError, ValueError, TypeError, KeyError) as exc:
        sock.close()
        return None, f"the warm agent{where} did not fork the rank ({exc or type(exc).__name__})"
    return WarmChild(sock, pid, said_agent), ""
