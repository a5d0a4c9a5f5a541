"""`meshrun action=recommend`: every valid layout of the model on the cluster, ranked by predicted step time.

Searches tp, pp, vpp, micro-batch, sp, recompute and zero at the cluster's world size and the configured global
batch, with an uneven pipeline split where the layers do not divide evenly over pp x vpp
(training/contract/stage_split.py split_options; training/contract/layout_rules.py decides what is valid, launcher/plan/estimate.py what fits, and
launcher/plan/cost_model.py how long a step takes), prints the fastest layouts that fit with tokens/s per GPU,
MFU and why each wins or loses, compares them with the configured layout, and writes run.dir/recommend.json.
recommend.calibrate=true runs the top candidates here for a few steps (launcher/launch/calibrate.py). No torch: on CPU
clusters the rates are measured by a subprocess (python -m training.observe.cost_probe).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from launcher.plan.cluster_facts import cluster_facts
from launcher.plan.context_memory import search_cp
from launcher.plan.cost_model import Rates, cluster_rates, spans_nodes
from launcher.plan.estimate import GIB, Plan, fmt_seconds, make_plan
from launcher.plan.levers import search_recompute, search_zero_stages
from launcher.plan.model_size import chunk_layers
from launcher.plan.plan_cache import PlanCache
from launcher.plan.validate import validate
from training.contract import layout_rules as rules
from training.contract.config import Config, derived_dp
from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID
from training.contract.layout_text import Layout, format_layout, layout_of
from training.contract.rundir.paths import RunPaths
from training.contract.stage_split import NO_SPLIT, SPLIT_KEYS, StageSplit, split_options

PARALLEL_KEYS = (
    "tp",
    "pp",
    "vpp",
    "dp",
    "cp",
    "sp",
    "zero",
    "micro_batch",
    "global_batch",
    "schedule",
    "recompute",
    "recompute_num_layers",
    "offload",
    *SPLIT_KEYS,
)
WITHIN = 0.10
"""The recommended layout is 'as good as' the configured one when its predicted step is within this fraction."""


@dataclass
class Candidate:
    """One layout and its prediction."""

    cfg: Config
    plan: Plan
    reason: str = ""
    rank: int = 0
    measured_step_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.plan.predicted_step_s

    @property
    def parts(self) -> dict[str, float]:
        return self.plan.predicted_step_parts_s

    def layout(self) -> dict[str, Any]:
        p = self.cfg.parallel
        d = {k: getattr(p, k) for k in PARALLEL_KEYS}
        d["dp"] = self.plan.dp
        if self.cfg.model.num_experts > 0:  # a mixture of experts: its expert-parallel degree too
            d["ep"] = getattr(p, "ep", 1)
        return {k: (str(v) if k in ("schedule", "recompute", "offload") else v) for k, v in d.items()}

    def overrides(self) -> str:
        # Every layout key, cp and dp included (training/contract/layout_text.py): the line is pasted after
        # whatever the user gave.
        text = format_layout(self._layout(), "overrides")
        return text + (" parallel.allow_tp_across_nodes=true" if self.cfg.parallel.allow_tp_across_nodes else "")

    def short(self) -> str:
        return format_layout(self._layout(), "short")

    def _layout(self) -> Layout:
        return layout_of(self.cfg, dp=self.plan.dp)


@dataclass
class Search:
    """The outcome of a search."""

    candidates: list[Candidate] = field(default_factory=list)
    """Every layout that fits, fastest first."""
    no_fit: list[Candidate] = field(default_factory=list)
    """The fastest layouts that do not fit (one per tp/pp/vpp/zero whose leanest variant does not fit)."""
    searched: int = 0
    valid: int = 0


# --------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: Config) -> Iterator[Config]:
    """Every layout of cfg's model on cfg's cluster that the layout rules accept; tp beyond a node only up to
    twice the node (to show what TP across nodes costs); cp > 1 at long sequences (context_memory.search_cp); pp
    up to the layers, uneven where they do not divide (split_options)."""
    m, c = cfg.model, cfg.cluster
    world, L = c.nodes * c.gpus_per_node, m.num_layers
    for tp in _divisors(world):
        if tp > 2 * c.gpus_per_node or rules.tp_rules(m, tp):
            continue
        for pp in _divisors(world // tp):
            if pp > L or not split_options(L, pp, 1):
                continue
            for sp in [False, True] if tp > 1 and m.seq_length % tp == 0 else [False]:
                for cp in search_cp(cfg, tp, sp, world // (tp * pp)):
                    yield from _layouts_at(cfg, tp, pp, sp, cp, world // (tp * pp * cp))


def search_ep(cfg: Config, dp: int) -> list[int]:
    """The expert-parallel degrees tried at dp data-parallel ranks: 1 for a dense model, else every ep dividing
    both the experts and dp (training/contract/layout_rules.py moe_rules)."""
    E = cfg.model.num_experts
    return [e for e in _divisors(dp) if E % e == 0] if E > 0 else [1]


def _layouts_at(cfg: Config, tp: int, pp: int, sp: bool, cp: int, dp: int) -> Iterator[Config]:
    """The batch, virtual-stage, zero, recompute and (mixture of experts) ep variants of one tp x pp x cp x dp
    (x sp) layout."""
    for ep in search_ep(cfg, dp):
        lay = _with(cfg, ep=ep) if cfg.model.num_experts > 0 else cfg
        yield from _dense_layouts_at(lay, tp, pp, sp, cp, dp)


def _dense_layouts_at(cfg: Config, tp: int, pp: int, sp: bool, cp: int, dp: int) -> Iterator[Config]:
    """The batch, virtual-stage, zero and recompute variants of one tp x pp x cp x dp (x sp) layout."""
    m, c, par = cfg.model, cfg.cluster, cfg.parallel
    B, L = par.global_batch, m.num_layers
    if B % dp:
        return
    # Virtual stages: the divisors of the even share, or where the layers do not divide by pp, those of the share
    # with the embedding and the loss counted as layers ((L + 1) or (L + 2) / pp); each with its splits.
    shares = {L // pp} if L % pp == 0 else {n // pp for n in (L + 1, L + 2) if n % pp == 0}
    virtual = sorted({v for n in shares for v in _divisors(n) if v > 1}) if pp > 1 else []
    # A split the configuration sets (the command line's) is kept wherever it divides the layers.
    given = {k: getattr(par, k) for k in SPLIT_KEYS if getattr(par, k)}
    splits = {
        v: [given] if given and StageSplit(L, pp, v, **given).counts() else split_options(L, pp, v)
        for v in [1, *virtual]
    }
    for mb in [d for d in _divisors(B // dp) if d <= cfg.recommend.max_micro_batch]:
        micro_batches = B // (dp * mb)
        vpps = [1] + [v for v in virtual if micro_batches % pp == 0 and splits[v]]
        for vpp, split in ((v, keys) for v in vpps for keys in splits[v]):
            for zero in [0, 1] if dp * cp > 1 else [0]:
                for recompute in ("none", "selective", "full"):
                    yield _with(
                        cfg,
                        **{**NO_SPLIT, **split},
                        tp=tp,
                        pp=pp,
                        vpp=vpp,
                        cp=cp,
                        dp=None,
                        sp=sp,
                        zero=zero,
                        micro_batch=mb,
                        schedule="interleaved_1f1b" if vpp > 1 else "1f1b",
                        recompute=recompute,
                        recompute_num_layers=0,
                        allow_tp_across_nodes=tp > c.gpus_per_node,
                    )


def _with(lay: Config, **changes) -> Config:
    """lay with some parallel fields changed: dataclasses.replace's result, without its walk over the fields on
    every call (the search builds thousands of layouts). Every field of both classes is an __init__ argument, so
    the instance's fields are the constructor's arguments (__post_init__ runs as under replace)."""
    par = type(lay.parallel)(**{**vars(lay.parallel), **changes})
    return type(lay)(**{**vars(lay), "parallel": par})


def _lean(lay: Config) -> Config:
    p = lay.parallel
    return _with(
        lay, sp=p.tp > 1 and lay.model.seq_length % p.tp == 0, recompute="full", recompute_num_layers=0, micro_batch=1
    )


def _deeper_zero(lay: Config, rates: Rates, cache: PlanCache | None = None) -> Candidate | None:
    """The first higher ZeRO stage (2, then 3), then offload (cpu, nvme) at which a zero=1 (or dp=1) layout that
    does not fit fits: never faster in the cost model (more traffic, a host-side update), so only tried where
    the layout runs out of memory."""
    tries = [dict(zero=z) for z in search_zero_stages(derived_dp(lay) * lay.parallel.cp) if z > lay.parallel.zero >= 1]
    top = tries[-1]["zero"] if tries else lay.parallel.zero
    tries += [dict(zero=top, offload=o) for o in ("cpu", "nvme")]  # then the optimizer state off the GPU
    for changes in tries:
        new = _with(lay, **changes)
        if any(v.level == "error" for v in rules.layout_violations(new, derived_dp(new))):
            continue  # a stage the engine does not run for this model (zero=3 with experts)
        if changes.get("offload") == "nvme" and not new.parallel.offload_dir:
            new = _with(new, offload_dir="/local/nvme")  # a placeholder the user replaces (printed with it)
        plan = make_plan(new, rates=rates, cache=cache)
        if fits_with_headroom(plan, lay):
            return Candidate(new, plan)
    return None


def _partial_recompute(lay: Config, rates: Rates, cache: PlanCache | None = None) -> list[Candidate]:
    """Under recompute=full, the fastest variant recomputing only the first N layers of each chunk that still
    fits (fewest N first: less recomputation, more activation memory)."""
    for recompute, n in search_recompute(chunk_layers(lay)):
        if recompute == "full" and n > 0:
            new = _with(lay, recompute_num_layers=n)
            plan = make_plan(new, rates=rates, cache=cache)
            if fits_with_headroom(plan, lay):
                return [Candidate(new, plan)]
    return []


def _states_could_fit(plan: Plan) -> bool:
    """Whether the layout could fit with no model states on the device at all (else no ZeRO stage or offload
    can make it fit: no plan needed to know)."""
    mem = plan.memory_bytes
    return mem["total"] - mem["weights"] - mem["grads"] - mem["optimizer"] <= plan.gpu_memory_bytes


def fits_with_headroom(plan: Plan, cfg: Config) -> bool:
    """Fits and leaves recommend.min_headroom_gb (GiB, 2^30 bytes) free for what the plan does not count
    (allocator fragmentation, NCCL buffers, the CUDA context)."""
    return plan.fits and plan.headroom_bytes >= cfg.recommend.min_headroom_gb * 2**30


def search(cfg: Config, rates: Rates) -> Search:
    """Plan every layout; those whose leanest variant (sp, full recompute, micro-batch 1) does not fit are
    skipped as a group. A zero=1 layout that does not fit is tried at zero=2 and 3, and one that fits under
    recompute=full also with recompute_num_layers (launcher/plan/levers.py's choices)."""
    out = Search()
    cache = PlanCache(cfg)  # every layout below shares cfg's model, train and cluster
    lean_fits: dict[tuple, bool] = {}
    none_fits: dict[tuple, bool] = {}  # recompute=none fits at these other settings: partial recompute is slower
    for lay in layouts(cfg):
        out.searched += 1
        p = lay.parallel
        if any(v.level == "error" for v in rules.layout_violations(lay, derived_dp(lay))):
            continue
        out.valid += 1
        group = (p.tp, p.pp, p.vpp, p.zero, p.cp, getattr(p, "ep", 1), *(getattr(p, k) for k in SPLIT_KEYS))
        if group not in lean_fits:
            lean_fits[group] = make_plan(_lean(lay), rates=rates, cache=cache).fits
            if not lean_fits[group] and (p.zero == 1 or derived_dp(lay) == 1):
                lean_fits[group] = _deeper_zero(_lean(lay), rates, cache) is not None
            if not lean_fits[group]:
                out.no_fit.append(Candidate(lay, make_plan(lay, rates=rates, cache=cache)))
        if not lean_fits[group]:
            continue
        plan = make_plan(lay, rates=rates, cache=cache)
        if not fits_with_headroom(plan, cfg) and (p.zero == 1 or derived_dp(lay) == 1) and _states_could_fit(plan):
            deeper = _deeper_zero(lay, rates, cache)
            if deeper is not None:
                lay, plan = deeper.cfg, deeper.plan
        fits = fits_with_headroom(plan, cfg)
        (out.candidates if fits else out.no_fit).append(Candidate(lay, plan))
        others = (
            p.tp,
            p.pp,
            p.vpp,
            p.sp,
            p.zero,
            p.micro_batch,
            getattr(p, "ep", 1),
            *(getattr(p, k) for k in SPLIT_KEYS),
        )
        if p.recompute == "none":
            none_fits[others] = fits
        if fits and lay.parallel.recompute == "full" and not none_fits.get(others, False):
            out.candidates += _partial_recompute(lay, rates, cache)
    out.candidates.sort(key=lambda c: (c.step_s, c.plan.memory_bytes["total"]))
    out.no_fit.sort(key=lambda c: c.step_s)
    for i, cand in enumerate(out.candidates, 1):
        cand.rank = i
    return out


# --------------------------------------------------------------------------------------------------
# Why a layout wins or loses
# --------------------------------------------------------------------------------------------------


def _part_words(cand: Candidate, part: str) -> str:
    p, plan, c = cand.cfg.parallel, cand.plan, cand.cfg.cluster
    if part == "bubble":
        return f"bubble (pp {plan.pp}, {plan.num_microbatches} micro-batches" + (
            f", vpp {plan.vpp})" if plan.vpp > 1 else ")"
        )
    if part == "tp":
        return "TP traffic" + (" across nodes" if spans_nodes(1, p.tp, c.gpus_per_node) else "") + f" (tp {p.tp})"
    if part == "dp":
        return (
            "DP traffic"
            + (" across nodes" if spans_nodes(p.tp * p.pp, plan.dp, c.gpus_per_node) else "")
            + f" (dp {plan.dp}"
            + (f", ZeRO-{p.zero})" if p.zero else ")")
        )
    if part == "ep":
        return (
            "expert all-to-all"
            + (" across nodes" if spans_nodes(p.tp * p.cp * p.pp, p.ep, c.gpus_per_node) else "")
            + f" (ep {p.ep})"
        )
    if part == "pp":
        return "pipeline sends" + (" across nodes" if spans_nodes(p.tp, p.pp, c.gpus_per_node) else "")
    if part == "recompute":
        return f"recompute={p.recompute}" + (
            f" ({p.recompute_num_layers} layers per chunk)" if p.recompute == "full" and p.recompute_num_layers else ""
        )
    if part == "compute":
        return f"compute (micro-batch {p.micro_batch}, tp {p.tp})"
    if part == "shared_cores":
        return f"{plan.world_size} ranks on fewer cores"
    return part


def _base_compute(parts: dict[str, float]) -> dict[str, float]:
    d = dict(parts)
    d["compute"] = d.get("compute", 0.0) - d.get("recompute", 0.0)
    return d


def explain(cand: Candidate, ref: Candidate, top: int = 2) -> list[str]:
    """The parts in which cand is slower than ref, largest first, in words with the seconds."""
    a, b = _base_compute(cand.parts), _base_compute(ref.parts)
    diffs = sorted(((a.get(k, 0.0) - b.get(k, 0.0), k) for k in a if k != "total"), reverse=True)
    return [f"{_part_words(cand, k)} +{fmt_seconds(d)}" for d, k in diffs[:top] if d > 1e-3 * max(ref.step_s, 1e-9)]


def annotate(result: Search) -> None:
    """Each candidate's reason: the winner against the runner-up and the memory limit, the others against it."""
    cands = result.candidates
    if not cands:
        return
    best = cands[0]
    words = []
    if len(cands) > 1:
        ahead = explain(cands[1], best)
        words.append("ahead of #2 on " + ", ".join(ahead) if ahead else "ties with #2")
    faster = [c for c in result.no_fit if c.step_s < best.step_s]
    if faster:
        f = faster[0]
        words.append(
            f"memory: {f.short()} would take {fmt_seconds(f.step_s)} but needs "
            f"{f.plan.memory_bytes['total'] / GIB:.1f} GiB of {f.plan.gpu_memory_bytes / GIB:.1f}"
        )
    best.reason = "fastest; " + "; ".join(words) if words else "fastest"
    for c in cands[1:]:
        lost = explain(c, best)
        pct = 100 * (c.step_s / best.step_s - 1)
        c.reason = f"+{pct:.1f} %: " + (", ".join(lost) if lost else "same parts, smaller margins")
    for c in result.no_fit:
        c.reason = (
            f"does not fit: {c.plan.memory_bytes['total'] / GIB:.1f} GiB of {c.plan.gpu_memory_bytes / GIB:.1f} GiB"
        )
        if c.plan.fits:
            c.reason += f" with recommend.min_headroom_gb={c.cfg.recommend.min_headroom_gb:g} GiB free"


def _tokens_per_gpu(c: Candidate) -> float:
    return c.plan.tokens_per_step / c.step_s / c.plan.world_size if c.step_s > 0 else 0.0


def _mfu(c: Candidate, peak: float) -> float:
    return c.plan.model_flops_per_step / (c.step_s * c.plan.world_size * peak) if c.step_s > 0 else 0.0


def candidate_json(c: Candidate, peak: float) -> dict[str, Any]:
    return {
        **c.layout(),
        "rank": c.rank,
        "predicted_step_s": c.step_s,
        "fits": c.plan.fits,
        "predicted_parts_s": c.parts,
        "tokens_per_s_per_gpu": _tokens_per_gpu(c),
        "mfu": _mfu(c, peak),
        "memory_bytes": c.plan.memory_bytes["total"],
        "gpu_memory_bytes": c.plan.gpu_memory_bytes,
        "reason": c.reason,
        "overrides": c.overrides(),
        **({"measured_step_s": c.measured_step_s} if c.measured_step_s is not None else {}),
    }


def versus_baseline(best: Candidate, base: Candidate) -> dict[str, Any]:
    """How the recommended layout compares with the configured one, and why they differ."""
    gain = 1 - best.step_s / base.step_s if base.step_s > 0 else 0.0
    why = explain(base, best, top=3)
    changed = {k: (base.layout()[k], v) for k, v in best.layout().items() if base.layout()[k] != v}
    return {
        "baseline_step_s": base.step_s,
        "recommended_step_s": best.step_s,
        "gain": gain,
        "within": gain <= WITHIN,
        "changed": {k: list(v) for k, v in changed.items()},
        "why": why if why else ["the same prediction"],
    }


# --------------------------------------------------------------------------------------------------
# Rates, output
# --------------------------------------------------------------------------------------------------


def probe_rates(cfg: Config) -> dict[str, Any] | None:
    """Run training/observe/cost_probe.py with the job's rank count (CPU clusters); None (and a note) if it fails."""
    from launcher.ranks.processes import threads_per_rank

    m, c = cfg.model, cfg.cluster
    ranks = c.nodes * c.gpus_per_node
    tps = [t for t in (1, 2, 4) if t <= ranks and m.num_attention_heads % t == 0 and m.ffn % t == 0]
    micro = sorted({1, min(4, cfg.parallel.global_batch)})
    argv = [
        sys.executable,
        "-m",
        "training.observe.cost_probe",
        "--ranks",
        str(ranks),
        "--threads",
        str(threads_per_rank(ranks)),
        "--hidden",
        str(m.hidden_size),
        "--heads",
        str(m.num_attention_heads),
        "--ffn",
        str(m.ffn),
        "--seq",
        str(m.seq_length),
        "--tp",
        ",".join(map(str, tps)),
        "--micro",
        ",".join(map(str, micro)),
        "--dtype",
        str(cfg.train.precision),
    ]
    from launcher.ranks.processes import PROJECT_ROOT

    env = dict(os.environ, PYTHONPATH=PROJECT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        print("meshrun: the rate probe timed out; ranking with the cluster config's rates", file=sys.stderr)
        return None
    if p.returncode != 0:
        print(
            f"meshrun: the rate probe failed ({p.stderr.strip()[-500:]}); ranking with the cluster config's rates",
            file=sys.stderr,
        )
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def rates_for(cfg: Config, run_dir: str) -> Rates:
    """Probe (CPU clusters, recommend.probe), else run.dir/preflight.json's measurements, else the config's."""
    preflight = None
    path = RunPaths(run_dir).preflight
    if os.path.exists(path):
        with open(path) as f:
            preflight = json.load(f)
    probe = probe_rates(cfg) if cfg.cluster.device == "cpu" and cfg.recommend.probe else None
    return cluster_rates(cfg, preflight=preflight, probe=probe)


def format_table(cands: list[Candidate], peak: float) -> str:
    rows = [("#", "layout", "step", "tok/s/GPU", "MFU", "memory", "why")]
    for c in cands:
        rows.append(
            (
                str(c.rank or "-"),
                c.short(),
                fmt_seconds(c.step_s),
                f"{_tokens_per_gpu(c):.4g}",
                f"{100 * _mfu(c, peak):.1f}%",
                f"{c.plan.memory_bytes['total'] / GIB:.2f} GiB",
                c.reason,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    return "\n".join("  " + "  ".join(f"{r[i]:<{widths[i]}}" for i in range(6)) + "  " + r[6] for r in rows)


def _write_json(path: str, data: dict[str, Any]) -> None:
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    write_atomic(path, json.dumps(data, indent=2))


def recommend(cfg: Config, run_dir: str, rates: Rates | None = None) -> dict[str, Any]:
    """Search, explain, and return recommend.json's dict (written to run_dir when it is given)."""
    t0 = time.time()
    rates = rates or rates_for(cfg, run_dir)
    result = search(cfg, rates)
    annotate(result)
    peak = cfg.cluster.peak_tflops * 1e12 if cfg.cluster.peak_tflops > 0 else rates.flops
    top = result.candidates[: max(1, cfg.recommend.top)]
    data: dict[str, Any] = {
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "world_size": cfg.cluster.nodes * cfg.cluster.gpus_per_node,
        "global_batch": cfg.parallel.global_batch,
        "seq_length": cfg.model.seq_length,
        "precision": str(cfg.train.precision),
        "rates": rates.to_json(),
        "peak_flops": peak,
        "searched": result.searched,
        "valid": result.valid,
        "fitting": len(result.candidates),
        "candidates": [candidate_json(c, peak) for c in top] + [candidate_json(c, peak) for c in result.no_fit[:3]],
    }
    base = _baseline(cfg, rates, result)
    if base is not None:
        data["baseline"] = candidate_json(base, peak)
        if result.candidates:
            data["versus_baseline"] = versus_baseline(result.candidates[0], base)
    data["elapsed_s"] = round(time.time() - t0, 3)
    data["_objects"] = {"search": result, "baseline": base, "peak": peak}
    return data


def _baseline(cfg: Config, rates: Rates, result: Search) -> Candidate | None:
    """The configured layout as a candidate (its rank among the fitting ones), when it is valid."""
    if derived_dp(cfg) < 1 or any(v.level == "error" for v in rules.layout_violations(cfg, derived_dp(cfg))):
        return None
    base = Candidate(cfg, make_plan(cfg, rates=rates))
    faster = [c for c in result.candidates if c.step_s < base.step_s - 1e-12]
    base.rank = len(faster) + 1 if base.plan.fits else 0
    if result.candidates:
        lost = explain(base, result.candidates[0], top=3)
        base.reason = (
            "configured; "
            + ("does not fit; " if not base.plan.fits else "")
            + (", ".join(lost) if lost else "as fast as #1")
        )
    return base


def run_recommend(cfg: Config, run_dir: str, calibrate: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """meshrun action=recommend: print the ranking, write run_dir/recommend.json, calibrate when asked (with
    `calibrate`: launcher/launch/calibrate.py run_recommend, the action's entry, passes it, so this module, whose
    search parallel=auto and elastic re-plans use, does not import the calibration's launch path)."""
    if cfg.recommend.calibrate and not cluster_facts(cfg).ranks_here:
        print(
            "meshrun: recommend.calibrate=true runs the candidates on this machine: use cluster=local (or a "
            "CPU preset); on Slurm, launch the printed candidates' overrides as a sweep. Nothing was run.",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    if cfg.recommend.calibrate and cfg.recommend.calibrate_count < 2:
        print(
            "meshrun: recommend.calibrate_count must be >= 2 for a rank correlation (fix: "
            "recommend.calibrate_count=4). Nothing was run.",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    if cfg.recommend.calibrate and cfg.recommend.calibrate_passes < 1:
        print(
            f"meshrun: recommend.calibrate_passes={cfg.recommend.calibrate_passes} must be >= 1 (fix: "
            "recommend.calibrate_passes=3). Nothing was run.",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    if cfg.parallel.auto:  # parallel=auto: the layouts parallel=auto chooses from (its default global batch)
        from hydra.core.hydra_config import HydraConfig

        from launcher.recommend.auto_search import searched_config

        cfg = searched_config(cfg, HydraConfig.get().overrides.task if HydraConfig.initialized() else [])
    report = validate(replace(cfg, action="plan"))
    structural = [i for i in report.errors if i.key.startswith("model.") or i.code in ("data", "finite", "choice")]
    if structural:
        print("meshrun: the model or data configuration is invalid; nothing was searched.", file=sys.stderr)
        for issue in structural:
            print(str(issue), file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    data = recommend(cfg, run_dir)
    objs = data.pop("_objects")
    result, base, peak = objs["search"], objs["baseline"], objs["peak"]
    src = ", ".join(f"{k}: {v}" for k, v in data["rates"]["sources"].items())
    print(
        f"meshrun recommend ({cfg.model.name}, {cfg.train.precision}, {cfg.cluster.name}: {data['world_size']} ranks, "
        f"global batch {cfg.parallel.global_batch}) -> {run_dir}"
    )
    print(
        f"  searched {result.searched} layouts, {result.valid} valid, {len(result.candidates)} fit, "
        f"in {data['elapsed_s']:.2f} s; rates: {src}"
    )
    if not result.candidates:
        print("  no layout fits: add nodes, a larger cluster.gpu_memory_gb, or a smaller model / seq_length")
    shown = result.candidates[: max(1, cfg.recommend.top)] + result.no_fit[:1]
    print(format_table(shown + ([base] if base is not None else []), peak))
    vs = data.get("versus_baseline")
    if vs is not None:
        print(
            f"  configured layout: {base.short()}: {fmt_seconds(base.step_s)}; the recommended one is "
            f"{100 * vs['gain']:.1f} % faster"
            + (" (within 10 %)" if vs["within"] else "")
            + "; it loses on "
            + "; ".join(vs["why"])
        )
    if result.candidates:
        print(f"  use: {result.candidates[0].overrides()}")
    os.makedirs(run_dir, exist_ok=True)
    if cfg.recommend.calibrate and result.candidates:
        assert calibrate is not None, "recommend.calibrate=true: run it through launcher/launch/calibrate.py"
        data["calibration"] = calibrate(cfg, run_dir, result.candidates, cfg.recommend)
        for c in result.candidates:
            if c.measured_step_s is not None:
                for row in data["candidates"]:
                    if row["overrides"] == c.overrides():
                        row["measured_step_s"] = c.measured_step_s
    _write_json(RunPaths(run_dir).recommend, data)
    cal = data.get("calibration")
    if cal is not None and cal.get("spearman") is None:
        raise SystemExit(EXIT_FAILED)
    return {"status": "ok", "run_dir": run_dir, "fitting": len(result.candidates)}
