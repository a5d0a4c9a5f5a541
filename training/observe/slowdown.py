"""The whole job's throughput against its own baseline and against the plan (rank 0, every logged step).

Baseline: the median tokens/s of the attempt's first cluster.health.baseline_intervals logged steps after its
first step (which carries start-up work). A step rate below cluster.health.min_throughput_fraction x the baseline
for cluster.health.throttle_samples logged steps in a row is a slowdown: one `slowdown` event per streak, with
the rate, the baseline and the plan's prediction (plan.json: tokens_per_step / predicted_step_s), and a warning.
Once the baseline is known, a GPU run whose baseline is below that fraction of the plan's prediction gets one
`slowdown` event of kind plan (on CPU the plan's rates are defaults or a short probe, so there it is not judged).
"""

from __future__ import annotations

import json
import sys

from training.contract.rundir.events import append_event
from training.contract.rundir.paths import RunPaths
from training.observe.observer import StepObserver, StepRecord


def planned_tokens_per_s(run_dir: str) -> float | None:
    try:
        with open(RunPaths(run_dir).plan) as f:
            plan = json.load(f)
        return plan["tokens_per_step"] / plan["predicted_step_s"] if plan.get("predicted_step_s") else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


class JobSlowdown:
    def __init__(
        self,
        fraction: float,
        baseline_steps: int,
        persist: int,
        planned: float | None = None,
        judge_plan: bool = False,
    ):
        self.fraction, self.n, self.persist = fraction, max(1, baseline_steps), max(1, persist)
        self.planned, self.judge_plan = planned, judge_plan
        self.rates: list[float] = []
        self.baseline: float | None = None
        self.low = 0
        self.plan_said = False

    def update(self, step: int, tokens_per_s: float) -> list[dict]:
        """The events this step gives (kind baseline or plan), each once per streak."""
        out: list[dict] = []
        if self.fraction <= 0:
            return out
        if self.baseline is None:
            self.rates.append(tokens_per_s)
            if len(self.rates) >= self.n:
                self.baseline = sorted(self.rates)[len(self.rates) // 2]
                if self.judge_plan and self.planned and self.baseline < self.fraction * self.planned:
                    out.append(
                        {
                            "kind": "plan",
                            "step": step,
                            "tokens_per_s": self.baseline,
                            "planned_tokens_per_s": self.planned,
                            "ratio": self.baseline / self.planned,
                        }
                    )
            return out
        if tokens_per_s < self.fraction * self.baseline:
            self.low += 1
            if self.low == self.persist:
                out.append(
                    {
                        "kind": "baseline",
                        "step": step,
                        "tokens_per_s": tokens_per_s,
                        "baseline_tokens_per_s": self.baseline,
                        "ratio": tokens_per_s / self.baseline,
                        "planned_tokens_per_s": self.planned,
                        "vs_plan": tokens_per_s / self.planned if self.planned else None,
                    }
                )
        else:
            self.low = 0
        return out


class SlowdownWatch(StepObserver):
    """The loop's observer (observe/observer.py): rank 0 feeds each logged step's rate; events and warnings are
    written here."""

    def __init__(self, cfg, run_dir: str, is_logger: bool):
        h = cfg.cluster.health
        self.run_dir, self.active = run_dir, is_logger and h.min_throughput_fraction > 0
        self.first = True
        self.judge = JobSlowdown(
            h.min_throughput_fraction,
            h.baseline_intervals,
            h.throttle_samples,
            planned_tokens_per_s(run_dir),
            judge_plan=cfg.cluster.device == "cuda",
        )

    def after_step(self, step: int, record: StepRecord) -> None:
        if not self.active or not record.logged:
            return
        tokens_per_s = record.tokens_per_s
        if self.first:  # the attempt's first step carries start-up work
            self.first = False
            return
        for ev in self.judge.update(step, tokens_per_s):
            append_event(self.run_dir, "slowdown", **ev)
            if ev["kind"] == "baseline":
                print(
                    f"\nwarning: step {step}: the job runs at {ev['tokens_per_s']:,.0f} tokens/s, "
                    f"{100 * ev['ratio']:.0f} % of its own baseline ({ev['baseline_tokens_per_s']:,.0f})"
                    + (f" and {100 * ev['vs_plan']:.0f} % of the plan" if ev.get("vs_plan") else "")
                    + ": a slow node, throttling or storage; `meshrun action=status` and health.jsonl say more",
                    file=sys.stderr,
                )
            else:
                print(
                    f"\nwarning: the job's baseline {ev['tokens_per_s']:,.0f} tokens/s is {100 * ev['ratio']:.0f} % "
                    f"of the plan's {ev['planned_tokens_per_s']:,.0f}",
                    file=sys.stderr,
                )
