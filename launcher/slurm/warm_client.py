"""Warm rank starts (cluster.warm_start, with in-job restarts): the batch script's warm agents and the rank
wrapper's request to its node's agent (pure Python, no torch).

The batch script starts one warm agent per node of the allocation, spares included, in an srun step of its own
that lives through the allocation (training/run/warm_agent.py: torch and the engine imported once, nothing
initialised). The rank wrapper (launcher/slurm/rank_task.py) asks its node's agent to fork the rank with the
environment it would have started it with, and gets a Popen-like handle (`WarmChild`): the rank's pid, its
standard error through a pipe, its exit code. The rank does not belong to the training step's processes but to
the agent's step, so the wrapper relays every stop signal to it (training/run/signals.py's handler only sets a
flag: a copy that also reached it directly changes nothing), and the rank kills itself when its wrapper is gone.
When the agent is missing, dead, not ready within WARM_REPLY_S or refused to serve, the wrapper starts the rank
as before (`warm_start_missed` event, one per rank, with the reason).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import time
from typing import IO, List, Optional, Tuple, cast

from training.contract.config import Config
from training.contract.warm_start import WARM_ENV, recv, send, socket_name

CONNECT_WAIT_S = 5.0
"""How long a wrapper retries to reach its agent: the agent's step may start a moment after the training step's."""
WARM_REPLY_S = 300.0
"""How long a wrapper waits for its agent's fork: on the allocation's first step the agent is still importing."""


def enabled(cfg: Config) -> bool:
    """Warm agents run with cluster.warm_start, not inside a container (the ranks must run in the training step's
    container image). Every job: a node's ranks then pay one torch import between them instead of one each, on
    the first step as on every in-job restart."""
    c = cfg.cluster
    return c.warm_start and not c.container.image


def batch_lines(cfg: Config, python: str) -> List[str]:
    """The batch script's lines that start the agents (before the prologue, and before the loop over attempts with
    in-job restarts): one task per node in a step of its own, --overlap so it takes none of the training steps'
    CPUs, memory or GPUs, --no-kill and --kill-on-bad-exit=0 so a lost node's agent ends nothing else. USR2 ignored
    from the start (the job's stop signal reaches every step)."""
    if not enabled(cfg):
        return []
    boot = "bash -c " + shlex.quote('trap \'\' USR2; exec "$0" "$@"') + " " + python
    # The ranks it forks live in this step: where Slurm confines devices to a step's cgroup, it must hold the
    # node's GPUs of the job (shared with the training steps through --overlap).
    gpus = f"--gpus-per-node={cfg.cluster.gpus_per_node} " if cfg.cluster.device == "cuda" else ""
    # Likewise its CPUs: where Slurm confines a step to its CPUs (task/cgroup), a forked rank can run only on the
    # agent step's, so the step holds the CPUs of the node's training tasks (shared, --overlap).
    cpus = cfg.cluster.gpus_per_node * max(cfg.cluster.cpus_per_task, 1)
    return [
        f"export {WARM_ENV}=1",
        'command srun --overlap --no-kill --kill-on-bad-exit=0 --job-name=meshrun-warm --nodes="$SLURM_JOB_NUM_NODES" '
        f'--ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task={cpus} {gpus}'
        f'{boot} -u -m training.run.warm_agent "$MESHRUN_RUN_DIR" &',
    ]


class WarmChild:
    """A rank forked by the warm agent, as much of subprocess.Popen as the rank wrapper uses."""

    def __init__(self, sock: socket.socket, pid: int, agent_pid: int, stderr: IO[bytes]) -> None:
        self.sock, self.pid, self.agent_pid, self.stderr = sock, pid, agent_pid, stderr
        self.returncode: Optional[int] = None
        self.lost = ""

    def wait(self) -> int:
        if self.returncode is not None:
            return self.returncode
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


def start(env: dict, run_dir: str, numa_node: Optional[int]) -> Tuple[Optional[WarmChild], str]:
    """Ask this node's agent to fork the rank; (None, why) when it cannot (the caller starts it cold)."""
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.time() + CONNECT_WAIT_S
    while True:
        try:
            sock.connect(socket_name(env, node))
            break
        except OSError as exc:
            if time.time() >= deadline:
                sock.close()
                return None, f"no warm agent answers on {node} ({exc})"
            time.sleep(0.1)
    read_end, write_end = os.pipe()
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
        }
        send(sock, request, [0, 1, write_end])
        os.close(write_end)
        write_end = -1
        sock.settimeout(WARM_REPLY_S)
        reply, _ = recv(sock)
        sock.settimeout(None)
        if "pid" not in reply:
            raise ValueError(reply.get("error") or f"unexpected reply {reply}")
    except (OSError, EOFError, ValueError) as exc:
        sock.close()
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
        return None, f"the warm agent on {node} did not fork the rank ({exc or type(exc).__name__})"
    stderr = cast(IO[bytes], os.fdopen(read_end, "rb", buffering=0))
    return WarmChild(sock, int(reply["pid"]), int(reply["agent_pid"]), stderr), ""
