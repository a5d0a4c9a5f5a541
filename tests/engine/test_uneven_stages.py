"""Uneven pipeline stages in the engine (training/contract/stage_split.py, training/model/gpt.py build_gpt).

A 14-layer GPT (h=32, s=16, synthetic data) trained by the real Trainer at pp2 and pp4 with first and last
stages shorter than the others (Megatron's first/last_stage_layers, and embedding_in_split + loss_in_split),
with and without virtual stages: losses, grad norms and the final parameters equal one process. Checkpoints
move between the even and an uneven split and between pp degrees: the state right after the resume (weights,
Adam moments, step count) equals the state saved, element for element, and the resumed run goes on with the
same losses as an uninterrupted one.

One 4-rank spawn runs every case (pp2 cases at dp2): the launch is the expensive part on two cores.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
from helpers.dist import run_distributed

from training.contract.config import Config

STEPS = 5
LAYERS = 14


def _cfg(pp=1, dp=1, vpp=1, steps=STEPS, **keys) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = LAYERS, 32, 4, 16
    p = cfg.parallel
    p.pp, p.dp, p.vpp, p.zero = pp, dp, vpp, 1 if dp > 1 else 0
    p.schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    p.micro_batch, p.global_batch = 1, 8
    train = {}
    for k, v in keys.items():
        if hasattr(p, k):
            setattr(p, k, v)
        else:
            train[k] = v
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = pp * dp, 1.0  # a fixed peak: no matmul timing
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.dist_timeout_s, t.keep_last = steps, 2, False, 60, 3
    for k, v in train.items():
        setattr(t, k, v)
    cfg.data.kind = "synthetic"
    return cfg


# name -> (layout keys, layers per virtual stage k = chunk c x pp + rank r)
CASES = {
    "pp2_first_short": (dict(pp=2, dp=2, first_stage_layers=6), [6, 8]),
    "pp2_vpp2_last_short": (dict(pp=2, dp=2, vpp=2, last_stage_layers=6), [4, 3, 4, 3]),
    "pp4_first_last_short": (dict(pp=4, first_stage_layers=2, last_stage_layers=2), [2, 5, 5, 2]),
    "pp4_vpp2_embedding_loss_in_split": (
        dict(pp=4, vpp=2, embedding_in_split=True, loss_in_split=True),
        [1, 2, 2, 2, 2, 2, 2, 1],
    ),
}
# Checkpoints: saved at the first layout (stopped at step 3), resumed at the second.
RESHARDS = {
    "even_pp2_to_uneven_pp4": (dict(pp=2, dp=2), dict(pp=4, first_stage_layers=2, last_stage_layers=2)),
    "uneven_pp4_to_even_pp2": (dict(pp=4, first_stage_layers=2, last_stage_layers=2), dict(pp=2, dp=2)),
    "even_pp2_to_uneven_pp2": (dict(pp=2, dp=2), dict(pp=2, dp=2, first_stage_layers=6)),
}
STOP = 3
# Hugging Face export: one step at lr 0 (the checkpoint holds the layout-independent initial weights) at the even
# split and at uneven ones: the exports are the same tensors.
EXPORTS = {
    "even_pp2": dict(pp=2, dp=2),
    "uneven_pp4": dict(pp=4, first_stage_layers=2, last_stage_layers=2),
    "uneven_pp2_vpp2": dict(pp=2, dp=2, vpp=2, last_stage_layers=6),
}


def _shards(trainer) -> list[dict[str, Any]]:
    """This rank's weights and optimizer state per parameter, with where they sit in it (for assembly)."""
    out = []
    for shard in trainer.optimizer.state_dict()["params"]:
        p = shard.param
        values = {k: v.detach().float().numpy().copy() for k, v in shard.tensors.items()}
        n = next(iter(values.values())).size
        values["weight"] = p.detach().float().numpy().ravel()[shard.param_start : shard.param_start + n].copy()
        out.append({"name": shard.name, "shape": tuple(p.shape), "start": shard.param_start, "values": values})
    return out


def _train(cfg: Config, run_dir: str, mesh, capture_resume: bool = False) -> dict[str, Any]:
    from training.contract.rundir.metrics import read_rows
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh)
    captured: dict[str, Any] = {}
    if capture_resume:
        real = trainer._resume

        def _resume():
            real()
            captured["shards"] = _shards(trainer)
            captured["step_count"] = trainer.optimizer.step_count

        trainer._resume = _resume
    code = trainer.run()
    layers = [list(c.layer_ids) for c in trainer.chunks]
    rows = read_rows(run_dir) if mesh.rank == 0 else []
    stats = getattr(trainer.schedule, "stats", None)
    return {
        "code": code,
        "peak_saved_bytes": getattr(stats, "peak_saved_bytes", None),
        "losses": list(trainer.losses),
        "grad_norms": [r["grad_norm"] for r in rows if "grad_norm" in r],
        "layers": layers,
        "pp_rank": mesh.pp_rank,
        "shards": _shards(trainer),
        "step_count": trainer.optimizer.step_count,
        "resumed": captured,
    }


def _mesh(keys: dict[str, Any]):
    from training.parallel.mesh import ProcessMesh

    return ProcessMesh.from_env(1, keys["pp"], 1, keys.get("dp", 1), timeout_s=60)


def _all_cases(base: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    meshes = []
    for name, (keys, _) in CASES.items():
        meshes.append(_mesh(keys))
        out[name] = _train(_cfg(**keys), os.path.join(base, name), meshes[-1])
    for name, (src_keys, dst_keys) in RESHARDS.items():
        src_mesh = _mesh(src_keys)
        src = os.path.join(base, name, "saved")
        saved = _train(_cfg(**src_keys, exit_interval=STOP), src, src_mesh)
        dst = os.path.join(base, name, "resumed")
        if src_mesh.rank == 0:
            shutil.copytree(os.path.join(src, "checkpoints"), os.path.join(dst, "checkpoints"))
        torch.distributed.barrier()  # the copy is complete before any rank resumes from it
        dst_mesh = _mesh(dst_keys)
        resumed = _train(_cfg(**dst_keys), dst, dst_mesh, capture_resume=True)
        from training.contract.rundir.events import read_events

        events = read_events(dst) if dst_mesh.rank == 0 else []
        out[name] = {"saved": saved, "resumed": resumed, "events": events}
        meshes += [src_mesh, dst_mesh]
    for name, keys in EXPORTS.items():
        meshes.append(_mesh(keys))
        run = os.path.join(base, "export", name)
        _train(_cfg(**keys, steps=1, lr=0.0, min_lr=0.0), run, meshes[-1])
        out[f"export/{name}"] = run
    meshes[0].destroy()  # the one process group, and with it every layout's groups
    return out


_REFERENCE: dict[str, Any] = {}


def _reference() -> dict[str, Any]:
    """The same model and data in one process (pp=1, dp=1)."""
    import torch

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    if not _REFERENCE:
        torch.set_num_threads(1)
        run_dir = tempfile.mkdtemp()
        trainer = Trainer(_cfg(), run_dir, ProcessMesh.single(), checkpointing=False)
        trainer.run()
        from training.contract.rundir.metrics import read_rows

        _REFERENCE.update(
            losses=list(trainer.losses),
            grad_norms=[r["grad_norm"] for r in read_rows(run_dir) if "grad_norm" in r],
            params={n: p.detach().float().numpy().copy() for c in trainer.chunks for n, p in c.named_parameters()},
        )
    return _REFERENCE


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_distributed(_all_cases, 4, args=(str(tmp_path_factory.mktemp("uneven")),), timeout_s=900)


def _assemble(shards_per_rank: list[list[dict[str, Any]]], key: str) -> dict[str, np.ndarray]:
    """Full tensors (tp = 1) from every rank's pieces placed at their offsets; every element from some rank."""
    full: dict[str, np.ndarray] = {}
    for shards in shards_per_rank:
        for s in shards:
            buf = full.setdefault(s["name"], np.full(int(np.prod(s["shape"])), np.nan, dtype=np.float32))
            values = s["values"][key].ravel()
            buf[s["start"] : s["start"] + values.size] = values
    for name, buf in full.items():
        assert not np.isnan(buf).any(), f"{name}: part of {key} is on no rank"
    return full


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_uneven_stages_reproduce_single_process(spawned, case):
    keys, counts = CASES[case]
    results = [r[case] for r in spawned]
    # each rank built its own chunks of the split: virtual stage k = chunk c x pp + rank r
    pp = keys["pp"]
    for r in results:
        assert [len(ids) for ids in r["layers"]] == [counts[c * pp + r["pp_rank"]] for c in range(len(r["layers"]))]
    assert sorted(i for r in results[: pp * 1] for ids in r["layers"] for i in ids) == list(range(LAYERS))
    ref = _reference()
    got = results[0]
    assert len(got["losses"]) == STEPS and len(got["grad_norms"]) == STEPS
    for step in range(STEPS):
        assert _rel(got["losses"][step], ref["losses"][step]) < 1e-5, (step, got["losses"], ref["losses"])
        assert _rel(got["grad_norms"][step], ref["grad_norms"][step]) < 1e-4, (step, got["grad_norms"])
    # the gradients of every step: the weights they made equal the single process's
    params = _assemble([r["shards"] for r in results], "weight")
    assert set(params) == set(ref["params"])
    for name, value in params.items():
        want = ref["params"][name].ravel()
        assert np.abs(value - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max())), name


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_stages_activations_match_its_planned_layers(spawned, case):
    """The bytes autograd saved at each stage's peak (the schedule's counter) against the plan's figure for that
    stage, which counts the stage's own layers (launcher/plan/memory.py), within 10 % (tests/engine/test_pipeline.py's
    bound for the even split)."""
    from launcher.plan.memory import device_profile, stage_activation_bytes

    keys, _ = CASES[case]
    cfg = _cfg(**keys)
    m = cfg.parallel.global_batch // (cfg.parallel.micro_batch * keys.get("dp", 1))
    for r in spawned:
        got = r[case]["peak_saved_bytes"]
        planned = stage_activation_bytes(cfg, r[case]["pp_rank"], m, device_profile(cfg))
        assert abs(got - planned) <= 0.1 * planned, (r[case]["pp_rank"], got, planned)


@pytest.mark.slow
@pytest.mark.parametrize("reshard", list(RESHARDS))
def test_checkpoints_reshard_between_even_and_uneven_splits_bit_exactly(spawned, reshard):
    saved = [r[reshard]["saved"] for r in spawned]
    resumed = [r[reshard]["resumed"] for r in spawned]
    assert saved[0]["code"] == 3 and resumed[0]["code"] == 0
    keys = set(saved[0]["shards"][0]["values"])
    assert {"exp_avg", "exp_avg_sq", "weight"} <= keys
    for key in keys:
        before = _assemble([r["shards"] for r in saved], key)
        after = _assemble([r["resumed"]["shards"] for r in resumed], key)
        assert set(before) == set(after) and len(before) > 5
        for name in before:
            assert np.array_equal(before[name], after[name]), (key, name)  # exactly
    assert {r["resumed"]["step_count"] for r in resumed} == {saved[0]["step_count"]} == {STOP}
    # a changed split is a changed layout (the checkpoint's layout names an uneven split's stage layers)
    (event,) = [e for e in spawned[0][reshard]["events"] if e.get("event") == "resumed"]
    assert event["layout_changed"] is True, event
    # the resumed run goes on as the single process does
    ref = _reference()
    got = saved[0]["losses"] + resumed[0]["losses"]
    assert len(got) == STEPS
    for step in range(STEPS):
        assert _rel(got[step], ref["losses"][step]) < 1e-5, (step, got, ref["losses"])


def _exported(run_dir: str, out: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from training.hf.export import export

    export(run_dir, out)
    tensors: dict[str, Any] = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, f)))
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    return tensors


@pytest.mark.slow
def test_hugging_face_export_of_uneven_splits_equals_the_even_ones(spawned, tmp_path):
    import torch

    even = _exported(spawned[0]["export/even_pp2"], str(tmp_path / "even"))
    assert len(even) > 5
    for name in ("uneven_pp4", "uneven_pp2_vpp2"):
        got = _exported(spawned[0][f"export/{name}"], str(tmp_path / name))
        assert sorted(got) == sorted(even), name
        for key in even:
            assert torch.equal(got[key], even[key]), (name, key)
    # trained weights: the uneven pp4 checkpoint of step 3 against the even pp2 one, the same run at two splits
    a = _exported(
        os.path.join(os.path.dirname(spawned[0]["export/even_pp2"]), "..", "uneven_pp4_to_even_pp2", "saved"),
        str(tmp_path / "a"),
    )
    b = _exported(
        os.path.join(os.path.dirname(spawned[0]["export/even_pp2"]), "..", "even_pp2_to_uneven_pp4", "saved"),
        str(tmp_path / "b"),
    )
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=1e-4, atol=1e-6), key
