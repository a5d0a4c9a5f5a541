"""Exit codes, one place for all of them (docs/CONTRACTS.md, README "Rank exit codes").

A rank's status tells the launcher's epilogue what to do (launcher/slurm/requeue.py); the `meshrun` command's
status tells the user what went wrong. Pure Python: the launcher imports it without torch.
"""

EXIT_OK = 0
"""Finished: the run (or the rank's part of it) completed."""
EXIT_INVALID = 2
"""Invalid configuration, data or checkpoint: the user must change something; never retried."""
EXIT_STOPPED = 3
"""A rank stopped early on purpose after a complete checkpoint (signal, exit_interval, exit_after_min): requeue it."""
EXIT_NODE_BAD = 4
"""A rank's preflight found its node bad: exclude the node and resubmit."""
EXIT_SLURM = 3
"""`meshrun` only (never a rank): Slurm itself refused (no controller, sbatch error); nothing was submitted."""
