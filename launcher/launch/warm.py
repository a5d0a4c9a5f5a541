"""The client side of a warm rank start (pure Python, no torch): ask a warm agent (training/run/warm_agent.py)
to fork a rank, and hold the forked rank as a Popen-like `WarmChild`. Used by the Slurm rank wrapper
(launcher/slurm/warm_client.py) and by the local launcher (launcher/launch/local_warm.py); the wire protocol is
training/contract/warm_start.py.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Callable, Optional, Sequence, Tuple

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
        stderr: Optional[IO[bytes]] = None,
        stdout: Optional[IO[bytes]] = None,
    ) -> None:
        self.sock, self.pid, self.agent_pid, self.stderr, self.stdout = sock, pid, agent_pid, stderr, stdout
        self.returncode: Optional[int] = None
        self.lost = ""
        self.args = ["warm", str(pid)]

    def wait(self, timeout: Optional[float] = None) -> int:
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

    def poll(self) -> Optional[int]:
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


def fork_rank(
    name: str,
    env: dict,
    run_dir: str,
    streams: Sequence[int],
    keep: Sequence[int] = (),
    numa_node: Optional[int] = None,
    connect_s: float = 5.0,
    reply_s: float = 300.0,
    where: str = "",
    gone: Optional[Callable[[], str]] = None,
) -> Tuple[Optional[WarmChild], str]:
    """Ask the agent listening on `name` to fork the rank with env, this process's working directory, umask and
    CPU affinity, the descriptors `streams` as its stdin, stdout, stderr and `keep` (at most one) kept open;
    (None, why) when it cannot (the caller starts the rank cold). The caller closes its own copies of the
    descriptors. A WarmChild without streams: the caller attaches the read end of its pipe. `gone`, when given,
    says why waiting for the agent is pointless (it exited), else ""."""
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
        if "pid" not in reply:
            raise ValueError(reply.get("error") or f"unexpected reply {reply}")
    except (OSError, EOFError, ValueError) as exc:
        sock.close()
        return None, f"the warm agent{where} did not fork the rank ({exc or type(exc).__name__})"
    return WarmChild(sock, int(reply["pid"]), int(reply["agent_pid"])), ""
