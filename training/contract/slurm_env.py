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
from collections.abc import Mapping, MutableMapping, Sequence

PORT_BASE = 20000
"""Lowest rendezvous port derived from a job id."""
PORT_SPAN = 20000
"""Ports PORT_BASE .. PORT_BASE + PORT_SPAN - 1 are used."""
SLURM_TIMEOUT_S = 20.0
"""How long a Slurm client command may take before the controller counts as unreachable."""


class SlurmUnavailable(RuntimeError):
    """A Slurm client command is missing or its controller does not answer."""


PREFLIGHT_PASSED_ENV = "MESHRUN_PREFLIGHT_PASSED"
"""Set by the batch script's prologue on an in-job restart (launcher/slurm/in_job.py preflight_passed): the
step's nodes, comma-separated, that passed the preflight earlier in this allocation; the preflight
(training/preflight/runner.py) does not check them again."""


def slurm_command(cmd: Sequence[str], timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm client command (text output captured); its exit status is the caller's to read.
    SlurmUnavailable when the command is not installed or does not answer within timeout."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmUnavailable(
            f"`{cmd[0]}` not found: this machine has no Slurm client (install slurm-client, or use cluster=local)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(
            f"`{' '.join(cmd)}` did not answer in {timeout:.0f} s: is the Slurm controller reachable?"
        ) from None


def dist_env(
    rank: int, world: int, local_rank: int, local_world: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """The standard torch.distributed variables of one rank (docs/CONTRACTS.md, "Launch")."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def _split_top_level(hostlist: str) -> list[str]:
    """Split at the commas outside brackets ("a[1,2],b" -> ["a[1,2]", "b"])."""
    parts, depth, cur = [], 0, ""
    for ch in hostlist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {hostlist!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {hostlist!r}")
    return [p.strip() for p in parts + [cur] if p.strip()]


def _expand_ranges(body: str) -> list[str]:
    """ "01-02,05" -> ["01", "02", "05"]: a range keeps the width of its lower bound (Slurm: n[9-11] ->
    n9 n10 n11, n[001-2] -> n001 n002)."""
    out: list[str] = []
    for r in body.split(","):
        lo, dash, hi = r.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad range {r!r} in a hostlist")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {r!r} in a hostlist")
        out += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist exactly as `scontrol show hostnames` does (tests/slurm/test_fault_matrix_slurm.py
    compares them on the dev cluster): every bracket of a name multiplies, the leftmost varying slowest
    ("rack[1-2]-node[01-02]" -> rack1-node01, rack1-node02, rack2-node01, rack2-node02); ValueError for a
    list Slurm also refuses (text after the last bracket, a descending range)."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist):
        pieces = re.split(r"(\[[^\]]*\])", part)
        if len(pieces) > 1 and pieces[-1]:
            raise ValueError(f"hostlist {hostlist!r}: text after the last bracket of {part!r}")
        names = [""]
        for piece in pieces:
            if piece.startswith("["):
                names = [n + v for n in names for v in _expand_ranges(piece[1:-1])]
            elif piece:
                if "[" in piece or "]" in piece:
                    raise ValueError(f"unbalanced brackets in hostlist {hostlist!r}")
                names = [n + piece for n in names]
        hosts += names
    return hosts


def hostnames(nodelist: str) -> list[str]:
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


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
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


def torch_env_from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables for this Slurm task; empty outside Slurm tasks.

    Values already present in env (e.g. MASTER_ADDR exported by the batch script) win."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    ntasks = int(env["SLURM_NTASKS"])
    # The step's nodes first: an in-job restart's step runs on a subset of the allocation (spares idle).
    nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    addr = env.get("MASTER_ADDR") or first_host(
        env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
    )
    port = env.get("MASTER_PORT") or port_from_job(
        env.get("SLURM_JOB_ID", "0"), int(env.get("SLURM_RESTART_COUNT") or 0)
    )
    return dist_env(
        int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", "0")), ntasks // max(nnodes, 1), addr, int(port)
    )


def apply_slurm_env(env: MutableMapping[str, str] | None = None) -> bool:
    """Set RANK/WORLD_SIZE/... from SLURM_* when RANK is not set yet; True when it changed anything."""
    env = os.environ if env is None else env
    if env.get("RANK") is not None:
        return False
    mapped = torch_env_from_slurm(env)
    env.update(mapped)
    return bool(mapped)


# ---------------------------------------------------------------- NUMA affinity, checked inside the rank
def parse_cpulist(text: str) -> set[int]:
    """ "0-3,8,10-11" -> {0,1,2,3,8,10,11} (the sysfs cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_node_cpus(node: int, sysfs: str = "/sys/devices/system/node") -> set[int]:
    with open(os.path.join(sysfs, f"node{node}", "cpulist")) as f:
        return parse_cpulist(f.read())


def check_affinity(expected_node: int | None = None, sysfs: str = "/sys/devices/system/node") -> str | None:
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
