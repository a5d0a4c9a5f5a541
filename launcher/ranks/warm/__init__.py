"""Warm rank starts (cluster.warm_start), in one place behind one switch (`enabled`): a warm agent
(training/run/warm_agent.py) imports torch and the engine once and forks ranks on request, instead of every rank
starting a Python and importing torch (docs/PERFORMANCE.md: warm starts).

- fork.py: the client side both launchers share: ask an agent to fork a rank, hold it as a Popen-like `WarmChild`.
- local.py: a local launch's one agent (`LocalAgent`).
- slurm.py: the batch script's agents, one per node, and a Slurm rank wrapper's request to its node's agent.

A rank the agent cannot fork starts cold, with a `warm_start_missed` event. No torch.
"""

from __future__ import annotations

from launcher.plan.cluster_facts import cluster_facts
from training.contract.config import Config


def enabled(cfg: Config, local_world: int = 0) -> bool:
    """Whether the ranks of this launch are forked by a warm agent.

    - Slurm: every job with cluster.warm_start and no container image (the ranks must run in the training step's
      image); a node's ranks then pay one torch import between them instead of one each, on the first step as on
      every in-job restart.
    - Local: a launch of local_world >= 2 ranks (a world of one imports torch once either way)."""
    c = cfg.cluster
    if not c.warm_start:
        return False
    if not cluster_facts(cfg).ranks_here:  # an agent on each node of the job
        return not c.container.image
    return local_world >= 2
