"""train.compile=true: every transformer layer's forward compiled with torch.compile (inductor on CPU), the
layers still modules of their own. Losses of compiled runs at tp=2 sp, at pp=2 (1f1b) and at dp=2 zero=1 match
the eager single-process run within COMPILE_RTOL (docs/PERFORMANCE.md), as does recompute=full with dropout (each
compiled layer checkpointed whole; 2 steps of one micro-batch) in one process; parameter names are unchanged, and
the compile time is reported once (metrics `compile_s` on the first step only).

Compiling is slow on shared CPU cores: a tiny model, 3 steps, and one cache directory inside the test's tmp dir
that the single-process run fills first (inductor's one-time C++ probes and the full-width layer's kernels, which
pp=2 and dp=2 then find cached); the three layouts run one after another in the same 2 spawned ranks, so only
tp=2's sharded layer is compiled anew, by 2 ranks instead of 4.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.dist import run_distributed

from training.contract.config import Config

STEPS = 3
COMPILE_RTOL = 1e-5


def _cfg(tp=1, pp=1, dp=1, compile=False) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 16, 2, 8
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero = tp, pp, dp, tp > 1, 1 if dp > 1 else 0
    p.micro_batch, p.global_batch = 1, 4
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * dp, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.tensorboard, t.dist_timeout_s = STEPS, 1, False, False, 300
    t.compile = compile
    cfg.data.kind = "synthetic"
    return cfg


FULL_STEPS = 2


def _full_cfg(compile: bool, dropout: float) -> Config:
    cfg = _cfg(compile=compile)
    cfg.parallel.recompute, cfg.model.dropout = "full", dropout
    cfg.parallel.micro_batch, cfg.train.steps = cfg.parallel.global_batch, FULL_STEPS
    return cfg


def _run(cfg: Config, run_dir: str, mesh):
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh, checkpointing=False)
    trainer.run()
    names = [n for c in trainer.chunks for n, _ in c.named_parameters()]
    rows = []
    if mesh.rank == 0:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return {
        "losses": list(trainer.losses),
        "names": names,
        "rows": rows,
        "compiled": getattr(trainer, "compiled_layers", 0),
    }


def _one(base: str):
    from training.parallel.mesh import ProcessMesh

    mesh = ProcessMesh.from_env(1, 1, 1, 1, timeout_s=300)
    out = {
        "eager": _run(_cfg(), os.path.join(base, "eager"), mesh),
        "compiled": _run(_cfg(compile=True), os.path.join(base, "compiled1"), mesh),
    }
    # recompute=full checkpoints each (compiled) layer whole, and recomputes it with the same dropout masks.
    # Every micro-batch draws a new dropout key, which dynamo compiles anew: FULL_STEPS steps of one micro-batch
    # each (the second step's loss already depends on the first step's recomputed backward); "full_no_dropout"
    # is the same shape without dropout, to show that dropout changed the losses.
    for name, compile, dropout in (
        ("full_no_dropout", False, 0.0),
        ("full_eager", False, 0.1),
        ("full_compiled", True, 0.1),
    ):
        out[name] = _run(_full_cfg(compile, dropout), os.path.join(base, name), mesh)
    mesh.destroy()
    return out


LAYOUTS = {"tp2_sp": (2, 1, 1), "pp2": (1, 2, 1), "dp2_zero1": (1, 1, 2)}


def _two(base: str):
    """The layouts in the same 2 ranks: each mesh's groups are added beside the previous one's (the default group
    stays, nothing is torn down between them)."""
    import torch

    from training.parallel.mesh import ProcessMesh

    out = {}
    for name, (tp, pp, dp) in LAYOUTS.items():
        # A fresh start for dynamo, as a new run's process has (the kernels on disk stay cached): each layout's
        # first step compiles, and says how long that took.
        torch._dynamo.reset()
        mesh = ProcessMesh.from_env(tp, pp, 1, dp, timeout_s=300)
        out[name] = _run(_cfg(tp, pp, dp, compile=True), os.path.join(base, name), mesh)
    mesh.destroy()
    return out


def test_compiled_layers_match_eager_at_tp2_sp_pp2_and_dp2_zero1(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached outside tmp
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool on shared cores
    (single,) = run_distributed(_one, 1, args=(str(tmp_path),), timeout_s=900)
    eager = single["eager"]["losses"]
    assert len(eager) == STEPS and len(set(eager)) == STEPS  # three different steps: the weights moved
    assert single["eager"]["compiled"] == 0 and all("compile_s" not in r for r in single["eager"]["rows"])
    runs = {"single": single["compiled"]}
    full = single["full_eager"]["losses"]
    assert len(full) == FULL_STEPS and full != single["full_no_dropout"]["losses"]  # dropout is on
    assert single["full_compiled"]["losses"] == pytest.approx(full, rel=COMPILE_RTOL)
    ranks = run_distributed(_two, 2, args=(str(tmp_path),), timeout_s=900)
    runs.update(ranks[0])
    for name, got in runs.items():
        assert got["losses"] == pytest.approx(eager, rel=COMPILE_RTOL), name
        # Names are those of the eager model (no `_orig_mod.`): checkpoints do not change with compile.
        assert got["names"] == [n for n in got["names"] if "_orig_mod" not in n], name
        assert [r["step"] for r in got["rows"] if "compile_s" in r] == [1], name
        assert got["rows"][0]["compile_s"] > 0, name
    # Each pipeline stage compiled its own layer (layers stay modules of their own); tp and dp ranks both layers.
    assert [r["tp2_sp"]["compiled"] for r in ranks] == [2, 2] and [r["dp2_zero1"]["compiled"] for r in ranks] == [2, 2]
    assert [r["pp2"]["compiled"] for r in ranks] == [1, 1] and single["compiled"]["compiled"] == 2
    assert ranks[0]["pp2"]["names"] != ranks[1]["pp2"]["names"]  # two stages, two slices of the model


def test_compile_without_a_cxx_compiler_is_a_warning_naming_the_fix(monkeypatch, tmp_path):
    # The compiler on PATH is a fact of the launching machine: the launch gate checks it, the pure planner does not.
    from launcher.launch.gate import validate_for_launch as validate

    cfg = _cfg(compile=True)
    assert not [i for i in validate(cfg).issues if i.key == "train.compile"]  # g++ is on this machine's PATH
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    (issue,) = [i for i in validate(cfg).issues if i.key == "train.compile"]
    assert issue.level == "warning" and "train.compile=false" in issue.fix
    assert not [i for i in validate(_cfg()).issues if i.key == "train.compile"]  # off by default: no check
