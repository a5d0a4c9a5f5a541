"""Slurm: the job spec and its sbatch text (sbatch), submission (submit), the batch script's prologue and
epilogue (driver), the per-rank task (rank_task), the requeue decision (requeue) and NUMA binding (numa)."""
