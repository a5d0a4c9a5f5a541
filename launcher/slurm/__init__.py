"""Slurm: the job spec and its sbatch text (sbatch), submission (submit), the batch script's prologue and
epilogue (driver), the per-rank task (rank_task) and the requeue decision (requeue). Rank processes, NUMA binding
and warm starts are launcher/ranks/'s."""
