"""Warm rank starts on Slurm (cluster.warm_start): the batch script's warm agents and the rank
wrapper's request to its node's agent (pure Python, no torch).

The batch script starts one warm agent per node of the allocation, spares included, in an srun step of its own
that lives through the allocation (training/run/warm_agent.py: torch and the engine imported once, nothing
initialised). The rank wrapper (launcher/slurm/rank_task.py) asks its node's agent to fork the rank with the
environment it would have started it with, and gets a Popen-like handle (`WarmChild`, launcher/ranks/warm/fork.py):
the rank's pid, its standard error through a pipe, its exit code. The rank does not belong to the training step's processes but to
the agent's step, so the wrapper relays every stop signal to it (training/run/signals.py's handler only sets a
flag: a copy that also reached it directly changes nothing), and the rank kills itself when its wrapper is gone.
When the agent is missing, dead, not ready within WARM_REPLY_S or refused to serve, the wrapper starts the rank
as before (`warm_start_missed` event, one per rank, with the reason).
"""

from __future__ import annotations

import os
import shlex
import socket
from typing import IO, cast

from launcher.ranks.warm import enabled
from launcher.ranks.warm.fork import WarmChild, fork_rank
from training.contract.config import Config
from training.contract.warm_start import PAD_ENV, WARM_ENV, socket_name

__all__ = ["WarmChild", "batch_lines", "start"]

CONNECT_WAIT_S = 5.0
"""How long a wrapper retries to reach its agent: the agent's step may start a moment after the training step's."""
WARM_REPLY_S = 300.0
"""How long a wrapper waits for its agent's fork: on the allocation's first step the agent is still importing."""


PAD_BYTES = 65536
"""Spaces the batch script gives each Slurm agent's environment (a rank's env is its task's: some kB of SLURM_*)."""


def batch_lines(cfg: Config, python: str) -> list[str]:
    """The batch script's lines that start the agents (before the prologue, and before the loop over attempts with
    in-job restarts): one task per node in a step of its own, --overlap so it takes none of the training steps'
    CPUs, memory or GPUs, --no-kill and --kill-on-bad-exit=0 so a lost node's agent ends nothing else. USR2 ignored
    from the start (the job's stop signal reaches every step)."""
    if not enabled(cfg):
        return []
    # The padding: room in the agent's initial environment for each forked rank's own, which it writes there so that
    # /proc/PID/environ shows the rank's (training/run/warm_agent.py).
    pad = f'export {PAD_ENV}="$(printf "%{PAD_BYTES}s" "")"; '
    boot = "bash -c " + shlex.quote("trap '' USR2; " + pad + 'exec "$0" "$@"') + " " + python
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


def start(env: dict, run_dir: str, numa_node: int | None) -> tuple[WarmChild | None, str]:
    """Ask this node's agent to fork the rank; (None, why) when it cannot (the caller starts it cold)."""
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    read_end, write_end = os.pipe()
    try:
        child, why = fork_rank(
            socket_name(env, node),
            env,
            run_dir,
            [0, 1, write_end],
            numa_node=numa_node,
            connect_s=CONNECT_WAIT_S,
            reply_s=WARM_REPLY_S,
            where=f" on {node}",
        )
    finally:
        os.close(write_end)
    if child is None:
        os.close(read_end)
        return None, why
    child.stderr = cast(IO[bytes], os.fdopen(read_end, "rb", buffering=0))
    return child, ""
