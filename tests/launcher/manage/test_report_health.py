"""The report's GPU health figure (launcher/manage/report.py) from a health.jsonl that the real sampler wrote
(training/observe/health.py on the NVML double of tests/helpers/doubles.py): one line per node/GPU with the
temperatures the double reported, against seconds since the first sample, read back from the figure as
matplotlib saves it and compared with health.jsonl as this test reads it."""

from __future__ import annotations

import json
import os

from helpers.doubles import fake_nvml, healthy_gpu

from launcher.manage.report import build_report
from training.observe.health import HealthSampler


def test_health_figure_draws_each_gpus_samples(tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn[fig.axes[0].get_title()] = [
            (
                ax.get_title(),
                {
                    ln.get_label(): ([float(x) for x in ln.get_xdata()], [float(y) for y in ln.get_ydata()])
                    for ln in ax.get_lines()
                },
            )
            for ax in fig.axes
        ]
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    run = str(tmp_path / "run")
    os.makedirs(run)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:  # the report draws a run that logged steps
        for step in (1, 2, 3):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": 5.0 - step,
                        "lr": 1e-3,
                        "tokens_per_s": 100.0,
                        "mfu": 0.1,
                        "step_time_s": 0.5,
                        "time": 1000.0 + step,
                        "attempt": 0,
                    }
                )
                + "\n"
            )
    gpus = [healthy_gpu(i) for i in range(2)]
    sampler = HealthSampler(fake_nvml(gpus), "n7", run, interval_s=1, throttle_samples=3)
    for t0, t1 in ((34, 40), (51, 47), (63, 45)):
        gpus[0]["temp"], gpus[1]["temp"] = t0, t1
        sampler.sample()
    with open(os.path.join(run, "health.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    start = min(r["time"] for r in rows)
    want = {
        f"n7/gpu{g}": (
            [r["time"] - start for r in rows if r["gpu"] == g],
            [r["temperature_c"] for r in rows if r["gpu"] == g],
        )
        for g in (0, 1)
    }
    assert want["n7/gpu0"][1] == [34, 51, 63] and want["n7/gpu1"][1] == [40, 47, 45]

    path, report = build_report(run)
    assert os.path.exists(os.path.join(os.path.dirname(path), "health.png"))
    assert not any("health.jsonl" in n for n in report.notes)  # drawn, not left out
    panels = dict(next(v for v in drawn.values() if any(t.startswith("temperature") for t, _ in v)))
    (temperature,) = [lines for title, lines in panels.items() if title.startswith("temperature")]
    assert sorted(temperature) == ["n7/gpu0", "n7/gpu1"]
    for name, (xs, ys) in want.items():
        assert temperature[name][1] == ys, name
        assert len(temperature[name][0]) == len(xs) and all(
            abs(a - b) < 1e-9 for a, b in zip(temperature[name][0], xs)
        ), name
    with open(path) as f:
        assert "<h2>GPU health samples</h2><img class='plot' alt='health'" in f.read()
