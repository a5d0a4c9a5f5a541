"""Warm rank starts for a local launch (cluster.warm_start, world >= 2: launcher/ranks/warm/__init__.py; pure
Python, no torch).

A cold local rank is `python -m training.main RUN_DIR`: a Python start and torch's import in every rank
(docs/PERFORMANCE.md: warm local starts). With warm starts the launcher starts ONE warm agent for the launch
(`python -m training.run.warm_agent --local LAUNCHER_PID RUN_DIR`, the socket's name in its environment: torch and the engine imported once,
nothing initialised) and asks it to fork every rank (launcher/ranks/warm/fork.py). The forked rank is what the cold
one is: the environment rank_process_env built, this launcher's working directory and umask, its stdin, the
launcher's pipe as stdout and stderr, the run directory's lock kept open (the kernel lock stays held while any
rank lives), a session of its own, the default stop signals, SIGTERM (its stop path) when this launcher's
connection closes (the launcher died), and its exit code Popen's way; `WarmChild` is Popen enough for the
launcher. The agent lives as long as the launch: stopped (SIGTERM) at its end, SIGTERM when the launcher dies
(PR_SET_PDEATHSIG); it leaves once its ranks are reaped.

A rank the agent cannot fork (it did not start, failed to import, is not fork-safe, did not answer within
AGENT_REPLY_S, refused another interpreter) starts cold as before, with a `warm_start_missed` event and a line on
stderr; once the agent failed, the remaining ranks start cold without asking it again.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from typing import IO, BinaryIO, cast

from launcher.ranks.warm.fork import WarmChild, fork_rank
from training.contract.rundir.events import append_event, read_events
from training.contract.warm_start import AGENT_NAME_ENV, PAD_ENV, local_socket_name

CONNECT_WAIT_S = 60.0
"""How long the launcher waits for its agent to listen (a Python start; the agent binds before its imports)."""
AGENT_REPLY_S = 120.0
"""How long the first rank waits for its fork: the agent imports torch and the engine first."""
AGENT_STOP_S = 10.0
"""After the launch: how long the agent has to leave (its ranks have ended) before it is killed."""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class LocalAgent:
    """The launch's warm agent (a child of this launcher, in a session of its own: Ctrl-C reaches the launcher
    only)."""

    def __init__(self, run_dir: str, env: dict, log: BinaryIO) -> None:
        self.run_dir = run_dir
        self.name = local_socket_name(os.getpid(), secrets.token_hex(8))
        self.broken = ""
        self.proc: subprocess.Popen | None = None
        # Room in the agent's initial environment block for each rank's own (shown in /proc/PID/environ).
        env = dict(env, **{PAD_ENV: " " * (sum(len(k) + len(v) + 2 for k, v in env.items()) + 16384)})
        # The name goes in the environment (readable by this user only), not in argv (any user reads
        # /proc/PID/cmdline): a watcher that learnt it could bind it first and leave the launch without its agent.
        env[AGENT_NAME_ENV] = self.name[1:]
        argv = [sys.executable, "-m", "training.run.warm_agent", "--local", str(os.getpid()), run_dir]
        try:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        except OSError as exc:
            self.broken = f"the warm agent did not start ({exc})"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _gone(self) -> str:
        if self.proc is None or self.proc.poll() is None:
            return ""
        return self._own_reason() or f"the warm agent exited with code {self.proc.returncode} before serving"

    def _own_reason(self) -> str:
        """What the agent said of itself (its `warm_agent` event: not fork-safe, the import failed)."""
        for ev in reversed(read_events(self.run_dir)):
            if ev.get("event") == "warm_agent" and ev.get("pid") == self.pid:
                return "" if ev.get("ready") else f"the warm agent did not serve: {ev.get('reason')}"
        return ""

    def start_rank(self, rank: int, env: dict, keep_fd: int) -> WarmChild | None:
        """The rank forked by the agent, its output (stdout and stderr) in a pipe read as .stdout; None (the
        caller starts it cold) after recording why."""
        if not self.broken:
            read_end, write_end = os.pipe()
            stdin = 0 if _is_open(0) else os.open(os.devnull, os.O_RDONLY)  # a launcher started with stdin closed
            try:
                child, why = fork_rank(
                    self.name,
                    env,
                    self.run_dir,
                    [stdin, write_end, write_end],
                    keep=[keep_fd],
                    connect_s=CONNECT_WAIT_S,
                    reply_s=AGENT_REPLY_S,
                    gone=self._gone,
                    agent_pid=self.pid,
                )
            finally:
                os.close(write_end)
                if stdin != 0:
                    os.close(stdin)
            if child is not None:
                child.stdout = cast(IO[bytes], os.fdopen(read_end, "rb", buffering=0))
                return child
            os.close(read_end)
            self.broken = self._gone() or self._own_reason() or why
        print(f"meshrun: rank {rank} starts cold: {self.broken}", file=sys.stderr)
        append_event(self.run_dir, "warm_start_missed", rank=rank, node=socket.gethostname(), reason=self.broken)
        return None

    def stop(self) -> None:
        """At the launch's end: SIGTERM (the agent leaves once its ranks are reaped), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=AGENT_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
