"""train.min_step_s: a step that ends sooner waits out the rest before its boundary, outside the step timer, with
the same losses as an unpaced run; 0 never waits; a negative value is refused with the fix."""

from __future__ import annotations

import json
import os
import time

from helpers.dist import run_distributed
from training.contract.config import Config

STEPS = 3
PACE_S = 30.0  # far above a tiny step's time: every step waits (a stand-in clock records the waits instead)


def _cfg(min_step_s: float) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 16, 2, 8
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, 1, 1, False, 0, 1, 2
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.tensorboard, t.min_step_s = STEPS, 1, False, False, min_step_s
    cfg.data.kind = "synthetic"
    return cfg


def _runs(base: str):
    import training.run.loop as loop
    from training.parallel.mesh import ProcessMesh

    waits: list = []

    class RecordingClock:
        """time as the loop sees it, with sleep recorded instead of slept."""

        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)

    mesh = ProcessMesh.from_env(1, 1, 1, 1, timeout_s=120)
    out = {}
    for name, pace, clock in (("plain", 0.0, RecordingClock), ("paced", PACE_S, RecordingClock), ("real", 0.3, time)):
        loop.time = clock
        try:
            run_dir = os.path.join(base, name)
            t0 = time.perf_counter()
            trainer = loop.Trainer(_cfg(pace), run_dir, mesh, checkpointing=False)
            trainer.run()
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            out[name] = {
                "losses": list(trainer.losses),
                "step_s": [r["step_time_s"] for r in rows],
                "waits": list(waits),
                "wall_s": time.perf_counter() - t0,
            }
            waits.clear()
        finally:
            loop.time = time
    mesh.destroy()
    return out


def test_min_step_s_waits_out_each_step_outside_the_timer_with_the_same_losses(tmp_path):
    (out,) = run_distributed(_runs, 1, args=(str(tmp_path),), timeout_s=300)
    plain, paced = out["plain"], out["paced"]
    assert plain["waits"] == []  # 0: never waits
    assert len(paced["losses"]) == STEPS and paced["losses"] == plain["losses"]  # pacing changes no number
    assert len(paced["waits"]) == STEPS and len(paced["step_s"]) == STEPS
    for wait, step_s in zip(paced["waits"], paced["step_s"]):
        # The wait is the rest of the step's PACE_S: what the step timer measured is not part of it, and the
        # little left between (the step's logging) is far under a second.
        assert 0 < wait < PACE_S and step_s < PACE_S
        assert PACE_S - 1.0 < wait + step_s <= PACE_S
    real = out["real"]
    assert real["losses"] == plain["losses"] and real["wall_s"] >= STEPS * 0.3  # the real clock did wait


def test_a_negative_min_step_s_is_refused_with_the_fix():
    from launcher.plan.validate import validate

    (issue,) = [i for i in validate(_cfg(-1.0)).issues if i.key == "train.min_step_s"]
    assert issue.level == "error" and issue.fix == "train.min_step_s=0"
    assert not [i for i in validate(_cfg(0.5)).issues if i.key == "train.min_step_s"]
