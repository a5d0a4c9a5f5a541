"""action=report plots a mixture of experts' load balance (metrics rows moe_max_load, moe_dropped_tokens)."""

from __future__ import annotations

import json
import os

import pytest

from launcher.manage.report import build_report

TITLE = "Expert load balance (max tokens per expert / mean)"


def _write_rows(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_the_report_plots_the_expert_load_per_step(tmp_path, drawn):
    base = {"loss": 5.0, "lr": 1e-3, "tokens_per_s": 100.0, "step_time_s": 0.1}
    loads = [2.5, 1.9, 1.4, 1.2]
    _write_rows(
        str(tmp_path / "moe"),
        [dict(base, step=i + 1, moe_max_load=v, moe_aux_loss=0.01, moe_dropped_tokens=3) for i, v in enumerate(loads)],
    )
    _, report = build_report(str(tmp_path / "moe"))
    assert "moe_load" in {f.name for f in report.figures}
    (fig,) = [f for title, f in drawn.items() if title.startswith(TITLE)]
    lines = {label: (x, y) for label, x, y, _, _ in fig["lines"]}
    assert lines["moe_max_load"] == ([1.0, 2.0, 3.0, 4.0], pytest.approx(loads))
    assert lines["balanced (1.0)"][1] == [1.0, 1.0]
    assert any(t.endswith("12 tokens dropped") for t in drawn)  # 3 per step, summed
    # A dense run has no such rows: no figure, no note about it.
    _write_rows(str(tmp_path / "dense"), [dict(base, step=1)])
    _, dense = build_report(str(tmp_path / "dense"))
    assert "moe_load" not in {f.name for f in dense.figures}
    assert not any("load balance" in n for n in dense.notes)
