"""cluster.signal_delay_s against the checkpoint save (issue 46, the tests audit's D4; docs/USER_CONTRACTS.md):
Slurm checks time limits every 30 s, so the USR2 warning may come signal_delay_s - 30 s before the limit, and a
delay that does not exceed 30 s plus one save (the planner's save time, launcher/plan/cadence.py advise) is a
warning with the override to type; 30 s or less stays an error (exit 2). No Slurm is asked: action=plan only."""

from __future__ import annotations

import math
import re

from helpers.cli import compose_cfg, run_cli

from launcher.launch.gate import SIGNAL_SAVE_MARGIN, signal_delay_issue
from launcher.plan.cadence import advise

SLOW_DISK = ["cluster=slurm_dev", "model=gpt2_125m", "cluster.gpu_memory_gb=80", "cluster.checkpoint_write_gbps=0.01"]
"""A save the planner puts at minutes (125M parameters' state at 10 MB/s), against slurm_dev's 45 s delay."""


def test_a_delay_within_30_s_plus_a_save_is_warned_with_the_fix():
    cfg = compose_cfg(*SLOW_DISK)
    save_s = advise(cfg).save_s
    assert save_s > 60  # the premise: a save longer than the preset's delay
    issue = signal_delay_issue(cfg, save_s)
    assert issue is not None and issue.level == "warning" and issue.key == "cluster.signal_delay_s"
    assert f"{save_s:.1f} s" in issue.message and "30 s" in issue.message, issue.message
    (delay,) = [int(v) for v in re.findall(r"cluster\.signal_delay_s=(\d+)", issue.fix)]
    assert delay > 30 + save_s and delay == math.ceil(30 + SIGNAL_SAVE_MARGIN * save_s) + 1
    assert issue.fix == f"cluster.signal_delay_s={delay}"
    # A save that needs a delay past slurm_dev's 10-minute limit: the fix raises the limit too.
    slower = compose_cfg(*SLOW_DISK, "cluster.checkpoint_write_gbps=0.002")
    long_fix = signal_delay_issue(slower, advise(slower).save_s).fix  # type: ignore[union-attr]
    (long_delay,) = [int(v) for v in re.findall(r"cluster\.signal_delay_s=(\d+)", long_fix)]
    (limit,) = [int(v) for v in re.findall(r"cluster\.time_min=(\d+)", long_fix)]
    assert long_delay > 600 and limit * 60 > long_delay, long_fix
    # The boundary: exactly 30 s plus the save is still too short; one second more is enough.
    cfg.cluster.signal_delay_s = math.ceil(30 + save_s)
    assert signal_delay_issue(cfg, float(cfg.cluster.signal_delay_s - 30)) is not None
    assert signal_delay_issue(cfg, float(cfg.cluster.signal_delay_s - 31)) is None
    # No save to wait for, or not a Slurm run: nothing to say.
    off = compose_cfg(*SLOW_DISK, "train.checkpointing=false")
    assert signal_delay_issue(off, save_s) is None
    assert signal_delay_issue(compose_cfg("model=gpt2_125m", "cluster.checkpoint_write_gbps=0.01"), save_s) is None


def test_plan_prints_the_warning_and_its_fix_silences_it(tmp_path):
    res = run_cli("action=plan", f"run.dir={tmp_path / 'a'}", *SLOW_DISK, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    line = next((ln for ln in out.splitlines() if ln.startswith("warning: cluster.signal_delay_s:")), None)
    assert line is not None, out
    fix = out.split(line, 1)[1].splitlines()[1].strip()
    assert fix.startswith("fix: cluster.signal_delay_s="), fix
    again = run_cli(
        "action=plan", f"run.dir={tmp_path / 'b'}", *SLOW_DISK, *fix[len("fix: ") :].split(), cwd=str(tmp_path)
    )
    assert again.returncode == 0, again.stderr
    assert "cluster.signal_delay_s:" not in again.stdout + again.stderr
    # slurm_dev's own 45 s covers a tiny model's save: no warning there.
    tiny = run_cli("action=plan", f"run.dir={tmp_path / 'c'}", "cluster=slurm_dev", "model=tiny", cwd=str(tmp_path))
    assert tiny.returncode == 0 and "cluster.signal_delay_s:" not in tiny.stdout + tiny.stderr


def test_30_s_or_less_stays_an_error(tmp_path):
    res = run_cli("action=plan", f"run.dir={tmp_path / 'a'}", "cluster=slurm_dev", "cluster.signal_delay_s=30")
    assert res.returncode == 2 and "cluster.signal_delay_s=30 leaves no time to save" in res.stderr, res.stderr
