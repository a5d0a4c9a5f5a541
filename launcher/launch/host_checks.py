"""The launch gate's checks of a configuration against the machines it will run on (launcher/launch/gate.py hands
them to validate() as its cluster checks). The planner (launcher/plan/) reads only the configuration; everything
that looks at this host, its PATH, its file systems or the datasets is here.

- Local runs: cluster.numa_map against this machine's NUMA nodes (launcher/ranks/numa.py), the local ranks
  against the CPUs this process may use, nsys on PATH, text data paths that exist.
- Every run: the datasets (launcher/data/datasets.py: eval keys, blend weights, and for local runs each dataset
  opened against its description and the model's vocabulary), a C++ compiler for train.compile on CPU.
- Multi-node Slurm jobs: run.dir and train.checkpoint_replica_dir on a file system every node sees
  (launcher/launch/shared_fs.py).
No torch.
"""

from __future__ import annotations

import os
import shutil

from launcher.launch.shared_fs import shared_verdict
from launcher.plan.cluster_facts import cluster_facts
from launcher.plan.issues import Issue
from launcher.plan.settings import overlaps, replica_dirs
from launcher.ranks.numa import online_numa_nodes
from training.contract.config import Config


def host_issues(cfg: Config) -> list[Issue]:
    """Every machine check that applies to cfg's cluster kind, in one list."""
    out: list[Issue] = []
    facts = cluster_facts(cfg)
    if facts.ranks_here:
        out += _numa_and_cores(cfg) + _local_tools_and_paths(cfg)
    out += _compiler(cfg) + _data(cfg)
    if facts.shared_fs:
        out += _shared_file_systems(cfg)
    return out


def _numa_and_cores(cfg: Config) -> list[Issue]:
    """cluster.numa_map entries that are NUMA nodes of this machine, and local ranks against its cores."""
    out = []
    c = cfg.cluster
    nodes = online_numa_nodes() if c.numa == "explicit" else None
    bad = [n for n in c.numa_map if n >= 0 and n not in nodes] if nodes is not None else []
    if bad:  # negative entries are the planner's error (launcher/plan/validate.py)
        out.append(
            Issue(
                "error",
                "cluster.numa_map",
                f"entries {bad} are not NUMA nodes of the node (this machine's NUMA nodes are {nodes})",
                f"cluster.numa_map=[...] with ids from {nodes}, or cluster.numa=auto",
            )
        )
    try:  # the CPUs this process (and the ranks it starts) may run on, not the machine's: taskset, a cgroup
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 0
    if cores and c.gpus_per_node > cores:
        out.append(
            Issue(
                "warning",
                "cluster.gpus_per_node",
                f"{c.gpus_per_node} local ranks on {cores} CPU cores: ranks share cores and every "
                "collective waits for the slowest, so steps run several times slower",
                f"cluster.gpus_per_node={cores} (or keep {c.gpus_per_node} ranks and accept the slowdown)",
            )
        )
    return out


def _local_tools_and_paths(cfg: Config) -> list[Issue]:
    """nsys on PATH for train.nsys, and the text files of data=text. Checked for local runs only: a Slurm job's
    nodes may have what this host lacks (there the ranks check and exit 2 themselves)."""
    out = []
    if cfg.train.nsys and not shutil.which("nsys"):
        out.append(
            Issue(
                "error",
                "train.nsys",
                "nsys (Nsight Systems) is not on PATH",
                "install Nsight Systems or put its bin/ on PATH, or train.nsys=false",
            )
        )
    if cfg.data.kind == "text":
        out += [
            Issue(
                "error",
                "data.paths",
                f"{path!r} does not exist",
                "give existing text files or directories, or leave data.paths empty for "
                "the Python standard library's sources",
            )
            for path in cfg.data.paths
            if not os.path.exists(path)
        ]
    return out


def _compiler(cfg: Config) -> list[Issue]:
    """train.compile on CPU: Inductor's CPU kernels are C++ built by the host compiler; without one the first
    step fails."""
    compilers = (os.environ.get("CXX", ""), "g++", "c++", "clang++")
    if not cfg.train.compile or cfg.cluster.device != "cpu" or any(shutil.which(cc) for cc in compilers if cc):
        return []
    return [
        Issue(
            "warning",
            "train.compile",
            "no C++ compiler (CXX, g++, c++, clang++) on this machine's PATH: torch.compile's CPU kernels need one",
            "install g++ (apt-get install g++) or train.compile=false",
        )
    ]


def _data(cfg: Config) -> list[Issue]:
    """The datasets' problems a user can fix (launcher/data/datasets.py). A dataset is measured in samples of
    model.seq_length: with a length below 1 the planner's own error stands alone."""
    if cfg.model.seq_length < 1:
        return []
    from launcher.data.datasets import data_errors  # opens datasets: only where a launch is checked

    return [Issue("error", key, message, fix, "data") for key, message, fix in data_errors(cfg)]


def _shared_file_systems(cfg: Config) -> list[Issue]:
    """A multi-node (or elastic) Slurm job's run.dir, and its checkpoint replica, on a file system every node
    sees; a node-local one is warned about (fine only when the nodes share this host, as the dev cluster's do)."""
    out = []
    c, t = cfg.cluster, cfg.train
    if t.checkpoint_replica_dir and c.nodes > 1:
        rep, primary = replica_dirs(cfg)
        shared, where = shared_verdict(rep) if not overlaps(rep, primary) else (None, "")
        if shared is False:
            out.append(
                Issue(
                    "warning",
                    "train.checkpoint_replica_dir",
                    f"{rep} is on a node-local file system ({where}): rank 0's node alone holds the replica",
                    "a directory on a shared file system",
                )
            )
    if c.nodes > 1 or c.elastic.min_nodes > 0:
        shared, where = shared_verdict(cfg.run.dir)
        if shared is False:
            out.append(
                Issue(
                    "warning",
                    "run.dir",
                    f"a {c.nodes}-node job needs run.dir on a file system every node sees; {cfg.run.dir} is on "
                    f"{where}, a node-local one (fine only when the nodes share this host, as the dev "
                    "cluster's do)",
                    "run.dir=<a path on NFS, Lustre, GPFS or BeeGFS>",
                    "run_dir_not_shared",
                )
            )
    return out
