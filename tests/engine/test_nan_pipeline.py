"""The first non-finite layer across pipeline stages (one 2-rank pp=2 spawn, two runs in the same ranks).

A NaN written into a weight of one stage makes every later stage's outputs NaN too: each rank's replay finds its
own first non-finite module, and the `nonfinite` event must name the stage where it appeared, not a downstream
one. Run A poisons layer 0 on stage 0 (rank 0): rank 1's layers see a NaN input and are findings too, but the
answer is rank 0's layer. Run B poisons layer 3 on stage 1 (rank 1): stage 0's replay is finite, so rank 1 alone.
"""

import os

import pytest

from helpers.dist import run_distributed
from training.contract.config import Config, config_from_dict, config_to_dict
from training.contract.rundir.events import read_events

NAN_STEP = 2
POISONED = {"A": (0, "layers.0.mlp.fc1"), "B": (1, "layers.3.attn.qkv")}


def _cfg(run_dir: str) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 16
    cfg.parallel.pp, cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 2, 4
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = 3, 1, False
    cfg.train.tensorboard = False
    cfg.train.checkpoint_every = 0
    cfg.data.kind = "synthetic"
    cfg.run.dir = run_dir
    return cfg


def _rank(cfgs: dict):
    import torch

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    rank = int(os.environ["RANK"])
    mesh = ProcessMesh.from_env(1, 2, 1, 1)
    out = {}
    for run, cfg_dict in cfgs.items():
        cfg = config_from_dict(cfg_dict)
        trainer = Trainer(cfg, cfg.run.dir, mesh)
        poison_rank, name = POISONED[run]
        if rank == poison_rank:

            def poison(module, args, trainer=trainer, name=name):
                if trainer.state.step + 1 == NAN_STEP and not getattr(trainer, "poisoned", False):
                    trainer.poisoned = True
                    with torch.no_grad():
                        dict(trainer.chunks[0].named_modules())[name].weight.view(-1)[0] = float("nan")

            trainer.chunks[0].register_forward_pre_hook(poison)
        trainer.run()
        out[run] = sorted(dict(trainer.chunks[0].named_modules()))
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    dirs = {run: str(tmp_path_factory.mktemp(f"nan_{run}")) for run in POISONED}
    cfgs = {run: config_to_dict(_cfg(d)) for run, d in dirs.items()}
    results = run_distributed(_rank, 2, args=(cfgs,), timeout_s=240)
    return dirs, results


def _nonfinite(run_dir):
    found = [e for e in read_events(run_dir) if e["event"] == "nonfinite"]
    assert len(found) == 1, f"expected one nonfinite event (replayed once), got {found}"
    return found[0]


def test_a_nan_on_the_first_stage_is_blamed_there_not_downstream(probed):
    dirs, results = probed
    assert POISONED["A"][1] in results[0]["A"] and POISONED["A"][1] not in results[1]["A"]  # stage 0 holds it
    e = _nonfinite(dirs["A"])
    assert (e["rank"], e["layer"], e["step"]) == (0, POISONED["A"][1], NAN_STEP), e
    by_rank = {f["rank"]: f for f in e["findings"]}
    assert set(by_rank) == {0, 1}  # the downstream stage saw NaN too ...
    assert by_rank[0]["stage"] == 0 and by_rank[0]["input_finite"] is True
    assert by_rank[1]["stage"] == 1 and by_rank[1]["input_finite"] is False  # ... arriving in its input
    assert by_rank[1]["layer"].startswith("layers.2")  # stage 1's first layer, where the NaN entered


def test_a_nan_on_the_last_stage_is_blamed_on_that_stage_alone(probed):
    dirs, results = probed
    assert POISONED["B"][1] in results[1]["B"] and POISONED["B"][1] not in results[0]["B"]
    e = _nonfinite(dirs["B"])
    assert (e["rank"], e["layer"], e["step"]) == (1, POISONED["B"][1], NAN_STEP), e
    assert [(f["rank"], f["stage"], f["input_finite"]) for f in e["findings"]] == [(1, 1, True)]
