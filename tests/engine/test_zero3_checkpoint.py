"""ZeRO-3 checkpoints from each rank's own flat shard (training/optim/optimizer.py state_dict's model_shards,
training/checkpoint/manager.py _pieces): a save, a resume and the end of a run never gather the model (each
rank would hold all its tp/pp-local weights beside its shard: 140 GB for a 70B model at tp = pp = 1).

Two gloo ranks, zero=3 dp=2, Zero3Params.gather_all made to raise for the whole run: stopped at step 2 and
resumed, the losses equal the uninterrupted run's bit for bit (the resumed weights and moments are right).
(Resharding across zero stages, and resume at pp=2 with nvme offload,
are tests/engine/test_zero_levers.py's.)"""

from __future__ import annotations

from helpers.dist import run_distributed

STEPS = 4


def _cfg(**train):
    from training.contract.config import Config

    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    p = cfg.parallel
    p.dp, p.zero, p.micro_batch, p.global_batch = 2, 3, 2, 8
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 2, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.dist_timeout_s, t.keep_last = STEPS, 2, False, 60, 5
    for k, v in train.items():
        setattr(t, k, v)
    cfg.data.kind = "synthetic"
    return cfg


def _worker(base: str):
    from training.optim.zero3 import Zero3Params
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    def refuse(self):
        raise AssertionError("a zero=3 run gathered the whole model")

    real = Zero3Params.gather_all
    Zero3Params.gather_all = refuse
    mesh = ProcessMesh.from_env(1, 1, 1, 2, backend="gloo", timeout_s=60)
    whole = Trainer(_cfg(), f"{base}/whole", mesh, checkpointing=False)
    whole.run()
    first = Trainer(_cfg(exit_interval=2), f"{base}/stopped", mesh)
    code_first = first.run()
    second = Trainer(_cfg(), f"{base}/stopped", mesh)
    code_second = second.run()
    Zero3Params.gather_all = real
    mesh.destroy()
    return {
        "codes": (code_first, code_second),
        "whole": list(whole.losses),
        "resumed": list(first.losses) + list(second.losses),
    }


def test_zero3_saves_and_resumes_from_its_shards_without_gathering_the_model(tmp_path):
    results = run_distributed(_worker, 2, args=(str(tmp_path),), timeout_s=240)
    for r in results:
        assert r["codes"] == (3, 0)
        assert r["resumed"] == r["whole"] and len(r["whole"]) == STEPS  # bit for bit
