"""Straggler lines on stderr (training/observe/straggler.py): one per rank per quiet period, the rest summarised;
none at all on a CPU run with more local ranks than cores (every rank waits for a core there)."""

from __future__ import annotations

import os

from training.observe.straggler import StragglerLines, oversubscribed


def test_one_line_per_rank_per_quiet_period_then_a_summary(monkeypatch):
    monkeypatch.delenv("MESHRUN_PROGRESS_TTY", raising=False)
    now = [0.0]
    lines = StragglerLines(quiet_s=300, clock=lambda: now[0])
    printed = []
    for t in range(0, 600, 30):  # a straggler event every 30 s for rank 1, every 60 s for rank 3
        now[0] = float(t)
        printed.append(lines.line(1, "rank 1 slow"))
        if t % 60 == 0:
            printed.append(lines.line(3, "rank 3 slow"))
    shown = [p for p in printed if p]
    assert shown == ["straggler: rank 1 slow", "straggler: rank 3 slow"] * 2  # at 0 s and 300 s
    assert lines.summary() == "straggler: 26 more not printed (rank 1 x18, rank 3 x8); events.jsonl has every one"
    assert StragglerLines().summary() == ""


def test_a_line_ends_the_progress_bar_first_on_a_terminal(monkeypatch):
    monkeypatch.setenv("MESHRUN_PROGRESS_TTY", "1")
    assert StragglerLines().line(0, "x") == "\nstraggler: x"


def test_oversubscribed_only_on_cpu_with_more_ranks_than_cores():
    cores = len(os.sched_getaffinity(0))
    assert oversubscribed("cpu", {"LOCAL_WORLD_SIZE": str(cores + 1)})
    assert not oversubscribed("cpu", {"LOCAL_WORLD_SIZE": str(cores)})
    assert not oversubscribed("cuda", {"LOCAL_WORLD_SIZE": str(cores + 8)})
    assert not oversubscribed("cpu", {})
