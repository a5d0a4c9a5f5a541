"""parallel=auto: the recommender picks the layout at plan and launch time (the default of the cuda cluster presets).

Every `parallel.*` key given on the command line is kept (pinned); every other one is filled from the fastest
layout that fits (launcher/recommend/recommend.py's search, the same ranking `action=recommend` prints). The global
batch, when not given, is about a million tokens (launcher/recommend/auto_search.py): a DGX preset should not inherit the CPU
demo's 16 sequences. When nothing fits at cluster.nodes, the error names the smallest node count that fits
(smallest_fitting_nodes). The chosen config has parallel.auto false, so config.json records what runs and a
resumed run keeps its layout; plan.json's `auto` says what was chosen, the runner-up and why. config.json's
parallel.auto_pinned records that parallel=auto chose the layout and which keys were pinned: an elastic resize
(launcher/slurm/elastic.py) re-plans the new node count by the same rule (`replan`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from launcher.plan.cluster_facts import cluster_facts
from launcher.plan.cost_model import Rates, cluster_rates
from launcher.plan.estimate import GIB, fmt_seconds, make_plan
from launcher.plan.validate import NO_COMBINATION, Report, changed_keys, validate
from launcher.recommend.auto_search import pinned_keys, searched_config
from launcher.recommend.recommend import Candidate, _with, annotate, fits_with_headroom, search
from training.contract import layout_rules as rules
from training.contract.config import Config, ParallelConfig, config_to_dict, derived_dp
from training.contract.exit_codes import EXIT_INVALID

SEARCHED_KEYS = (
    "tp",
    "pp",
    "vpp",
    "cp",
    "ep",
    "dp",
    "sp",
    "zero",
    "offload",
    "micro_batch",
    "global_batch",
    "schedule",
    "recompute",
    "recompute_num_layers",
    "allow_tp_across_nodes",
    # the pipeline split (training/contract/stage_split.py): the search picks one where the layers do not divide
    "first_stage_layers",
    "last_stage_layers",
    "embedding_in_split",
    "loss_in_split",
)
"""The parallel keys the search chooses; a pinned one (given on the command line) is kept as given."""
MAX_NODES_TRIED = 1024
"""smallest_fitting_nodes doubles cluster.nodes up to this many nodes."""


@dataclass
class AutoChoice:
    """What parallel=auto chose."""

    cfg: Config
    chosen: Candidate | None
    """None: no layout fits (a sweep point; a single run exits 2 instead)."""
    runner_up: Candidate | None
    pinned: dict[str, Any] = field(default_factory=dict)
    searched: int = 0
    fitting: int = 0

    def to_json(self) -> dict[str, Any]:
        def row(c: Candidate) -> dict[str, Any]:
            return {
                "layout": c.short(),
                "overrides": c.overrides(),
                "predicted_step_s": c.step_s,
                "memory_gib": round(c.plan.memory_bytes["total"] / GIB, 2),
                "rank": c.rank,
                "why": c.reason,
            }

        assert self.chosen is not None
        return {
            "chosen": row(self.chosen),
            "runner_up": row(self.runner_up) if self.runner_up is not None else None,
            "why": self.chosen.reason,
            "pinned": {k: str(v) if not isinstance(v, (int, float, bool)) else v for k, v in self.pinned.items()},
            "searched": self.searched,
            "fitting": self.fitting,
        }


def _typed(key: str, value: Any) -> str:
    """parallel.KEY=VALUE as a user types it (booleans lower case, as the schema's YAML spells them)."""
    return f"parallel.{key}={str(value).lower() if isinstance(value, bool) else value}"


def _rates(cfg: Config) -> Rates:
    return cluster_rates(cfg)  # the preset's rates: a plan probes nothing (recommend's probe is its own action)


def _matches(cand: Candidate, pinned: dict[str, Any]) -> bool:
    p = cand.cfg.parallel
    for key, want in pinned.items():
        have = cand.plan.dp if key == "dp" else getattr(p, key)
        if str(have) != str(want):
            return False
    return True


def _with_pins(cand: Candidate, pinned: dict[str, Any], rates: Rates) -> Candidate | None:
    """cand with the pinned keys forced onto it, when that is a valid layout that fits (keys the search does
    not vary, such as zero=3 or offload=cpu)."""
    changes = {k: v for k, v in pinned.items() if k != "dp"}
    new = _with(cand.cfg, **changes)
    dp = derived_dp(new)
    if dp < 1 or ("dp" in pinned and dp != pinned["dp"]):
        return None
    if any(v.level == "error" for v in rules.layout_violations(new, dp)):
        return None
    plan = make_plan(new, rates=rates)
    return Candidate(new, plan, reason=cand.reason, rank=cand.rank) if fits_with_headroom(plan, new) else None


def ranked(cfg: Config, pinned: dict[str, Any], rates: Rates) -> tuple[list[Candidate], int, int]:
    """The fitting layouts that keep the pinned keys, fastest first; the layouts searched; those that fit."""
    result = search(cfg, rates)
    annotate(result)
    keep = [c for c in result.candidates if _matches(c, pinned)]
    if not keep and pinned:
        for cand in result.candidates[:200]:
            forced = _with_pins(cand, pinned, rates)
            if forced is not None and all(forced.short() != k.short() for k in keep):
                keep.append(forced)
                if len(keep) == 2:
                    break
    return keep, result.searched, len(result.candidates)


def _at_nodes(cfg: Config, nodes: int) -> Config:
    return type(cfg)(**{**vars(cfg), "cluster": type(cfg.cluster)(**{**vars(cfg.cluster), "nodes": nodes})})


def smallest_fitting_nodes(cfg: Config, pinned: dict[str, Any]) -> tuple[int, Candidate] | None:
    """The smallest power-of-two multiple of cluster.nodes at which some layout (keeping the pinned keys) fits."""
    nodes = cfg.cluster.nodes * 2
    while nodes <= MAX_NODES_TRIED:
        grown = _at_nodes(cfg, nodes)
        keep, _, _ = ranked(grown, pinned, _rates(grown))
        if keep:
            return nodes, keep[0]
        nodes *= 2
    return None


def pinned_values(cfg: Config, overrides: Sequence[str]) -> dict[str, Any]:
    """The searched parallel.* keys the command line sets, with their values. A key set to null
    (`parallel.dp=null`: derived, the schema's default) pins nothing: the search fills it."""
    given = set(pinned_keys(overrides))
    return {k: getattr(cfg.parallel, k) for k in SEARCHED_KEYS if k in given and getattr(cfg.parallel, k) is not None}


def name_the_nodes(cfg: Config, report: Report) -> None:
    """A fixed layout that does not fit on a Slurm cluster: the smallest cluster.nodes at which a layout fits
    (parallel=auto's search, smallest_fitting_nodes) becomes the no-fit error's first fix, with the parallel.* keys
    that layout changes (launcher/launch/gate.py plan_or_reject calls it for a single run)."""
    if not cluster_facts(cfg).adds_nodes:
        return
    issue = next(i for i in report.errors if i.code == "no_fit")
    found = smallest_fitting_nodes(cfg, {})
    if found is None:
        return
    nodes, cand = found
    keys = " ".join(k for k in [f"cluster.nodes={nodes}", changed_keys(cfg, cand.cfg)] if k)
    fix = (
        f"{keys}: {cand.plan.memory_bytes['total'] / GIB:.2f} GiB (fits; {cand.short()}, "
        f"{fmt_seconds(cand.step_s)} a step)"
    )
    rest = [f for f in issue.fix.split("; ") if f and not f.startswith(NO_COMBINATION)]
    issue.fix = "; ".join([fix] + rest)


def choose(cfg: Config, overrides: Sequence[str], multirun: bool = False) -> AutoChoice | None:
    """The layout parallel=auto runs: the fastest that fits keeping the command line's parallel.* keys.
    None when the model or data is invalid (the gate then reports that). When none fits: exits 2 (nothing
    written) naming the smallest node count that does; in a sweep, an AutoChoice with chosen None."""
    pinned = pinned_values(cfg, overrides)
    base = searched_config(cfg, overrides)
    report = validate(replace(base, action="plan"))
    if any(i.key.startswith("model.") or i.code in ("data", "finite", "choice") for i in report.errors):
        return None
    rates = _rates(base)
    keep, searched, fitting = ranked(base, pinned, rates)
    if not keep:
        if multirun:
            return AutoChoice(cfg=base, chosen=None, runner_up=None, pinned=pinned, searched=searched)
        _refuse(base, pinned, searched, overrides)
    chosen = keep[0]
    return AutoChoice(
        cfg=_with(chosen.cfg, auto_pinned=" ".join(pinned)),  # config.json's record (`replan` reads it)
        chosen=chosen,
        runner_up=keep[1] if len(keep) > 1 else None,
        pinned=pinned,
        searched=searched,
        fitting=fitting,
    )


def _refuse(cfg: Config, pinned: dict[str, Any], searched: int, overrides: Sequence[str] = ()) -> None:
    kept = " ".join(_typed(k, v) for k, v in pinned.items())
    c = cfg.cluster
    print(
        f"meshrun: invalid configuration; nothing was launched.\nerror: parallel=auto: no layout of "
        f"{cfg.model.name} fits {c.nodes} x {c.gpus_per_node} GPUs of {c.gpu_memory_gb:g} GiB at global batch "
        f"{cfg.parallel.global_batch}" + (f" keeping {kept}" if kept else "") + f" ({searched} layouts searched)",
        file=sys.stderr,
    )
    found = smallest_fitting_nodes(cfg, pinned)
    if found is not None:
        nodes, cand = found
        print(
            f"    fix: cluster.nodes={nodes} (the smallest allocation that fits: {cand.short()}, "
            f"{fmt_seconds(cand.step_s)} a step, {cand.plan.memory_bytes['total'] / GIB:.1f} GiB per GPU)",
            file=sys.stderr,
        )
    elif pinned:
        free = " ".join(
            o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in {f"parallel.{k}" for k in pinned}
        )
        print(f"    fix: meshrun {free} (without {kept}: the search chooses them)", file=sys.stderr)
    else:
        print(
            "    fix: model.seq_length=<shorter>, or cluster.gpu_memory_gb=<larger> (a cluster with more GPU memory)",
            file=sys.stderr,
        )
    raise SystemExit(EXIT_INVALID)


def announce(choice: AutoChoice) -> None:
    """The chosen layout and the runner-up, each with why (stdout: part of the plan's output)."""
    c = choice.chosen
    assert c is not None
    kept = " ".join(_typed(k, v) for k, v in choice.pinned.items())
    print(
        f"meshrun: parallel=auto chose {c.short()} ({fmt_seconds(c.step_s)} a step, "
        f"{c.plan.memory_bytes['total'] / GIB:.1f} GiB per GPU; {choice.fitting} of {choice.searched} layouts fit"
        + (f"; kept {kept}" if kept else "")
        + f"): {c.reason}"
    )
    r = choice.runner_up
    if r is not None:
        print(f"meshrun: runner-up {r.short()} ({fmt_seconds(r.step_s)} a step): {r.reason}")
    print(f"meshrun: to pin this layout: {c.overrides()}")


RESIZE_KEEPS = ("global_batch",)
"""What a resize keeps besides the pinned keys: the global batch (the same optimizer steps, more or less
accumulation). Every other searched key may change, because a checkpoint resumes at any of the layouts the search
builds: it is stored layout-free and resharded on load across tp (docs/PLATFORM.md), pp and uneven stage splits
(tests/engine/test_uneven_stages.py), cp (docs/USER_CONTRACTS.md), dp and ZeRO stages (docs/CONTRACTS.md,
tests/engine/test_zero_levers.py) and ep (tests/engine/test_moe_engine.py); sp, micro-batch, schedule and recompute
do not enter it, and offload keeps the same optimizer state (tests/engine/test_zero_levers.py)."""
_REPLANS: dict[tuple[str, int], AutoChoice] = {}


def recorded_pins(cfg: Config) -> dict[str, Any] | None:
    """The pinned keys of a run whose layout parallel=auto chose (parallel.auto_pinned), with this config's values;
    None for a named or given layout."""
    text = cfg.parallel.auto_pinned
    if text is None:
        return None
    return {k: getattr(cfg.parallel, k) for k in text.split() if k in SEARCHED_KEYS}


def replan(cfg: Config, nodes: int) -> AutoChoice:
    """parallel=auto's rule on `nodes` nodes for a run whose layout it chose (recorded_pins not None): the fastest
    layout that fits keeping the recorded pins and RESIZE_KEEPS. A pinned dp is let go (the rank count changed).
    The other searched keys start from the schema's defaults, as parallel=auto's own search did, so growing back to
    the full count chooses the first layout again. chosen None: nothing fits. Computed once per config and count."""
    pins = recorded_pins(cfg)
    assert pins is not None, "replan: the layout was not chosen by parallel=auto"
    key = (json.dumps(config_to_dict(cfg), sort_keys=True, default=str), nodes)
    found = _REPLANS.get(key)
    if found is not None:
        return found
    kept = {k: v for k, v in pins.items() if k != "dp"}
    kept.update({k: getattr(cfg.parallel, k) for k in RESIZE_KEEPS})
    fresh = ParallelConfig()
    reset = {k: getattr(fresh, k) for k in SEARCHED_KEYS if k not in kept}
    base = _at_nodes(_with(cfg, **reset, auto=False), nodes)
    keep, searched, fitting = ranked(base, kept, _rates(base))
    if not keep:
        choice = AutoChoice(cfg=base, chosen=None, runner_up=None, pinned=kept, searched=searched)
    else:
        choice = AutoChoice(
            cfg=_with(keep[0].cfg, auto_pinned=cfg.parallel.auto_pinned),
            chosen=keep[0],
            runner_up=keep[1] if len(keep) > 1 else None,
            pinned=kept,
            searched=searched,
            fitting=fitting,
        )
    if len(_REPLANS) > 64:
        _REPLANS.clear()
    _REPLANS[key] = choice
    return choice


def replan_text(choice: AutoChoice) -> str:
    """One line: what a re-plan chose (or that nothing fits), with what it kept and why."""
    kept = " ".join(_typed(k, v) for k, v in choice.pinned.items())
    c, nodes = choice.chosen, choice.cfg.cluster.nodes
    if c is None:
        return f"parallel=auto finds no layout on {nodes} node(s) keeping {kept} ({choice.searched} layouts searched)"
    return (
        f"parallel=auto re-planned {nodes} node(s): {c.short()} ({fmt_seconds(c.step_s)} a step, "
        f"{c.plan.memory_bytes['total'] / GIB:.1f} GiB per GPU; {choice.fitting} of {choice.searched} layouts fit; "
        f"kept {kept}): {c.reason}"
    )
