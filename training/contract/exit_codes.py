"""Exit codes, one place for all of them, each number with one meaning (docs/CONTRACTS.md, docs/GUIDE.md
"Rank exit codes").

A rank's status tells the launcher's epilogue what to do (launcher/slurm/requeue.py); the `meshrun` command's
status tells the user what went wrong. Pure Python: the launcher imports it without torch.
"""

EXIT_OK = 0
"""Finished: the run (or the rank's part of it) completed."""
EXIT_FAILED = 1
"""A failure: a rank raised, a Slurm attempt ended without completing the run (the batch script's
prologue or epilogue), or `meshrun ... wait=true` saw the run (or a sweep point) end without completing."""
EXIT_INVALID = 2
"""Invalid configuration, data or checkpoint: the user must change something; never retried."""
EXIT_STOPPED = 3
"""A rank stopped early on purpose after a complete checkpoint (signal, exit_interval, exit_after_min): requeue it."""
EXIT_NODE_BAD = 4
"""A rank's preflight found its node bad, or the health sampler did (cluster.health.action=requeue, after a
complete checkpoint): exclude the node and resubmit."""
EXIT_SLURM = 5
"""`meshrun` only (never a rank): Slurm itself refused (no controller, sbatch error); nothing was submitted."""
EXIT_REHEARSAL_DEFECT = 6
"""`meshrun action=rehearse` only: the rehearsal found a defect (collectives that do not match across ranks, a
deadlock under NCCL's rules, a tensor off the run's device in a collective, memory unlike the plan); nothing was
launched (rehearsal.json names it)."""
EXIT_RESTART_IN_JOB = 75
"""The Slurm epilogue only (never a rank): relaunch the training step inside the same allocation (the batch
script's loop, launcher/slurm/in_job.py); the batch script never exits with it."""
EXIT_INTERRUPTED = 130
"""`meshrun` only: a local run interrupted from the keyboard, or Ctrl-C while wait=true follows a Slurm job (the job
keeps running; 128 + SIGINT, the shell's convention)."""
