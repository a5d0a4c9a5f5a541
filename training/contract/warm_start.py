"""The warm rank start's wire protocol (pure Python, no torch): how a Slurm rank wrapper
(launcher/ranks/warm/slurm.py) or a local launcher (launcher/ranks/warm/local.py), both through
launcher/ranks/warm/fork.py, asks a warm agent (training/run/warm_agent.py) to fork a rank.

One connection per rank over a Unix socket in Linux's abstract namespace, named by the job and the node on Slurm
(the dev cluster runs several fake nodes on one host; a job array's tasks have their own SLURM_JOB_ID), by the
launcher's pid and a random token locally (one agent per launch). The agent serves only connections of its own
user (SO_PEERCRED), and a client sends nothing to a listener that is not its own user's (launcher/ranks/warm/fork.py):
any user can bind an abstract name first. Messages are length-prefixed JSON:
  client -> agent: {"env", "run_dir", "cwd", "umask", "affinity", "numa_node", "python"} with the rank's stdin,
                   stdout and stderr passed as file descriptors (SCM_RIGHTS), and optionally a 4th one the rank
                   keeps open (a local launch's run-directory lock, which every rank must hold);
  agent -> client: {"pid": P, "agent_pid": A} once the rank is forked, later {"exit": code} (Popen's
                   convention: negative = killed by that signal); {"error": why} when it cannot fork (a
                   "python" other than the agent's own interpreter is refused: the rank would run other code).
The rank holds the agent's end of the connection: when its client is gone (the connection closes) it ends, as a
rank started by its wrapper dies with the srun step (SIGKILL) or a local rank stops when its launcher dies
(SIGTERM: its own stop path, training/run/launcher_watch.py).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

WARM_ENV = "MESHRUN_WARM_START"
"""Set to 1 in the batch script when it started the warm agents: the rank wrappers then ask them first."""
WRAPPER_PID_ENV = "MESHRUN_WRAPPER_PID"
"""In every Slurm rank: the pid of its rank wrapper (its parent when started cold; a warm rank's parent is
the agent)."""
AGENT_PID_ENV = "MESHRUN_WARM_AGENT_PID"
"""In a rank forked by the warm agent: the agent's pid (a rank started cold has none)."""
AGENT_NAME_ENV = "MESHRUN_WARM_AGENT_NAME"
"""A local launch's agent: its socket's name (without the leading NUL), in its environment, which only its user
can read (never in argv: /proc/PID/cmdline is everyone's)."""
PAD_ENV = "MESHRUN_WARM_AGENT_PAD"
"""An agent's room (spaces) in its initial environment block: each rank it forks writes its own environment
there, so that /proc/PID/environ shows the rank's (training/run/warm_agent.py)."""
MAX_MESSAGE = 16 << 20
FDS = 3
"""stdin, stdout, stderr: always passed."""
MAX_FDS = FDS + 1
"""...and one more the rank keeps open (optional)."""


def socket_name(env: dict[str, str], node: str) -> str:
    """The agent's address: abstract (leading NUL), so nothing lands on a shared file system; the job's id and
    Slurm's restart count (a requeued job is a new allocation with new agents) and the node."""
    job, restart = env.get("SLURM_JOB_ID", ""), env.get("SLURM_RESTART_COUNT") or "0"
    return f"\0meshrun-warm-agent/{job}.{restart}/{node}"


def local_socket_name(launcher_pid: int, token: str) -> str:
    """A local launch's agent: one per launch (its launcher's pid and a random token), abstract as on Slurm."""
    return f"\0meshrun-warm-agent/local/{launcher_pid}.{token}"


def send(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    head = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [head + data], list(fds))
    else:
        sock.sendall(head + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    out = b""
    while len(out) < n:
        _wait_budget(sock, deadline)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("the connection closed")
        out += chunk
    return out


def _wait_budget(sock: socket.socket, deadline: float | None) -> None:
    """One deadline for a whole message: a peer that trickles a byte at a time cannot hold the reader longer."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)


def recv(sock: socket.socket, with_fds: bool = False, timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """One message (and the descriptors passed with it), within `timeout` seconds in all when given. EOFError
    when the peer closed the connection; on any failure the descriptors received are closed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    fds: list[int] = []
    try:
        if with_fds:
            _wait_budget(sock, deadline)
            head, fds, _flags, _addr = socket.recv_fds(sock, 4, MAX_FDS)
            if not head:
                raise EOFError("the connection closed")
            head += _recv_exact(sock, 4 - len(head), deadline)
        else:
            head = _recv_exact(sock, 4, deadline)
        (size,) = struct.unpack("!I", head)
        if size > MAX_MESSAGE:
            raise ValueError(f"message of {size} bytes")
        return json.loads(_recv_exact(sock, size, deadline)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
