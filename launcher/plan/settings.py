"""Settings that are legal but would not do what they say: warned or noted before anything runs.

- Slurm-only cluster keys on a local run (one note listing what the local launcher ignores);
- parallel.recompute=selective where it saves (almost) nothing: with flash attention the s x s scores it
  drops are never stored, so it costs a re-run of attention in backward for a few MiB;
- a pipeline whose idle share of the wall clock (p-1)/(v m + p-1) exceeds PIPELINE_IDLE_WARN, with the global
  batch that brings it under;
- train.nsys / train.nvtx settings, and a checkpoint replica that overlaps the primary checkpoints.
Nothing here looks at the machine (nsys on PATH, shared file systems: launcher/launch/host_checks.py).
No torch, no Hydra (launcher/plan/validate.py calls it once the plan exists).
"""

from __future__ import annotations

import dataclasses
import math
import os

from launcher.plan.cluster_facts import cluster_facts
from training.contract.config import ClusterConfig, Config, derived_dp
from training.contract.rundir.paths import RunPaths

PIPELINE_IDLE_WARN = 0.25
"""A pipeline idle longer than this share of the wall clock (the bubble (p-1)/(v m + p-1)) is warned about."""

SELECTIVE_MIN_SAVING = 0.02
"""recompute=selective that saves less than this share of a GPU's planned memory is warned about (and is not
offered as a fix for a model that does not fit)."""

SLURM_ONLY = (
    "partition",
    "account",
    "qos",
    "time_min",
    "signal_delay_s",
    "max_retries",
    "exclude",
    "cpus_per_task",
    "exclusive",
    "mem",
    "sbatch_extra",
    "container",
    "elastic",
)
"""cluster.* keys only the Slurm backend reads (sbatch options, requeue, containers, elastic shrink)."""


def ignored_on_local(cfg: Config) -> list[str]:
    """Slurm-only cluster keys set away from their built-in default on a local run: the local launcher ignores them."""
    if cluster_facts(cfg).slurm_keys:
        return []
    base = ClusterConfig()
    out = []
    for name in SLURM_ONLY:
        value, default = getattr(cfg.cluster, name), getattr(base, name)
        if dataclasses.is_dataclass(value):
            out += [
                f"cluster.{name}.{f.name}"
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(default, f.name)
            ]
        elif value != default:
            out.append(f"cluster.{name}")
    return out


def selective_saving_bytes(cfg: Config) -> int | None:
    """Bytes per GPU that recompute=selective saves against recompute=none in this layout (None: not set)."""
    if str(cfg.parallel.recompute) != "selective":
        return None
    from launcher.plan.estimate import make_plan, with_parallel

    none = make_plan(with_parallel(cfg, recompute="none")).memory_bytes["total"]
    return none - make_plan(cfg).memory_bytes["total"]


def micro_batches_for_idle(pp: int, vpp: int, limit: float = PIPELINE_IDLE_WARN) -> int:
    """Fewest micro-batches m with (p-1)/(v m + p-1) <= limit (interleaved schedules also need m % pp == 0)."""
    m = max(1, math.ceil((pp - 1) * (1 - limit) / (limit * vpp) - 1e-9))
    if vpp > 1:
        m = -(-m // pp) * pp
    return m


def setting_issues(cfg: Config, plan) -> list:
    """The warnings and notes of this module, as launcher/plan/validate.py's Issues."""
    from launcher.plan.issues import Issue

    out = []
    ignored = ignored_on_local(cfg)
    if ignored:
        out.append(
            Issue(
                "note",
                "cluster",
                f"a {cfg.cluster.kind} run ignores Slurm-only keys: "
                + ", ".join(ignored)
                + " (they apply with cluster.kind=slurm)",
                code="slurm_only",
            )
        )
    saved = selective_saving_bytes(cfg)
    if saved is not None and plan is not None and saved < SELECTIVE_MIN_SAVING * plan.memory_bytes["total"]:
        why = (
            "flash attention never stores the s x s scores selective recompute drops"
            if str(cfg.model.attention) == "flash"
            else "the attention scores are a small part of this layout"
        )
        out.append(
            Issue(
                "warning",
                "parallel.recompute",
                f"selective saves {saved / 2**20:.1f} MiB of {plan.memory_bytes['total'] / 2**30:.2f} GiB per "
                f"GPU ({why}) and re-runs attention in backward",
                "parallel.recompute=none (same memory, faster), or parallel.recompute=full (if memory is short)",
                "selective_no_saving",
            )
        )
    par = cfg.parallel
    if plan is not None and par.pp > 1 and plan.bubble_idle_fraction > PIPELINE_IDLE_WARN:
        dp = derived_dp(cfg)
        v = par.vpp if str(par.schedule) == "interleaved_1f1b" else 1
        m = micro_batches_for_idle(par.pp, v)
        gb = m * par.micro_batch * dp
        out.append(
            Issue(
                "warning",
                "parallel.global_batch",
                f"pipeline idle {100 * plan.bubble_idle_fraction:.0f} % of the wall clock (pp {par.pp}, "
                f"{plan.num_microbatches} micro-batches{f', vpp {v}' if v > 1 else ''}; warned above "
                f"{100 * PIPELINE_IDLE_WARN:.0f} %)",
                f"parallel.global_batch={gb} ({m} micro-batches: "
                f"{100 * (par.pp - 1) / (v * m + par.pp - 1):.0f} % idle), or fewer stages",
                "pipeline_idle",
            )
        )
    out += _operations_issues(cfg)
    return out


def replica_dirs(cfg: Config) -> tuple[str, str]:
    """(train.checkpoint_replica_dir, the primary checkpoints), absolute (a relative replica is under run.dir)."""
    run_dir = os.path.abspath(cfg.run.dir)
    rep = cfg.train.checkpoint_replica_dir
    rep = rep if os.path.isabs(rep) else os.path.normpath(os.path.join(run_dir, rep))
    return rep, RunPaths(run_dir).checkpoints


def overlaps(rep: str, primary: str) -> bool:
    """Whether one directory is the other or inside it."""
    return rep == primary or rep.startswith(primary + os.sep) or primary.startswith(rep + os.sep)


def _operations_issues(cfg: Config) -> list:
    """train.nsys / nvtx and the checkpoint replica's place. Whether nsys is on PATH and whether run.dir and the
    replica sit on a shared file system are the launch gate's machine checks (launcher/launch/host_checks.py)."""
    from launcher.plan.issues import Issue

    out = []
    t, c = cfg.train, cfg.cluster
    world = c.nodes * c.gpus_per_node
    if t.nsys:
        if str(c.device) != "cuda":
            out.append(
                Issue(
                    "error",
                    "train.nsys",
                    "nsys profiles CUDA work: this is a CPU run",
                    "cluster.device=cuda, or train.nsys=false (train.nvtx=true counts the ranges on CPU)",
                )
            )
        if len(t.profile_steps) != 2:
            out.append(
                Issue(
                    "error",
                    "train.nsys",
                    "the capture range is train.profile_steps, which is not [first, last]",
                    "train.profile_steps=[5,7]",
                )
            )
        bad = [r for r in t.nsys_ranks if not 0 <= r < world]
        if bad or not t.nsys_ranks:
            out.append(
                Issue(
                    "error",
                    "train.nsys_ranks",
                    f"ranks {bad or '[]'} are not ranks of this {world}-rank job",
                    f"train.nsys_ranks=[0] (ranks 0..{world - 1})",
                )
            )
    if t.nvtx and str(c.device) != "cuda":
        out.append(
            Issue(
                "note",
                "train.nvtx",
                "a CPU build of torch has no NVTX: the ranges are counted into "
                "run.dir/profile/nvtx_rank<R>.json instead",
            )
        )
    if t.checkpoint_replica_dir:
        rep, primary = replica_dirs(cfg)
        if overlaps(rep, primary):
            out.append(
                Issue(
                    "error",
                    "train.checkpoint_replica_dir",
                    f"{rep} overlaps the primary checkpoints {primary}",
                    "train.checkpoint_replica_dir=<a directory on another disk or file system>",
                )
            )
    return out
