"""The first non-finite layer across pipeline stages (one 2-rank pp=2 spawn, two runs in the same ranks).

A NaN written into a weight of one stage makes every later stage's outputs NaN too: each rank's replay finds its
own first non-finite module, and the `nonfinite` event must name the stage where it appeared, not a downstream
one. Run A poisons layer 0 on stage 0 (rank 0): rank 1's layers see a NaN input and are findings too, but the
answer is rank 0's layer. Run B poisons layer 3 on stage 1 (rank 1): stage 0's replay is finite, so rank 1 alone.

Run C: interleaved 1f1b with 2 virtual stages per rank (one layer each: virtual stage k = chunk c x pp + rank r
holds layer k). Layer 1 (virtual stage 1, rank 1's first chunk) is poisoned; rank 0's second chunk (virtual stage
2) sees the NaN in its input. The answer is rank 1, which comes after rank 0 in rank order but first in virtual
stage order. Run D: step 1's grads are non-finite with a finite loss (an fp16 overflow's shape: the optimizer
skips the step), then step 2's loss is non-finite: the probe was not used up by step 1 and names step 2's layer.
"""

import math
import os

import pytest
from helpers.dist import run_distributed

from training.contract.config import Config, config_from_dict, config_to_dict
from training.contract.rundir.events import read_events
from training.contract.rundir.metrics import read_rows as _metrics

NAN_STEP = 2
POISONED = {
    "A": (0, "layers.0.mlp.fc1"),
    "B": (1, "layers.3.attn.qkv"),
    "C": (1, "layers.1.mlp.fc1"),
    "D": (0, "layers.0.mlp.fc1"),
}
INTERLEAVED = {"C"}
GRAD_NAN = {"D": (1, "layers.2.mlp.fc1")}  # run -> (rank, module): step 1's grads through it become NaN


def _cfg(run_dir: str, interleaved: bool = False) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 16
    cfg.parallel.pp, cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 2, 4
    if interleaved:
        cfg.parallel.vpp, cfg.parallel.schedule, cfg.parallel.micro_batch = 2, "interleaved_1f1b", 1
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
        modules = {n: m for c in trainer.chunks for n, m in c.named_modules()}
        poison_rank, name = POISONED[run]
        if rank == poison_rank:

            def poison(module, args, trainer=trainer, target=modules[name]):
                if trainer.state.step + 1 == NAN_STEP and not getattr(trainer, "poisoned", False):
                    trainer.poisoned = True
                    with torch.no_grad():
                        target.weight.view(-1)[0] = float("nan")

            for c in trainer.chunks:
                c.register_forward_pre_hook(poison)
        if run in GRAD_NAN and rank == GRAD_NAN[run][0]:

            def nan_grad(module, args, output, trainer=trainer):
                if trainer.state.step == 0 and output.requires_grad:
                    output.register_hook(lambda g: g * float("nan"))

            modules[GRAD_NAN[run][1]].register_forward_hook(nan_grad)
        trainer.run()
        out[run] = {"modules": sorted(modules), "losses": list(trainer.losses)}
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    dirs = {run: str(tmp_path_factory.mktemp(f"nan_{run}")) for run in POISONED}
    cfgs = {run: config_to_dict(_cfg(d, run in INTERLEAVED)) for run, d in dirs.items()}
    results = run_distributed(_rank, 2, args=(cfgs,), timeout_s=240)
    return dirs, results


def _nonfinite(run_dir):
    found = [e for e in read_events(run_dir) if e["event"] == "nonfinite"]
    assert len(found) == 1, f"expected one nonfinite event (replayed once), got {found}"
    return found[0]


def test_a_nan_on_the_first_stage_is_blamed_there_not_downstream(probed):
    dirs, results = probed
    assert (
        POISONED["A"][1] in results[0]["A"]["modules"] and POISONED["A"][1] not in results[1]["A"]["modules"]
    )  # stage 0 holds it
    e = _nonfinite(dirs["A"])
    assert (e["rank"], e["layer"], e["step"]) == (0, POISONED["A"][1], NAN_STEP), e
    by_rank = {f["rank"]: f for f in e["findings"]}
    assert set(by_rank) == {0, 1}  # the downstream stage saw NaN too ...
    assert by_rank[0]["stage"] == 0 and by_rank[0]["input_finite"] is True
    assert by_rank[1]["stage"] == 1 and by_rank[1]["input_finite"] is False  # ... arriving in its input
    assert by_rank[1]["layer"].startswith("layers.2")  # stage 1's first layer, where the NaN entered


def test_a_nan_on_the_last_stage_is_blamed_on_that_stage_alone(probed):
    dirs, results = probed
    assert POISONED["B"][1] in results[1]["B"]["modules"] and POISONED["B"][1] not in results[0]["B"]["modules"]
    e = _nonfinite(dirs["B"])
    assert (e["rank"], e["layer"], e["step"]) == (1, POISONED["B"][1], NAN_STEP), e
    assert [(f["rank"], f["stage"], f["input_finite"]) for f in e["findings"]] == [(1, 1, True)]


def test_interleaved_stages_blame_the_first_virtual_stage_not_the_first_rank(probed):
    dirs, results = probed
    # Rank 0 holds virtual stages 0 and 2 (layers 0, 2), rank 1 stages 1 and 3 (layers 1, 3).
    assert {"layers.0", "layers.2"} <= set(results[0]["C"]["modules"]) and "layers.1" not in results[0]["C"]["modules"]
    assert {"layers.1", "layers.3"} <= set(results[1]["C"]["modules"]) and "layers.2" not in results[1]["C"]["modules"]
    e = _nonfinite(dirs["C"])
    assert (e["rank"], e["layer"], e["step"]) == (1, POISONED["C"][1], NAN_STEP), e
    by_rank = {f["rank"]: f for f in e["findings"]}
    assert set(by_rank) == {0, 1}
    assert (by_rank[1]["stage"], by_rank[1]["chunk"], by_rank[1]["input_finite"]) == (1, 0, True)
    assert (by_rank[0]["stage"], by_rank[0]["chunk"], by_rank[0]["input_finite"]) == (2, 1, False)
    assert by_rank[0]["layer"].startswith("layers.2")  # rank 0's stage 0 (layer 0) was finite


def test_a_skipped_nonfinite_grad_step_does_not_use_up_the_probe(probed):
    dirs, results = probed
    for r in results:
        losses = r["D"]["losses"]
        assert math.isfinite(losses[0]) and not math.isfinite(losses[NAN_STEP - 1]), losses
    skips = [(m["step"], m.get("skipped")) for m in _metrics(dirs["D"])]
    # Step 1: non-finite grads, the update skipped; steps 2 and 3: the poisoned weight makes the loss non-finite.
    assert skips == [(1, "nonfinite_grad"), (2, "nonfinite_loss"), (3, "nonfinite_loss")], skips
    e = _nonfinite(dirs["D"])  # one event, for step 2: step 1 did not spend the one-shot replay
    assert (e["rank"], e["layer"], e["step"]) == (0, POISONED["D"][1], NAN_STEP), e
