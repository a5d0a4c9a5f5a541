"""Step pacing (MESHRUN_PACE_STEP_S, training/run/pacing.py: the tests' and benchmarks' knob, not a user key): a
step that ends sooner waits out the rest before its boundary, outside the step timer, with the same losses as an
unpaced run; a stop signal ends the wait; 0 never waits; a negative value is refused with the fix."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from helpers.dist import run_distributed

from training.contract.config import Config

STEPS = 3
PACE_S = 30.0  # far above a tiny step's time: every step waits (on a stand-in clock that sleeps by moving on)


def _cfg() -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 16, 2, 8
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, 1, 1, False, 0, 1, 2
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.tensorboard = STEPS, 1, False, False
    cfg.data.kind = "synthetic"
    return cfg


def _runs(base: str):
    import training.run.loop as loop
    from training.parallel.mesh import ProcessMesh
    from training.run import signals
    from training.run.pacing import PACE_ENV

    waits: list = []
    skipped = [0.0]  # the stand-in clock's lead over the real one: what its sleeps skipped

    class SteppedClock:
        """time as the loop sees it: sleep is recorded and moves the clock on instead of waiting."""

        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + skipped[0]

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            skipped[0] += seconds

    def run(name: str, pace: float, clock) -> dict:
        loop.time = clock
        try:
            run_dir = os.path.join(base, name)
            t0 = time.perf_counter()
            os.environ[PACE_ENV] = str(pace)  # read once by each Trainer
            trainer = loop.Trainer(_cfg(), run_dir, mesh, checkpointing=False)
            code = trainer.run()
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            out = {
                "losses": list(trainer.losses),
                "step_s": [r["step_time_s"] for r in rows],
                "waits": list(waits),
                "wall_s": time.perf_counter() - t0,
                "exit_code": code,
            }
            waits.clear()
            return out
        finally:
            loop.time = time

    mesh = ProcessMesh.from_env(1, 1, 1, 1, timeout_s=120)
    out = {"plain": run("plain", 0.0, SteppedClock), "paced": run("paced", PACE_S, SteppedClock)}
    # The real clock, each step paced to PACE_S, and a stop signal during the first step's wait: the signal ends
    # that wait, and the run stops at the boundary right after it (checkpointing is off here: with no checkpoint,
    # exit 3 all the same).
    signals.install()
    sender = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR2))
    sender.start()
    try:
        out["signalled"] = run("signalled", PACE_S, time)
        out["signal"] = signals.received()
    finally:
        sender.cancel()
        signals.ignore()
    mesh.destroy()
    return out


def test_pacing_waits_out_each_step_outside_the_timer_and_a_signal_ends_the_wait(tmp_path):
    from training.contract.exit_codes import EXIT_OK, EXIT_STOPPED
    from training.run.loop import PACE_SLICE_S

    (out,) = run_distributed(_runs, 1, args=(str(tmp_path),), timeout_s=300)
    plain, paced = out["plain"], out["paced"]
    assert plain["waits"] == []  # 0: never waits
    assert len(paced["losses"]) == STEPS and paced["losses"] == plain["losses"]  # pacing changes no number
    assert len(paced["step_s"]) == STEPS and all(0 < s < PACE_S for s in paced["step_s"])
    assert all(0 < w <= PACE_SLICE_S for w in paced["waits"])  # short slices: a signal is seen within one
    # Each step waited the rest of its PACE_S: what the step timer measured is not part of the wait, and the
    # little left between (the step's logging) is far under a second per step.
    owed = sum(PACE_S - s for s in paced["step_s"])
    assert owed - STEPS * 1.0 < sum(paced["waits"]) <= owed
    signalled = out["signalled"]
    assert plain["exit_code"] == paced["exit_code"] == EXIT_OK
    assert out["signal"] == "SIGUSR2" and signalled["exit_code"] == EXIT_STOPPED
    assert signalled["losses"] == plain["losses"][:1]  # the step the signal arrived in, then the stop
    # Paced, one step waits PACE_S; the signal after about 1 s ended the wait.
    assert signalled["wall_s"] < PACE_S


def test_a_negative_pace_is_refused_with_the_fix():
    import pytest

    from training.run.pacing import PACE_ENV, pace_step_s

    with pytest.raises(ValueError) as refused:
        pace_step_s({PACE_ENV: "-1.0"})
    assert f"fix: {PACE_ENV}=0" in str(refused.value)
    assert pace_step_s({PACE_ENV: "0.5"}) == 0.5 and pace_step_s({}) == 0.0
