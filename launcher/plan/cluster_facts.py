"""What the planner and the launch gate need to know about a cluster kind, as plain values.

Each launch backend (launcher/launch/backend.py) carries one ClusterFacts and registers it here when it registers
itself, so launcher/plan/ reads the facts of `cluster.kind` without importing any backend. The two built-in kinds'
facts are defined here, so that the planner answers the same whether or not a backend module was imported."""

from __future__ import annotations

from dataclasses import dataclass

from training.contract.config import Config


@dataclass(frozen=True)
class ClusterFacts:
    """The questions the launcher asks of a cluster kind; every `cluster.kind == ...` check is one of these."""

    kind: str
    """The `cluster.kind` value these facts belong to."""
    ranks_here: bool
    """The ranks run on this machine: its NUMA nodes, cores, PATH and data paths are theirs (the launcher may read
    the datasets, recommend.calibrate may run candidates here), and their output reaches this terminal."""
    shared_fs: bool
    """The ranks run on other machines: run.dir and the checkpoint replica must be on a file system they share."""
    time_limit: bool
    """The job ends at cluster.time_min: the checkpoint interval fits under it, and the warning signal
    cluster.signal_delay_s before the limit must leave time for a save."""
    adds_nodes: bool
    """A launch may ask for more nodes: cluster.nodes is a fix for a layout that does not fit."""
    slurm_keys: bool
    """The backend reads the Slurm-only cluster keys (launcher/plan/settings.py SLURM_ONLY); others ignore them."""


LOCAL = ClusterFacts("local", ranks_here=True, shared_fs=False, time_limit=False, adds_nodes=False, slurm_keys=False)
SLURM = ClusterFacts("slurm", ranks_here=False, shared_fs=True, time_limit=True, adds_nodes=True, slurm_keys=True)

KINDS: dict[str, ClusterFacts] = {f.kind: f for f in (LOCAL, SLURM)}
"""cluster.kind -> its facts; launcher/launch/backend.py register() adds a new backend's."""


def cluster_facts(cfg: Config) -> ClusterFacts:
    """The facts of cfg's cluster kind."""
    return KINDS[str(cfg.cluster.kind)]
