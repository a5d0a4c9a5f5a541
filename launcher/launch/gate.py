"""Validate and plan one job: the gate every launch passes (used by launcher/cli/app.py).

On errors nothing is written to run_dir (Hydra's own log may exist): a single run exits 2 with every
violation on stderr; a sweep point returns {"status": "invalid" | "no_fit", ...} so the sweep goes on
and its summary lists the reason.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from launcher.launch.backend import backend_for
from launcher.launch.host_checks import host_issues
from launcher.plan.cadence import format_advice
from launcher.plan.cadence import resolve as resolve_cadence
from launcher.plan.cluster_facts import cluster_facts
from launcher.plan.estimate import format_plan
from launcher.plan.issues import Issue
from launcher.plan.validate import Report, validate
from training.contract.config import Config
from training.contract.exit_codes import EXIT_INVALID
from training.contract.layout_text import format_layout, layout_of
from training.contract.rundir.config_files import write_config
from training.contract.rundir.paths import RunPaths


def _point_label(cfg: Config) -> str:
    return f"model={cfg.model.name} {format_layout(layout_of(cfg), 'short')}"


SIGNAL_SAVE_MARGIN = 1.5
"""The fix for a short cluster.signal_delay_s asks for Slurm's 30 s check plus this many saves (the save time is
often an estimate at an assumed write rate)."""


def signal_delay_issue(cfg: Config, save_s: float, save_source: str = "") -> Issue | None:
    """A warning when a Slurm job's cluster.signal_delay_s does not exceed Slurm's 30 s time-limit check plus one
    checkpoint save (save_s: the planner's, launcher/plan/cadence.py advise(cfg).save_s, measured on a resume).

    Decided: a warning, not a refusal. The save time is an estimate until the run has saved (an assumed write
    rate), and the ranks' own clock (launcher/slurm/driver.py stop_time) also stops them before the limit.
    Values of 30 s or less are errors already (launcher/slurm/sbatch.py validate_for_slurm)."""
    from launcher.slurm.sbatch import SLURM_SIGNAL_CHECK_S

    c = cfg.cluster
    if not cluster_facts(cfg).time_limit or not cfg.train.checkpointing or c.signal_delay_s <= SLURM_SIGNAL_CHECK_S:
        return None
    needed = SLURM_SIGNAL_CHECK_S + save_s
    if c.signal_delay_s > needed:
        return None
    delay = math.ceil(SLURM_SIGNAL_CHECK_S + SIGNAL_SAVE_MARGIN * save_s) + 1
    fix = f"cluster.signal_delay_s={delay}"
    if delay >= c.time_min * 60:
        fix += f" cluster.time_min={math.ceil(delay / 60) + c.time_min}"
    return Issue(
        "warning",
        "cluster.signal_delay_s",
        f"cluster.signal_delay_s={c.signal_delay_s} s does not exceed Slurm's {SLURM_SIGNAL_CHECK_S} s time-limit "
        f"check plus one checkpoint save ({save_s:.1f} s{f', {save_source}' if save_source else ''}): the "
        f"warning signal may come {c.signal_delay_s - SLURM_SIGNAL_CHECK_S} s before the limit, too late to save",
        fix,
        "signal_delay",
    )


def launch_checks(cfg: Config) -> list[Issue]:
    """The launch backend's own rules (Slurm: sbatch safety, elastic node counts) and the machine checks
    (launcher/launch/host_checks.py): what validate() leaves to the launch (its cluster_checks)."""
    backend = backend_for(cfg.cluster.kind)
    out = [Issue("error", "cluster", message, code=backend.facts.kind) for message in backend.checks(cfg)]
    return out + host_issues(cfg)


def validate_for_launch(cfg: Config) -> Report:
    """The planner's rules plus the launch's own (launch_checks), every violation at once."""
    return validate(cfg, cluster_checks=launch_checks)


def plan_or_reject(
    cfg: Config,
    run_dir: str,
    multirun: bool = False,
    auto: dict[str, Any] | None = None,
    no_fit_advice: Callable[[Config, Report], None] | None = None,
) -> dict[str, Any]:
    """Validate cfg; on success print the plan, write plan.json and config.json into run_dir. `auto`: what
    parallel=auto chose (launcher/recommend/auto.py), kept as plan.json's `auto`. `no_fit_advice(cfg, report)`: a
    single run's no-fit error gains its fixes there (launcher/recommend/auto.py name_the_nodes: the node count).

    Returns {"status": "ok", "plan": plan.json's dict, "warnings": [...], "run_dir": run_dir}, or in a
    sweep {"status": "invalid" | "no_fit", "errors": [...], "warnings": [...]}. A single run with errors
    prints them all to stderr and raises SystemExit(EXIT_INVALID)."""
    report = validate_for_launch(cfg)
    warnings = [str(i) for i in report.warnings]
    notes = [str(i) for i in report.notes]
    if report.errors:
        status = "no_fit" if report.no_fit and len(report.errors) == 1 else "invalid"
        if not multirun and report.no_fit and no_fit_advice is not None:
            no_fit_advice(cfg, report)
        errors = [str(i) for i in report.errors]
        if not multirun:
            print(f"meshrun: invalid configuration ({len(errors)} error(s)); nothing was launched.", file=sys.stderr)
            for line in errors + warnings:
                print(line, file=sys.stderr)
            if report.plan is not None and report.no_fit:  # the memory breakdown explains a no-fit, nothing else
                print("plan of the rejected layout:\n" + format_plan(report.plan), file=sys.stderr)
            raise SystemExit(EXIT_INVALID)
        print(f"[{status}] {_point_label(cfg)}: {report.errors[0].message}", file=sys.stderr)
        result: dict[str, Any] = {
            "status": status,
            "errors": errors,
            "warnings": warnings,
            "issues": [i.to_json() for i in report.issues],
        }
        if report.plan is not None:
            result["plan"] = report.plan.to_json()
        return result

    plan = report.plan
    assert plan is not None
    # action=plan on an existing run (a config.json there) shows the plan and writes nothing: its config.json
    # is the run's, changed only by a launch that goes ahead (docs/USER_CONTRACTS.md).
    writes = not (cfg.action == "plan" and os.path.exists(RunPaths(run_dir).config))
    os.makedirs(run_dir, exist_ok=True)
    plan_json = plan.to_json()
    # train.checkpoint_every_min (auto: the Young/Daly optimum, from the run's measured saves when it has any)
    # resolved into config.json, where the engine reads it.
    cadence = resolve_cadence(cfg, run_dir, plan.predicted_step_s)
    plan_json["checkpoint_cadence"] = cadence.to_json()
    short_delay = signal_delay_issue(cfg, cadence.save_s, cadence.save_source)
    if short_delay is not None:
        warnings.append(str(short_delay))
    if auto is not None:
        plan_json["auto"] = auto
    from training.contract.rundir.files import write_atomic  # never through a link (training/contract/rundir/files.py)

    if writes:
        write_atomic(RunPaths(run_dir).plan, json.dumps(plan_json, indent=2, sort_keys=False))
        write_config(cfg, run_dir)
    elif not multirun:
        print(
            f"meshrun: {run_dir} is an existing run: this plan is shown only (its plan.json and config.json "
            f"are left as they are; a launch writes them)",
            file=sys.stderr,
        )
    if multirun:
        mem = plan.memory_bytes["total"] / 2**30
        print(f"[ok] {_point_label(cfg)}: {mem:.2f} GiB/GPU, bubble {plan.bubble_ratio:.3f}")
    else:
        print(f"meshrun plan ({cfg.model.name}, {cfg.train.precision}, {cfg.cluster.name}) -> {run_dir}")
        print(format_plan(plan))
        if cadence.job_mtbf_h > 0 or cadence.resolved_min > 0:  # nothing to say for a local run without either
            print(format_advice(cadence))
        for line in notes + warnings:
            print(line)
    return {"status": "ok", "plan": plan_json, "warnings": warnings, "run_dir": run_dir}
