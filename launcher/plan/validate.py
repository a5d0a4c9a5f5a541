"""Every rule a layout must satisfy, checked at once; each violation names its fix.

`validate(cfg)` returns a `Report` with errors (the job must not run), warnings (legal but costly)
and notes (facts worth saying, like vocabulary padding), plus the plan when the structure allowed one.
No torch, no Hydra: the launcher calls it before anything is launched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from launcher.plan.cadence import cadence_problems
from launcher.plan.cluster_facts import KINDS
from launcher.plan.context_memory import more_cp
from launcher.plan.estimate import GIB, Plan, make_plan, with_parallel
from launcher.plan.issues import Issue
from launcher.plan.model_size import chunk_layers
from launcher.plan.settings import SELECTIVE_MIN_SAVING
from training.contract import layout_rules as rules
from training.contract.config import CHOICE_FIELDS, Config, choices, derived_dp
from training.contract.fp8_rules import fp8_rules
from training.contract.limits import MAX_SIZE, too_large
from training.contract.stage_split import NO_SPLIT, split_options, stage_split

# Allowed values of the choice fields: the Enums of training/contract/config.py (Hydra's schema already rejects
# anything else; this catches configs built in code, e.g. with dataclasses.replace). cluster.kind's are the kinds
# with a registered backend (launcher/plan/cluster_facts.py KINDS), read at each check: a kind is one registration.
CHOICES = {key: choices(key) for key in CHOICE_FIELDS if key not in ("action",)}

# Sizes that must be >= 1 (None means "derive" where the field is Optional).
POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.ffn_hidden_size",
    "model.seq_length",
    "model.vocab_size",
    "parallel.tp",
    "parallel.pp",
    "parallel.vpp",
    "parallel.cp",
    "parallel.dp",
    "parallel.micro_batch",
    "parallel.global_batch",
    "cluster.nodes",
    "cluster.gpus_per_node",
    "train.steps",
)


@dataclass
class Report:
    """The outcome of validation."""

    issues: list[Issue] = field(default_factory=list)
    """Every finding, in rule order."""
    plan: Plan | None = None
    """The plan, when the layout was consistent enough to compute one."""

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "warning"]

    @property
    def notes(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "note"]

    @property
    def no_fit(self) -> bool:
        return any(i.code == "no_fit" for i in self.errors)


def _get(obj: Any, dotted: str) -> Any:
    """The value at a dotted key below obj (the config, or one of its sections)."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _non_finite(obj, prefix: str = "") -> list[tuple[str, float]]:
    """Every float field of the config tree (lists included) that is NaN or infinite, by its key.

    Walks the dataclasses rather than listing keys, so a float field added later is covered too:
    `train.lr=nan` passes every `< 0` test (NaN compares false) and would train NaN weights."""
    found: list[tuple[str, float]] = []
    for f in fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            found += _non_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((key, value))
        elif isinstance(value, (list, tuple)):
            found += [(f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float) and not math.isfinite(v)]
    return found


def _check_numa_map(cfg: Config, out: list[Issue]) -> None:
    """cluster.numa=explicit: NUMA node ids are >= 0 (the launch gate checks a local run's entries against this
    machine's nodes, launcher/launch/host_checks.py; a Slurm rank checks its binding itself)."""
    c = cfg.cluster
    bad = [n for n in c.numa_map if n < 0] if c.numa == "explicit" else []
    if bad:
        out.append(
            Issue(
                "error",
                "cluster.numa_map",
                f"entries {bad} are not NUMA nodes of the node (NUMA node ids are >= 0)",
                "cluster.numa_map=[...] with ids from [0, ...], or cluster.numa=auto",
            )
        )


def _check_values(cfg: Config, out: list[Issue]) -> bool:
    """Enumerations and sizes; returns False when the sizes are too broken to go on."""
    _check_finite_and_choices(cfg, out)
    sizes_ok = _check_sizes(cfg, out)
    _check_train(cfg, out)
    _check_start(cfg, out)
    return sizes_ok


def _check_finite_and_choices(cfg: Config, out: list[Issue]) -> None:
    """Numbers that are finite, the names meshrun keeps for itself, and the choice fields' values."""
    for key, value in _non_finite(cfg):
        out.append(
            Issue(
                "error",
                key,
                f"must be a finite number, got {value}",
                f"{key}=<a finite number> (NaN and infinity poison every step that uses them)",
                "finite",
            )
        )
    from launcher.plan.safety import safety_problems  # reserved cluster.env names, profile window

    out += [Issue("error", key, message, fix, "trust") for key, message, fix in safety_problems(cfg)]
    for key, allowed in CHOICES.items():
        allowed = tuple(KINDS) if key == "cluster.kind" else allowed
        value = _get(cfg, key)
        if value not in allowed:
            out.append(
                Issue(
                    "error",
                    key,
                    f"{value!r} is not one of {', '.join(allowed)}",
                    f"{key}=<{'|'.join(allowed)}>",
                    "choice",
                )
            )


def _check_sizes(cfg: Config, out: list[Issue]) -> bool:
    """Sizes, ranges and the memory levers; returns False when the sizes are too broken to plan."""
    sizes_ok = True
    for key in POSITIVE:
        value = _get(cfg, key)
        if value is not None and value < 1:
            out.append(Issue("error", key, f"must be a positive integer, got {value}", f"{key}=1", "size"))
            sizes_ok = False
    for key, most in MAX_SIZE.items():
        problem = too_large(key, _get(cfg, key))
        if problem:
            out.append(Issue("error", key, problem, f"{key}={most}", "size"))
            sizes_ok = False
    m, c = cfg.model, cfg.cluster
    if not 0.0 <= m.dropout < 1.0:
        out.append(Issue("error", "model.dropout", f"must be in [0, 1), got {m.dropout}", "model.dropout=0.1"))
    if c.gpu_memory_gb <= 0:
        out.append(
            Issue("error", "cluster.gpu_memory_gb", f"must be > 0, got {c.gpu_memory_gb}", "cluster.gpu_memory_gb=80")
        )
        sizes_ok = False
    par_ = cfg.parallel
    levers = _issues(
        rules.memory_lever_rules(
            par_.zero,
            par_.recompute,
            par_.recompute_num_layers,
            rules.chunk_layer_count(cfg),
            str(par_.offload),
            par_.offload_dir,
        )
    )
    out += levers
    if any(i.code == "zero" and i.level == "error" for i in levers):
        sizes_ok = False  # no ZeRO stage to plan for
    if cfg.parallel.bucket_mb <= 0:
        out.append(
            Issue("error", "parallel.bucket_mb", f"must be > 0, got {cfg.parallel.bucket_mb}", "parallel.bucket_mb=4")
        )
    return sizes_ok


def _check_train(cfg: Config, out: list[Issue]) -> None:
    """The training loop's settings: rates and intervals, the LR schedule, checkpoints and logs (a C++ compiler
    for train.compile on CPU is the launch gate's machine check, launcher/launch/host_checks.py)."""
    t = cfg.train
    for key in (
        "lr",
        "min_lr",
        "warmup_steps",
        "weight_decay",
        "grad_clip",
        "checkpoint_every",
        "exit_interval",
        "exit_after_min",
        "log_every",
    ):
        if _get(t, key) < 0:
            out.append(Issue("error", f"train.{key}", f"must be >= 0, got {_get(t, key)}", f"train.{key}=0"))
    from training.contract.lr_schedule import schedule_problems  # pure Python: the engine checks the same at start-up

    out += [Issue("error", key, message, fix) for key, message, fix in schedule_problems(t)]
    if not t.checkpointing:  # a run that writes no checkpoint cannot also save by step, stop-and-save, or resume
        for key, bad in (
            ("checkpoint_every", t.checkpoint_every > 0),
            ("exit_interval", t.exit_interval > 0),
            ("exit_after_min", t.exit_after_min > 0),
        ):
            if bad:
                out.append(
                    Issue(
                        "error",
                        f"train.{key}",
                        "saves a checkpoint, but train.checkpointing=false writes none",
                        f"train.{key}=0 or train.checkpointing=true",
                    )
                )
    # train.checkpoint_every_min is minutes or auto (a string field): launcher/plan/cadence.py parses it.
    out += [Issue("error", key, message, fix, "cadence") for key, message, fix in cadence_problems(cfg)]
    if t.log_every < 1:
        out.append(Issue("error", "train.log_every", f"must be >= 1, got {t.log_every}", "train.log_every=1"))
    if t.keep_last < 1:
        out.append(Issue("error", "train.keep_last", f"must be >= 1, got {t.keep_last}", "train.keep_last=3"))


def _check_start(cfg: Config, out: list[Issue]) -> None:
    """How the ranks start: their NUMA binding, the rendezvous (timeout, port), this machine's cores, and what
    they resume from."""
    t, c = cfg.train, cfg.cluster
    if c.numa == "explicit" and len(c.numa_map) != c.gpus_per_node:
        out.append(
            Issue(
                "error",
                "cluster.numa_map",
                f"numa=explicit needs one NUMA node per local rank ({c.gpus_per_node}), got {len(c.numa_map)}",
                f"cluster.numa_map=[{','.join(['0'] * max(c.gpus_per_node, 1))}] or cluster.numa=auto",
            )
        )
    if not t.dist_timeout_s > 0:
        out.append(
            Issue(
                "error",
                "train.dist_timeout_s",
                f"must be > 0 seconds, got {t.dist_timeout_s}",
                "train.dist_timeout_s=600",
            )
        )
    if c.master_port != 0 and not 1024 <= c.master_port <= 65535:
        out.append(
            Issue(
                "error",
                "cluster.master_port",
                f"must be 0 (pick one) or an unprivileged port 1024-65535, got {c.master_port}",
                "cluster.master_port=0",
            )
        )
    _check_numa_map(cfg, out)
    if str(t.resume) not in ("auto", "none") and not str(t.resume).isdigit():
        out.append(
            Issue("error", "train.resume", f"{t.resume!r} is not auto, none or a step number", "train.resume=auto")
        )


def _check_model(cfg: Config, out: list[Issue]) -> None:
    m = cfg.model
    out += _issues(rules.model_rules(m))
    if m.num_experts > 0 and not m.moe_aux_loss_coeff >= 0:  # the rest of the MoE rules: layout_rules.moe_rules
        out.append(
            Issue(
                "error",
                "model.moe_aux_loss_coeff",
                f"must be >= 0 (0: no balance loss), got {m.moe_aux_loss_coeff}",
                "model.moe_aux_loss_coeff=0.01",
            )
        )
    if cfg.data.kind == "text" and m.vocab_size < 256:
        out.append(
            Issue(
                "error",
                "model.vocab_size",
                f"data.kind=text tokenizes to bytes and needs vocab_size >= 256, got {m.vocab_size}",
                "model.vocab_size=256 or data=synthetic",
            )
        )


def _issues(violations: list[rules.Violation]) -> list[Issue]:
    """The layout rules' verdicts (training/contract/layout_rules.py, which the engine checks too) as Issues."""
    return [Issue(v.level, v.key, v.message, v.fix, v.code) for v in violations]


def _check_layout(cfg: Config, out: list[Issue]) -> bool:
    """Parallel layout rules (training/contract/layout_rules.py) plus the cluster's; False when no plan can be computed."""
    start = len(out)
    ok = _check_widths(cfg, out)
    ok = _check_world(cfg, out) and ok
    ok = _check_data_parallel(cfg, out) and ok
    if cfg.train.precision == "fp16" and cfg.cluster.device == "cpu":
        out.append(
            Issue(
                "warning",
                "train.precision",
                "fp16 on CPU is slow and only useful to test loss scaling",
                "train.precision=fp32 or bf16",
            )
        )
    return ok and not any(i.code in rules.BLOCKS_PLAN for i in out[start:] if i.level == "error")


def _check_widths(cfg: Config, out: list[Issue]) -> bool:
    """Each dimension's own rules: tp (and the vocabulary padding it needs), the stage split and schedule, sp and
    cp; False when cp's rules leave no plan."""
    m, par, c = cfg.model, cfg.parallel, cfg.cluster
    t, p, v, cp = par.tp, par.pp, par.vpp, par.cp
    s = m.seq_length
    out += _issues(rules.tp_rules(m, t, rules.valid_tp(cfg)))
    pv = rules.padded_vocab(m.vocab_size, t)
    if pv != m.vocab_size:
        out.append(
            Issue(
                "note",
                "model.vocab_size",
                f"vocab {m.vocab_size} padded to {pv} (+{pv - m.vocab_size} rows) for tp={t}; padded rows never"
                " change the loss",
            )
        )
    if t > c.gpus_per_node and not par.allow_tp_across_nodes:
        out.append(
            Issue(
                "error",
                "parallel.tp",
                f"tp={t} exceeds the {c.gpus_per_node} GPUs of a node: TP would cross the slow interconnect",
                f"parallel.tp={c.gpus_per_node} (use pp across nodes) or parallel.allow_tp_across_nodes=true",
            )
        )
    out += _issues(rules.split_layer_rules(cfg))
    out += _issues(rules.schedule_rules(par.schedule, p, v))
    out += _issues(rules.zero_bubble_rules(par.schedule, par.zero))
    out += _issues(rules.sp_rules(par.sp, t, s))
    cp_issues = _issues(rules.cp_rules(cp, s, t, par.sp, m.dropout, getattr(par, "cp_comm", "ring")))
    for i in cp_issues:  # dropout only stops training: a plan of the layout still holds
        if i.code == "cp_dropout" and cfg.action != "train":
            i.level = "warning"
    out += cp_issues
    return not any(i.level == "error" and i.key == "parallel.cp" for i in cp_issues)


def _check_world(cfg: Config, out: list[Issue]) -> bool:
    """tp x pp x cp x dp against the cluster's ranks; False when they do not match."""
    par, c = cfg.parallel, cfg.cluster
    t, p, cp = par.tp, par.pp, par.cp
    ranks = c.nodes * c.gpus_per_node
    mp = t * p * cp
    ok = True
    if par.dp is not None:
        if mp * par.dp != ranks:
            need = mp * par.dp
            out.append(
                Issue(
                    "error",
                    "parallel.dp",
                    f"tp x pp x cp x dp = {t} x {p} x {cp} x {par.dp} = {need} but the cluster has "
                    f"{c.nodes} x {c.gpus_per_node} = {ranks} ranks",
                    (f"parallel.dp={ranks // mp} or " if ranks % mp == 0 else "")
                    + f"cluster.nodes x cluster.gpus_per_node = {need}"
                    + (f" (e.g. cluster.nodes={need // c.gpus_per_node})" if need % c.gpus_per_node == 0 else ""),
                    "world",
                )
            )
            ok = False
    elif ranks % mp:
        out.append(
            Issue(
                "error",
                "parallel.dp",
                f"the cluster's {ranks} ranks are not divisible by tp x pp x cp = {mp}",
                _world_fix(cfg, mp),
                "world",
            )
        )
        ok = False
    return ok


def _check_data_parallel(cfg: Config, out: list[Issue]) -> bool:
    """At the derived data-parallel width: the MoE and FP8 rules, the batch arithmetic and ZeRO's sharding; False
    when the world leaves no data-parallel width."""
    m, par = cfg.model, cfg.parallel
    t, p, cp = par.tp, par.pp, par.cp
    dp = derived_dp(cfg)
    out += _issues(rules.moe_rules(m, getattr(par, "ep", 1), dp, t, cp, par.zero))  # mixture of experts, parallel.ep
    out += _issues(fp8_rules(cfg))  # train.precision=fp8: widths, recipe, torchao installed
    if dp >= 1:
        unit = par.micro_batch * dp
        batch = _issues(rules.batch_rules(par.global_batch, par.micro_batch, dp))
        out += batch
        if not batch:
            mb = par.global_batch // unit
            out += _issues(rules.interleaved_batch_rules(par.schedule, p, mb, unit, par.microbatch_group_size))
            if par.schedule == "1f1b" and p > 1 and mb < p:
                out.append(
                    Issue(
                        "warning",
                        "parallel.global_batch",
                        f"1f1b with {mb} micro-batches for {p} stages: bubble "
                        f"{(p - 1) / (mb + p - 1):.0%} of the wall clock",
                        f"parallel.global_batch={p * unit} or more (>= pp micro-batches)",
                    )
                )
        if par.zero >= 1 and dp == 1:
            out.append(
                Issue(
                    "warning",
                    "parallel.zero",
                    f"zero={par.zero} with dp=1 shards nothing (one data-parallel rank)",
                    "parallel.zero=0 (or a layout with dp > 1)",
                )
            )
        return True
    return False


def _world_fix(cfg: Config, mp: int) -> str:
    """Typeable: the GPUs per node (the fewest at or above today's) that tp x pp x cp divides, or a layout that
    divides today's ranks."""
    c = cfg.cluster
    step = mp // math.gcd(mp, max(c.nodes, 1))
    gpn = -(-c.gpus_per_node // step) * step
    par = cfg.parallel
    ranks = c.nodes * c.gpus_per_node
    alt = ""
    for key in ("cp", "pp", "tp"):
        size = getattr(par, key)
        others = mp // size
        for smaller in range(size - 1, 0, -1):
            if ranks % (others * smaller) == 0:
                alt = f", or parallel.{key}={smaller}"
                break
        if alt:
            break
    return f"cluster.gpus_per_node={gpn} (tp x pp x cp = {mp} must divide the ranks){alt}"


def changed_keys(cfg: Config, new: Config) -> str:
    """The parallel.* keys new changes from cfg, as typed on a command line (parallel.pp=4 parallel.dp=2)."""
    out = []
    for f in fields(new.parallel):
        before, after = getattr(cfg.parallel, f.name), getattr(new.parallel, f.name)
        if before != after:
            value = getattr(after, "value", after)
            out.append(f"parallel.{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(out)


NO_COMBINATION = "cluster.nodes=<more>"
"""The no-fit fix when no combination of the levers fits; launcher/launch/gate.py names the node count."""


# The fixes tried when a model does not fit, cheapest first: (label, change) pairs.
def _fix_candidates(cfg: Config) -> list[tuple[str, Callable[[Config], Config | None]]]:
    L = cfg.model.num_layers

    def sp(c: Config):
        t = c.parallel.tp
        return with_parallel(c, sp=True) if t > 1 and not c.parallel.sp and c.model.seq_length % t == 0 else None

    def zero(c: Config):
        return with_parallel(c, zero=1) if c.parallel.zero == 0 and derived_dp(c) > 1 else None

    def zero2(c: Config):
        return with_parallel(c, zero=2) if c.parallel.zero < 2 and derived_dp(c) > 1 else None

    def zero3(c: Config):  # not with experts: the engine does not gather expert weights per unit (moe_rules)
        ok = c.parallel.zero < 3 and derived_dp(c) > 1 and c.model.num_experts == 0
        return with_parallel(c, zero=3) if ok else None

    def offload(kind: str):
        def change(c: Config):
            if str(c.parallel.offload) != "none" and (kind == "cpu" or str(c.parallel.offload) == "nvme"):
                return None
            if kind == "cpu":
                return with_parallel(c, offload=kind)
            return with_parallel(c, offload=kind, offload_dir=c.parallel.offload_dir or "<node-local dir>")

        return change

    def partial_recompute(c: Config):
        """recompute=full on only as many layers per chunk as it takes (the fewest recomputed that fit)."""
        if c.parallel.recompute == "full" and getattr(c.parallel, "recompute_num_layers", 0) == 0:
            return None
        # Memory falls as more layers are recomputed: the fewest that fit, by bisection (a plan per candidate
        # count took minutes for a deep model).
        lo, hi, best = 1, chunk_layers(c) - 1, None
        while lo <= hi:
            n = (lo + hi) // 2
            new = with_parallel(c, recompute="full", recompute_num_layers=n)
            if make_plan(new).fits:
                best, hi = new, n - 1
            else:
                lo = n + 1
        return best

    def selective(c: Config):
        return with_parallel(c, recompute="selective") if c.parallel.recompute == "none" else None

    def full(c: Config):
        return with_parallel(c, recompute="full") if c.parallel.recompute != "full" else None

    def micro(c: Config):
        return with_parallel(c, micro_batch=1) if c.parallel.micro_batch > 1 else None

    def more_pp(c: Config):
        d = derived_dp(c)
        p2 = c.parallel.pp * 2
        if d % 2 or p2 > L or (d // 2) % getattr(c.parallel, "ep", 1):
            return None
        new = with_parallel(c, pp=p2, dp=(d // 2) if c.parallel.dp is not None else None)
        if rules.split_layer_rules(new):  # the layers do not divide at 2 pp: the split that does (stage_split.py)
            options = split_options(L, p2, stage_split(new).vpp)
            if not options:
                return None
            new = with_parallel(new, **{**NO_SPLIT, **options[0]})
        return new if new.parallel.global_batch % (new.parallel.micro_batch * (d // 2)) == 0 else None

    def more_tp(c: Config):
        d = derived_dp(c)
        t2 = c.parallel.tp * 2
        m = c.model
        if d % 2 or t2 > c.cluster.gpus_per_node or m.num_attention_heads % t2 or m.query_groups % t2 or m.ffn % t2:
            return None
        if (d // 2) % getattr(c.parallel, "ep", 1) or (m.moe_ffn_hidden_size or m.ffn) % t2:
            return None  # ep must still divide dp, and tp the expert width (moe_rules)
        return with_parallel(c, tp=t2, dp=(d // 2) if c.parallel.dp is not None else None)

    return [
        ("parallel.sp=true", sp),
        ("parallel.zero=1", zero),
        ("parallel.zero=2", zero2),
        ("parallel.recompute=selective", selective),
        ("parallel.micro_batch=1", micro),
        ("parallel.recompute=full parallel.recompute_num_layers=N", partial_recompute),
        ("parallel.recompute=full", full),
        ("parallel.zero=3", zero3),
        ("parallel.offload=cpu", offload("cpu")),
        ("parallel.offload=nvme parallel.offload_dir=<node-local dir>", offload("nvme")),
        ("parallel.pp x 2 (dp / 2)", more_pp),
        ("parallel.tp x 2 (dp / 2)", more_tp),
        # Context parallelism for activation-bound layouts at long sequences (launcher/plan/context_memory.py).
        (
            "parallel.cp x 2 (dp / 2)",
            lambda c: (
                None
                if c.model.num_experts > 0
                # experts: cp=1 (moe_rules)
                else more_cp(c, derived_dp(c), make_plan(c).memory_bytes)
            ),
        ),
    ]


def fit_fixes(cfg: Config, plan: Plan) -> list[str]:
    """Each candidate fix alone (with the memory it gives), then the cumulative combination that fits first."""
    lines = []
    fitting = []
    cands = _fix_candidates(cfg)
    for label, change in cands:
        new = change(cfg)
        if new is None:
            continue
        pl = make_plan(new)
        if pl.memory_bytes["total"] > plan.memory_bytes["total"] * (1 - SELECTIVE_MIN_SAVING):
            continue  # offer only fixes that change the plan (selective recompute under flash attention does not)
        label = label.replace("recompute_num_layers=N", f"recompute_num_layers={new.parallel.recompute_num_layers}")
        if " x 2" in label:  # more pp, tp or cp: the keys as typed (parallel.pp=4 parallel.dp=2)
            label = changed_keys(cfg, new)
        lines.append(f"{label}: {pl.memory_bytes['total'] / GIB:.2f} GiB" + (" (fits)" if pl.fits else ""))
        if pl.fits:
            fitting.append(label)
    if not fitting:
        cur = cfg
        for _label, change in cands:
            new = change(cur)
            if new is None:
                continue
            cur = new
            pl = make_plan(cur)
            if pl.fits:
                lines.append(f"together: {changed_keys(cfg, cur)}: {pl.memory_bytes['total'] / GIB:.2f} GiB (fits)")
                break
        else:
            lines.append(f"{NO_COMBINATION} (no combination of these fits: more GPUs for more pp or tp)")
    return lines


def validate(cfg: Config, cluster_checks: Callable[[Config], list[Issue]] | None = None) -> Report:
    """Check every rule; plan when the layout allows it; add the no-fit error with its breakdown and fixes.

    cluster_checks: the launch's own rules (launcher/launch/gate.py launch_checks: the Slurm backend's sbatch
    safety, and the checks against the machines: NUMA nodes, cores, tools on PATH, datasets, shared file systems),
    so one run lists every violation at once; the planner itself reads only the configuration."""
    issues: list[Issue] = []
    sizes_ok = _check_values(cfg, issues)
    if cluster_checks is not None:
        issues += cluster_checks(cfg)
    if not sizes_ok:
        return Report(issues)
    _check_model(cfg, issues)
    layout_ok = _check_layout(cfg, issues)
    report = Report(issues)
    if (
        not layout_ok
        or any(i.key in ("model.hidden_size", "model.num_query_groups") for i in report.errors)
        or any(i.code == "choice" for i in report.errors)
    ):
        return report
    plan = make_plan(cfg)
    report.plan = plan
    from launcher.plan.settings import setting_issues  # keys that would not do what they say

    issues += setting_issues(cfg, plan)
    if not plan.fits:
        mem = plan.memory_bytes
        breakdown = ", ".join(f"{k} {mem[k] / GIB:.2f}" for k in ("weights", "grads", "optimizer", "activations"))
        issues.append(
            Issue(
                "error",
                "cluster.gpu_memory_gb",
                f"the worst GPU (pipeline stage {plan.worst_stage}) needs {mem['total'] / GIB:.2f} GiB ({breakdown} GiB)"
                + (
                    f" + {plan.reserve_bytes / GIB:.2f} GiB kept back (CUDA context, NCCL buffers, fragmentation, "
                    f"zero=1/2 parameter gather)"
                    if plan.reserve_bytes
                    else ""
                )
                + f" but has {plan.gpu_memory_bytes / GIB:.2f} GiB (cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g})",
                "; ".join(fit_fixes(cfg, plan)),
                "no_fit",
            )
        )
    return report
