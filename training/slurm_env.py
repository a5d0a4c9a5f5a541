"""Slurm's environment -> torch.distributed's (RANK, WORLD_SIZE, ...), the one runner of Slurm's client
commands, and the NUMA affinity check.

Pure Python (no torch, no Hydra): the launcher's rank wrapper calls :func:`torch_env_from_slurm`
before it starts `python -m training.main`, and training/main.py calls :func:`apply_slurm_env`
so a rank started by a plain `srun python -m training.main RUN_DIR` works too. Every squeue, sinfo,
scontrol and sacct call of the launcher goes through :func:`slurm_command` (always with a timeout).
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Set

PORT_BASE = 20000
"""Lowest rendezvous port derived from a job id."""
PORT_SPAN = 20000
"""Ports PORT_BASE .. PORT_BASE + PORT_SPAN - 1 are used."""
SLURM_TIMEOUT_S = 20.0
"""How long a Slurm client command may take before the controller counts as unreachable."""


class SlurmUnavailable(RuntimeError):
    """A Slurm client command is missing or its controller does not answer."""


def slurm_command(cmd: Sequence[str], timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm client command (text output captured); its exit status is the caller's to read.
    SlurmUnavailable when the command is not installed or does not answer within timeout."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmUnavailable(f"`{cmd[0]}` not found: this machine has no Slurm client "
                               "(install slurm-client, or use cluster=local)") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"`{' '.join(cmd)}` did not answer in {timeout:.0f} s: "
                               "is the Slurm controller reachable?") from None


def dist_env(rank: int, world: int, local_rank: int, local_world: int, master_addr: str,
             master_port: int) -> Dict[str, str]:
    """The standard torch.distributed variables of one rank (docs/CONTRACTS.md, "Launch")."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def expand_hostlist(hostlist: str) -> List[str]:
    """Expand a Slurm hostlist ("n[1-3,7],gpu01") in Python; `scontrol show hostnames` is the fallback."""
    hosts: List[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def hostnames(nodelist: str) -> List[str]:
    """The hosts of a Slurm hostlist: expanded here, or by `scontrol show hostnames` when that fails."""
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError:
        hosts = []
    if not hosts and nodelist:
        try:
            hosts = slurm_command(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        except SlurmUnavailable:
            hosts = []
    return hosts


def first_host(nodelist: str) -> str:
    """First host of SLURM_JOB_NODELIST: the rendezvous host (rank 0 runs there)."""
    hosts = hostnames(nodelist)
    if not hosts:
        raise ValueError(f"cannot expand the Slurm node list {nodelist!r}")
    return hosts[0]


def slurm_job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The id Slurm commands take for this job: "<array job>_<task>" for a job-array task (as submitit
    names it; SLURM_JOB_ID alone would not match sacct's JobID column), else SLURM_JOB_ID; None outside Slurm."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def port_from_job(job_id: str, restart_count: int = 0) -> int:
    """A rendezvous port derived from the job id (and restart, so a requeued attempt never meets
    its predecessor's lingering sockets); the same on every rank without any exchange."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return PORT_BASE + (int(digits) * 7 + restart_count) % PORT_SPAN


def torch_env_from_slurm(env: Mapping[str, str]) -> Dict[str, str]:
    """The torch.distributed variables for this Slurm task; empty outside Slurm tasks.

    Values already present in env (e.g. MASTER_ADDR exported by the batch script) win."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    ntasks = int(env["SLURM_NTASKS"])
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                                                or "localhost")
    port = env.get("MASTER_PORT") or port_from_job(env.get("SLURM_JOB_ID", "0"),
                                                   int(env.get("SLURM_RESTART_COUNT") or 0))
    return dist_env(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", "0")),
                    ntasks // max(nnodes, 1), addr, int(port))


def apply_slurm_env(env: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set RANK/WORLD_SIZE/... from SLURM_* when RANK is not set yet; True when it changed anything."""
    env = os.environ if env is None else env
    if env.get("RANK") is not None:
        return False
    mapped = torch_env_from_slurm(env)
    env.update(mapped)
    return bool(mapped)


# ---------------------------------------------------------------- NUMA affinity, checked inside the rank
def parse_cpulist(text: str) -> Set[int]:
    """"0-3,8,10-11" -> {0,1,2,3,8,10,11} (the sysfs cpulist format)."""
    cpus: Set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_node_cpus(node: int, sysfs: str = "/sys/devices/system/node") -> Set[int]:
    with open(os.path.join(sysfs, f"node{node}", "cpulist")) as f:
        return parse_cpulist(f.read())


def check_affinity(expected_node: Optional[int] = None, sysfs: str = "/sys/devices/system/node") -> Optional[str]:
    """None when this process's CPU affinity lies inside its NUMA node's cpulist, else the problem.

    expected_node defaults to $MESHRUN_NUMA_NODE (set by the launcher's rank wrapper); no node: None."""
    if expected_node is None:
        value = os.environ.get("MESHRUN_NUMA_NODE", "")
        if not value:
            return None
        expected_node = int(value)
    want = numa_node_cpus(expected_node, sysfs)
    have = os.sched_getaffinity(0)
    if have and have <= want:
        return None
    return f"rank affinity {sorted(have)} is not inside NUMA node {expected_node}'s CPUs {sorted(want)}"


def reapply_affinity(sysfs: str = "/sys/devices/system/node") -> bool:
    """Re-bind to $MESHRUN_NUMA_NODE's CPUs if a library (e.g. a communicator's threads setup) reset
    the affinity; call after creating process groups. True when it had to re-bind."""
    value = os.environ.get("MESHRUN_NUMA_NODE", "")
    if not value or check_affinity(int(value), sysfs) is None:
        return False
    os.sched_setaffinity(0, numa_node_cpus(int(value), sysfs))
    return True
