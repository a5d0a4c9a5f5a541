"""The engine on indexed data (gloo, fp32, tiny model, 8 steps, held-out loss every 4):

- tp=2 sp x dp=2 zero=1 and a pipeline layout (pp=2 x dp=2 zero=1, 1f1b) reproduce the single-process training
  and validation losses to 1e-5;
- stopped after step 4 (exit_interval) and resumed at tp=2 sp x dp=2 zero=1: exactly the uninterrupted run's
  training and validation losses.
One spawn of 4 ranks runs the four multi-process runs in turn (a mesh per layout, built once); the
single-process reference runs in this process.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.dist import run_distributed

from launcher.data.prepare import prepare
from launcher.data.prepare.config import PrepareConfig
from training.contract.config import Config, config_from_dict, config_to_dict

STEPS, EVERY = 8, 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(300):
            body = "".join(f"    v{j} = v{j - 1} * {i % 7} + {j}\n" for j in range(1, 2 + i % 9))
            f.write(json.dumps({"text": f"def f{i}(v0):\n{body}    return v{1 + i % 9}\n"}) + "\n")
    out = str(root / "ds")
    prepare(
        PrepareConfig(
            inputs=[str(root / "docs.jsonl")],
            output=out,
            tokenizer="bytes",
            workers=1,
            valid_fraction=0.2,
            progress=False,
        )
    )
    return out


def _cfg(prefix: str, tp=1, pp=1, dp=1, sp=False, zero=0, **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 32, 4, 16, 257
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero = tp, pp, dp, sp, zero
    p.micro_batch, p.global_batch = 2, 8
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * dp, 1.0  # a fixed peak: no matmul timing
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = STEPS, 2, False
    cfg.train.eval_every, cfg.train.eval_iters, cfg.train.dist_timeout_s = EVERY, 2, 60
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg.data.kind, cfg.data.prefixes = "indexed", [prefix]
    return cfg


def _train(cfg_dict: dict, run_dir: str, checkpointing: bool, mesh=None):
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    cfg = config_from_dict(cfg_dict)
    single = mesh is None
    mesh = ProcessMesh.single() if single else mesh
    trainer = Trainer(cfg, run_dir, mesh, checkpointing=checkpointing)
    code = trainer.run()
    out = {"code": code, "losses": trainer.losses, "eval": trainer.eval_losses}
    if single:
        mesh.destroy()
    return out


def _runs(runs):
    """Every (name, config, run dir, checkpointing) in order, in this one spawn: a mesh per layout, built once."""
    from training.parallel.mesh import ProcessMesh

    meshes: dict = {}
    out = {}
    for name, cfg_dict, run_dir, checkpointing in runs:
        p = config_from_dict(cfg_dict).parallel
        key = (p.tp, p.pp, p.cp, p.dp)
        if key not in meshes:
            meshes[key] = ProcessMesh.from_env(*key, timeout_s=60)
        out[name] = _train(cfg_dict, run_dir, checkpointing, meshes[key])
    next(iter(meshes.values())).destroy()  # the one process group, and with it every layout's groups
    return out


@pytest.fixture(scope="module")
def four(dataset, tmp_path_factory):
    """The 4-rank runs: tp=2 sp x dp=2 zero=1 uninterrupted, then stopped at step 4 and resumed in a new Trainer
    (the same run dir); the pipeline layout without checkpoints."""
    base = tmp_path_factory.mktemp("four")
    tp2 = dict(tp=2, dp=2, sp=True, zero=1)
    runs = [
        ("full", _cfg(dataset, **tp2), str(base / "full"), True),
        ("first", _cfg(dataset, exit_interval=4, **tp2), str(base / "stopped"), True),
        ("second", _cfg(dataset, **tp2), str(base / "stopped"), True),
        ("pp", _cfg(dataset, pp=2, dp=2, zero=1), str(base / "pp"), False),
    ]
    plain = [(name, config_to_dict(c), d, ck) for name, c, d, ck in runs]
    return run_distributed(_runs, 4, args=(plain,), timeout_s=600)[0] | {"stopped": str(base / "stopped")}


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    out = _train(config_to_dict(_cfg(dataset)), str(tmp_path_factory.mktemp("ref")), False)
    assert [s for s, _ in out["eval"]] == [4, 8] and out["eval"][1][1] < out["eval"][0][1]
    return out


def _close(got, want, tol=1e-5):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= tol * max(abs(b), 1e-12), (got, want)


def test_tp2_sp_dp2_zero1_matches_one_process_and_resumes_exactly(reference, four):
    full = four["full"]
    assert full["code"] == 0
    _close(full["losses"], reference["losses"])
    _close([v for _, v in full["eval"]], [v for _, v in reference["eval"]])
    run_dir = four["stopped"]
    first = four["first"]
    assert first["code"] == 3 and first["losses"] == full["losses"][:4] and first["eval"] == full["eval"][:1]
    second = four["second"]
    assert second["code"] == 0
    assert second["losses"] == full["losses"][4:]  # exact, not approximately
    assert second["eval"] == full["eval"][1:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 8]


def test_pipeline_layout_matches_one_process_in_training_and_evaluation(reference, four):
    out = four["pp"]
    _close(out["losses"], reference["losses"])
    _close([v for _, v in out["eval"]], [v for _, v in reference["eval"]])
