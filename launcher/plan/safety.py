"""Launch-time checks of values that would turn a run against its owner or fail only inside a rank.

- cluster.env may not set the variables meshrun sets itself: PYTHONPATH and PYTHONSAFEPATH carry the code
  snapshot a Slurm attempt imports (launcher/slurm/snapshot.py), MESHRUN_* point the prologue, epilogue and
  ranks at their run, and the rendezvous variables place each rank; overriding one would drop the snapshot,
  point a job at another run, or scramble the ranks.
- train.profile_steps is checked here as the rank checks it (training/observe/profile.py), so a bad window
  exits 2 before anything starts instead of failing in every rank.
"""

from __future__ import annotations

from training.contract.config import Config

RESERVED_ENV = (
    "PYTHONPATH",
    "PYTHONSAFEPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONNOUSERSITE",
    "PYTHONUSERBASE",
    "PYTHONEXECUTABLE",
    "PYTHONINSPECT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    # The job's identity as Slurm gives it: the prologue's lock claim, the rendezvous port and the warm agent's
    # socket name read them (the hostile audit's Q2); other SLURM_* input variables (SLURM_CPU_BIND, ...) stay
    # the user's.
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_RESTART_COUNT",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_PROCID",
    "SLURM_NODEID",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS",
    "SLURMD_NODENAME",
)
RESERVED_ENV_PREFIXES = ("MESHRUN_",)
# Not meshrun's own setting: the tests' and benchmarks' step pacing (training/run/pacing.py), which reaches every
# rank, local or Slurm, through cluster.env.
NOT_RESERVED = ("MESHRUN_PACE_STEP_S",)


def reserved_env_names(env) -> list[str]:
    """The names of cluster.env that meshrun sets itself (case as given; environment names are case-sensitive,
    so PYTHONPATH and MESHRUN_ are matched exactly as the shell and Python read them)."""
    return [
        str(n)
        for n in env
        if (str(n) in RESERVED_ENV or str(n).startswith(RESERVED_ENV_PREFIXES)) and str(n) not in NOT_RESERVED
    ]


def safety_problems(cfg: Config) -> list[tuple]:
    """(key, message, fix) for each problem."""
    out = []
    for name in reserved_env_names(cfg.cluster.env):
        out.append(
            (
                f"cluster.env.{name}",
                f"{name} is set by meshrun itself (the code snapshot, the run it "
                "belongs to, the ranks' rendezvous); overriding it could run other code or another run",
                f"remove it: ~cluster.env.{name}",
            )
        )
    steps = list(cfg.train.profile_steps or [])
    if steps and (len(steps) != 2 or not all(isinstance(s, int) for s in steps) or steps[0] < 1 or steps[1] < steps[0]):
        out.append(
            (
                "train.profile_steps",
                f"{steps} is not a window [first, last] with 1 <= first <= last (steps count from 1)",
                f"train.profile_steps=[{max(1, min(steps or [1]))},{max(steps or [1])}]",
            )
        )
    return out
