"""Bit-exact resume of the real engine (Trainer: model, optimizer, data, loop, CheckpointManager) where the
existing tests did not reach, and the loop's time- and async-driven checkpoint paths.

Each scenario trains a reference run, then the same run stopped early (exit_interval, exit_after_min) and
resumed by a new Trainer in the same run dir: the resumed losses must equal the reference's exactly, and the
state right after resuming (weights, fp32 masters, Adam moments, step count, loss scale and its good-step
counter) must equal the state saved at the stop, element for element.

- one process: dropout 0.1, bf16, fp16 (loss scaling active: the scale changes during the run), exit_after_min,
  checkpoint_every_min, async_save;
- two processes: pp=2 (1f1b) with dropout; bf16 and fp16 checkpoints of the real model saved at tp=2 sp and
  loaded at tp=1 x dp=2 zero=1: weights and fp32 masters equal the saved ones exactly after assembly.

Scenarios share process launches (the expensive part on CI's two cores): one spawn per world size.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest
from helpers.dist import run_distributed

from training.contract.config import Config, config_from_dict, config_to_dict

STEPS = 6


def _cfg(steps=STEPS, tp=1, pp=1, dp=1, dropout=0.0, precision="fp32", **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.dropout = 2, 32, 4, 16, dropout
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero = tp, pp, dp, tp > 1, 1 if dp > 1 else 0
    p.micro_batch, p.global_batch = 2, 8
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * dp, 1.0  # a fixed peak: no matmul timing
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.precision, t.dist_timeout_s = steps, 2, False, precision, 60
    t.keep_last = 3
    for k, v in train.items():
        setattr(t, k, v)
    cfg.data.kind = "synthetic"
    return cfg


def _state(trainer) -> dict[str, Any]:
    """This rank's whole optimizer and model state, as numpy (tensors cannot leave a spawned rank)."""
    opt = trainer.optimizer
    out: dict[str, Any] = {f"adam/{k}": v.detach().float().numpy().copy() for k, v in opt.adamw.tensors().items()}
    for name, p in zip(opt.names, opt.params):
        out[f"param/{name}"] = p.detach().float().numpy().copy()
    out["scalars"] = {"step_count": opt.step_count, "loss_scale": opt.scaler.scale, "good_steps": opt.scaler.good_steps}
    return out


def _shards(trainer) -> list[dict[str, Any]]:
    """fp32 masters and weights of this rank, with where they sit in the full parameter (for assembly)."""
    mesh, out = trainer.mesh, []
    for shard in trainer.optimizer.state_dict()["params"]:
        p = shard.param
        out.append(
            {
                "name": shard.name,
                "tp_rank": mesh.tp_rank,
                "dim": getattr(p, "tp_shard_dim", None),
                "shape": tuple(p.shape),
                "start": shard.param_start,
                "master": shard.tensors["master"].detach().float().numpy().copy(),
                "weight": p.detach().float().numpy().copy(),
            }
        )
    return out


def _train(cfg: Config, run_dir: str, mesh, capture_resume: bool = False):
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh)
    captured: dict[str, Any] = {}
    if capture_resume:
        real = trainer._resume

        def _resume():
            real()
            captured["state"] = _state(trainer)
            captured["shards"] = _shards(trainer) if trainer.optimizer.precision != "fp32" else None

        trainer._resume = _resume
    code = trainer.run()
    return {
        "code": code,
        "losses": list(trainer.losses),
        "state": _state(trainer),
        "resumed": captured,
        "shards": _shards(trainer) if trainer.optimizer.precision != "fp32" else None,
    }


def _stop_and_resume(cfg_ref: Config, cfg_stop: Config, base: str, name: str, mesh) -> dict[str, Any]:
    from training.contract.rundir.events import read_events

    ref = _train(cfg_ref, os.path.join(base, name, "ref"), mesh)
    run = os.path.join(base, name, "run")
    first = _train(cfg_stop, run, mesh)
    cont = config_from_dict(config_to_dict(cfg_stop))
    cont.train.exit_interval, cont.train.exit_after_min, cont.train.checkpoint_every_min = 0, 0.0, 0.0
    second = _train(cont, run, mesh, capture_resume=True)
    return {"ref": ref, "first": first, "second": second, "events": read_events(run)}


def _one_process(base: str) -> dict[str, Any]:
    """Every single-process scenario in one spawned process."""
    from training.parallel.mesh import ProcessMesh

    mesh = ProcessMesh.from_env(1, 1, 1, 1, timeout_s=60)
    out = {
        "dropout": _stop_and_resume(_cfg(dropout=0.1), _cfg(dropout=0.1, exit_interval=3), base, "dropout", mesh),
        "bf16": _stop_and_resume(_cfg(precision="bf16"), _cfg(precision="bf16", exit_interval=3), base, "bf16", mesh),
        # A window of 2 doubles the scale after every 2 finite steps (and an overflow halves it): the scale
        # and its good-step counter are mid-window at the stop at step 3.
        "fp16": _stop_and_resume(
            _cfg(precision="fp16", loss_scale_window=2, loss_scale_init=2.0**15),
            _cfg(precision="fp16", loss_scale_window=2, loss_scale_init=2.0**15, exit_interval=3),
            base,
            "fp16",
            mesh,
        ),
        # 1e-6 minutes (60 us) has passed by the first step boundary on any machine: a deterministic stop.
        "exit_after_min": _stop_and_resume(_cfg(), _cfg(exit_after_min=1e-6), base, "exit_after_min", mesh),
        # Due at every boundary; no stop: the first run goes to the end with a save after every step.
        "checkpoint_every_min": _stop_and_resume(
            _cfg(), _cfg(checkpoint_every_min=1e-7, exit_interval=4), base, "every_min", mesh
        ),
        "async_save": _stop_and_resume(
            _cfg(), _cfg(async_save=True, checkpoint_every=2, exit_interval=4), base, "async", mesh
        ),
    }
    mesh.destroy()
    return out


def _two_processes(base: str) -> dict[str, Any]:
    """pp=2 resume, and bf16/fp16 checkpoints of the real model resharded from tp=2 sp to tp=1 x dp=2 zero=1."""
    import torch

    from training.parallel.mesh import ProcessMesh

    pp2 = ProcessMesh.from_env(1, 2, 1, 1, timeout_s=60)
    out: dict[str, Any] = {
        "pp2": _stop_and_resume(_cfg(pp=2, dropout=0.1), _cfg(pp=2, dropout=0.1, exit_interval=3), base, "pp2", pp2)
    }
    for precision in ("bf16", "fp16"):
        tp2 = ProcessMesh.from_env(2, 1, 1, 1, timeout_s=60)
        src = os.path.join(base, f"reshard_{precision}", "tp2")
        saved = _train(_cfg(tp=2, precision=precision, exit_interval=3), src, tp2)
        dst = os.path.join(base, f"reshard_{precision}", "dp2")
        if tp2.rank == 0:
            shutil.copytree(os.path.join(src, "checkpoints"), os.path.join(dst, "checkpoints"))
        dp2 = ProcessMesh.from_env(1, 1, 1, 2, timeout_s=60)
        torch.distributed.barrier()  # the copy is complete before any rank resumes from it
        loaded = _train(_cfg(dp=2, precision=precision), dst, dp2, capture_resume=True)
        out[precision] = {"saved": saved, "loaded": loaded}
    pp2.destroy()
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_distributed(_one_process, 1, args=(str(tmp_path_factory.mktemp("one")),), timeout_s=300)[0]


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    return run_distributed(_two_processes, 2, args=(str(tmp_path_factory.mktemp("two")),), timeout_s=400)


def _assert_same_state(saved: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert saved["scalars"] == resumed["scalars"]
    assert set(saved) == set(resumed)
    for key in saved:
        if key != "scalars":
            assert np.array_equal(saved[key], resumed[key]), key


def _assert_bit_exact(res: dict[str, Any], stop: int) -> None:
    ref, first, second = res["ref"]["losses"], res["first"]["losses"], res["second"]["losses"]
    assert res["first"]["code"] == 3 and res["second"]["code"] == 0
    assert first == ref[:stop] and second == ref[stop:], (first, second, ref)  # exact, not approximately
    _assert_same_state(res["first"]["state"], res["second"]["resumed"]["state"])
    assert any(e["event"] == "resumed" and e["step"] == stop for e in res["events"])


@pytest.mark.parametrize("name", ["dropout", "bf16", "fp16"])
def test_bit_exact_resume(single, name):
    res = single[name]
    _assert_bit_exact(res, 3)
    if name == "dropout":  # dropout really draws: the run differs from the same run without it
        assert res["ref"]["losses"] != single["exit_after_min"]["ref"]["losses"]
    if name == "fp16":
        scales = [res["first"]["state"]["scalars"], res["ref"]["state"]["scalars"]]
        assert all(s["loss_scale"] != 2.0**15 for s in scales), scales  # the scaler moved (and came back exactly)
    if name in ("bf16", "fp16"):  # fp32 masters were restored, not refilled from the half-precision weights
        shards = res["second"]["resumed"]["shards"]
        assert "adam/master" in res["second"]["resumed"]["state"]
        assert any(
            not np.array_equal(s["master"], s["weight"].ravel()[s["start"] : s["start"] + s["master"].size])
            for s in shards
        )


def test_exit_after_min_stops_at_a_checkpoint_and_resumes(single):
    res = single["exit_after_min"]
    stops = [e for e in res["events"] if e["event"] == "checkpoint" and e["reason"] == "exit_after_min"]
    assert [e["step"] for e in stops] == [1] and len(res["first"]["losses"]) == 1
    _assert_bit_exact(res, 1)


def test_checkpoint_every_min_saves_at_every_boundary(single):
    res = single["checkpoint_every_min"]
    saves = [(e["step"], e["reason"]) for e in res["events"] if e["event"] == "checkpoint"]
    # first run: steps 1-3 by the clock, 4 by exit_interval; the resumed run (clock off): the final step.
    assert saves == [(1, "interval"), (2, "interval"), (3, "interval"), (4, "exit_interval"), (6, "final")], saves
    _assert_bit_exact(res, 4)


def test_async_save_inside_the_loop(single):
    res = single["async_save"]
    saves = [(e["step"], e["reason"]) for e in res["events"] if e["event"] == "checkpoint"]
    assert saves == [(2, "interval"), (4, "exit_interval"), (6, "final")], saves
    assert all(e["blocked_s"] <= e["total_s"] for e in res["events"] if e["event"] == "checkpoint")
    _assert_bit_exact(res, 4)


def test_bit_exact_resume_pp2(double):
    for rank_result in double:
        _assert_same_state(rank_result["pp2"]["first"]["state"], rank_result["pp2"]["second"]["resumed"]["state"])
    _assert_bit_exact(double[0]["pp2"], 3)


def _assemble(shards_per_rank: list[list[dict[str, Any]]], key: str) -> dict[str, np.ndarray]:
    """Full parameters from every rank's pieces: a local flat buffer per (name, tp rank) filled from the dp
    shards at their offsets, then the tp pieces concatenated along the parameter's split dimension."""
    local: dict[str, dict[int, np.ndarray]] = {}
    meta: dict[str, Any] = {}
    for shards in shards_per_rank:
        for s in shards:
            buf = local.setdefault(s["name"], {}).setdefault(
                s["tp_rank"], np.full(int(np.prod(s["shape"])), np.nan, dtype=np.float32)
            )
            values = s[key].ravel() if key == "master" else s[key].ravel()[s["start"] : s["start"] + s["master"].size]
            buf[s["start"] : s["start"] + values.size] = values
            meta[s["name"]] = (s["dim"], s["shape"])
    full = {}
    for name, by_tp in local.items():
        dim, shape = meta[name]
        parts = [by_tp[r].reshape(shape) for r in sorted(by_tp)]
        assert not any(np.isnan(p).any() for p in parts), f"{name}: part of the parameter is on no rank"
        full[name] = parts[0] if dim is None else np.concatenate(parts, axis=dim)
    return full


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reshard_half_precision_checkpoint_of_the_real_model(double, precision):
    saved = _assemble([r[precision]["saved"]["shards"] for r in double], "master")
    loaded = _assemble([r[precision]["loaded"]["resumed"]["shards"] for r in double], "master")
    assert set(saved) == set(loaded) and len(saved) > 5
    for name in saved:
        assert np.array_equal(saved[name], loaded[name]), name  # fp32 masters, exactly
    w_saved = _assemble([r[precision]["saved"]["shards"] for r in double], "weight")
    w_loaded = _assemble([r[precision]["loaded"]["resumed"]["shards"] for r in double], "weight")
    for name in w_saved:
        assert np.array_equal(w_saved[name], w_loaded[name]), name
    res = double[0][precision]
    assert res["saved"]["code"] == 3 and res["loaded"]["code"] == 0
    assert res["saved"]["state"]["scalars"] == res["loaded"]["resumed"]["state"]["scalars"]
    # The masters are fp32 values, not the half-precision weights widened (a refill from the weights would be).
    name = next(n for n in saved if "weight" in n)
    assert not np.array_equal(saved[name], w_saved[name])
