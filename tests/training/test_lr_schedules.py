"""train.lr_schedule: every schedule's curve against its formula (docs/FORMULAS.md, written out here again
independently of training/contract/lr_schedule.py), bad keys refused by the launcher and the engine, and the engine's
logged lr unchanged when a run stops early and resumes (the real Trainer, one spawned process)."""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers.dist import run_distributed

from training.contract.config import Config, TrainConfig, choices
from training.contract.lr_schedule import lr_at, lr_curve, schedule_problems

LR, MIN = 1e-3, 1e-4


def _train(kind, steps=40, warmup=5, **kw) -> TrainConfig:
    return TrainConfig(lr=LR, min_lr=MIN, steps=steps, warmup_steps=warmup, lr_schedule=kind, **kw)


def _expected(kind, step, steps=40, warmup=5, decay_fraction=0.2):
    """The published forms, one branch each, step 0-based (metrics' step n ran with step n - 1's rate)."""
    if step < warmup:
        return LR * (step + 1) / warmup
    t = step - warmup  # steps since warm-up ended
    T = steps - warmup  # the decay horizon
    if kind == "cosine":  # Loshchilov & Hutter 2017, one cycle
        return MIN + 0.5 * (LR - MIN) * (1 + math.cos(math.pi * t / T))
    if kind == "linear":
        return LR + (MIN - LR) * t / T
    if kind == "constant":
        return LR
    if kind == "inverse_sqrt":  # Vaswani et al. 2017: peak at the end of warm-up, then 1/sqrt(step)
        return max(MIN, LR * math.sqrt(warmup) / math.sqrt(step + 1))
    if kind == "wsd":  # Hu et al. 2024 (MiniCPM): stable at the peak, decay in the last fraction
        D = math.ceil(decay_fraction * T)
        return LR if t < T - D else LR + (MIN - LR) * (t - (T - D) + 1) / D
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", choices("train.lr_schedule"))
def test_every_schedule_follows_its_formula(kind):
    assert set(choices("train.lr_schedule")) == {"cosine", "linear", "constant", "wsd", "inverse_sqrt"}
    curve = lr_curve(_train(kind))
    assert len(curve) == 40
    for step, value in enumerate(curve):
        assert value == pytest.approx(_expected(kind, step), rel=1e-12, abs=1e-15), (kind, step)
    assert curve[4] == pytest.approx(LR)  # every schedule peaks at the end of warm-up
    if kind == "wsd":
        # 35 steps after warm-up, the last 7 decay: 1/7 of the way at step 33, min_lr at the last step.
        assert curve[5:33] == [LR] * 28 and curve[33] < LR and curve[-1] == pytest.approx(MIN)
    if kind in ("cosine", "linear", "wsd"):
        assert MIN <= curve[-1] < LR * 0.05 + MIN  # nearly at min_lr on the last step
    assert all(v > 0 for v in curve)


def test_wsd_decay_fraction_edges_and_decay_steps():
    # decay_fraction 0: stable to the end; 1: linear over the whole horizon.
    assert lr_curve(_train("wsd", decay_fraction=0.0))[5:] == [LR] * 35
    whole = lr_curve(_train("wsd", decay_fraction=1.0))
    assert whole == pytest.approx([_expected("wsd", n, decay_fraction=1.0) for n in range(40)])
    assert whole[5] < LR and whole[-1] == pytest.approx(MIN)
    # decay_steps shortens the horizon: flat at min_lr after it.
    t = _train("linear", decay_steps=10)
    assert lr_at(15, t) == pytest.approx(MIN) and lr_at(39, t) == pytest.approx(MIN)
    assert lr_at(10, t) == pytest.approx(LR + (MIN - LR) * 5 / 10)


def test_bad_schedule_keys_are_refused_before_anything_is_written(tmp_path):
    assert [k for k, _, _ in schedule_problems(_train("wsd", decay_fraction=1.5))] == ["train.decay_fraction"]
    assert [k for k, _, _ in schedule_problems(_train("cosine", decay_steps=0))] == ["train.decay_steps"]
    from helpers.cli import run_cli  # the console entry point in this process: the message, not the process

    proc = run_cli(
        "action=plan", "train.lr_schedule=wsd", "train.decay_fraction=-0.1", f"run.dir={tmp_path / 'r'}", cwd=tmp_path
    )
    assert proc.returncode == 2 and "train.decay_fraction" in proc.stderr and "train.decay_fraction=0.2" in proc.stderr
    assert not (tmp_path / "r").exists()
    proc = run_cli("action=plan", "train.lr_schedule=step", f"run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 2


def _cfg(kind, **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 1, 16, 2, 8
    cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 2
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.lr_schedule, t.progress, t.tensorboard, t.dist_timeout_s = 9, 2, kind, False, False, 60
    t.decay_fraction = 0.5
    for k, v in train.items():
        setattr(t, k, v)
    cfg.data.kind = "synthetic"
    return cfg


def _logged_lr(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["lr"] for r in rows}


def _stop_resume_runs(base):
    """Each schedule: an uninterrupted run, and one stopped at steps 3 and 6 and resumed twice."""
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mesh = ProcessMesh.from_env(1, 1, 1, 1, timeout_s=60)
    out = {}
    for kind in ("wsd", "inverse_sqrt"):  # cosine: tests/engine/test_resume_matrix.py
        ref_dir, run_dir = os.path.join(base, kind, "ref"), os.path.join(base, kind, "run")
        Trainer(_cfg(kind), ref_dir, mesh).run()
        codes = [Trainer(_cfg(kind, exit_interval=3), run_dir, mesh).run() for _ in range(2)]
        codes.append(Trainer(_cfg(kind), run_dir, mesh).run())
        out[kind] = {"codes": codes, "ref": _logged_lr(ref_dir), "run": _logged_lr(run_dir)}
    mesh.destroy()
    return out


def test_stop_and_resume_never_change_the_schedule(tmp_path):
    from training.contract.exit_codes import EXIT_OK, EXIT_STOPPED

    (out,) = run_distributed(_stop_resume_runs, 1, args=(str(tmp_path),), timeout_s=240)
    for kind, got in out.items():
        assert got["codes"] == [EXIT_STOPPED, EXIT_STOPPED, EXIT_OK], kind
        want = {n: lr_at(n - 1, _cfg(kind).train) for n in range(1, 10)}
        assert got["run"] == got["ref"] == pytest.approx(want, rel=1e-12), kind
    # The report's lr plot draws the whole schedule (from config.json) under the logged points.
    from launcher.manage.report import _lr_lines, run_report
    from training.contract.rundir.config_files import write_config

    run_dir = str(tmp_path / "wsd" / "run")
    write_config(_cfg("wsd"), run_dir)
    title, lines = _lr_lines(run_dir, [{"step": n, "lr": v} for n, v in sorted(out["wsd"]["run"].items())])
    assert "wsd" in title
    (_, logged), (label, (xs, ys)) = lines
    assert label == "wsd schedule" and xs == list(range(1, 10)) and ys == lr_curve(_cfg("wsd").train)
    assert dict(zip(*logged)) == pytest.approx(dict(zip(xs, ys)), rel=1e-12)
    assert run_report(run_dir) == 0 and os.path.getsize(os.path.join(run_dir, "report", "lr.png")) > 0
