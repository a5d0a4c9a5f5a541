"""ZeRO-3 checkpoints from each rank's own flat shard (training/optim/optimizer.py state_dict's model_shards,
training/checkpoint/manager.py _pieces): a save, a resume and the end of a run never gather the model (each
rank would hold all its tp/pp-local weights beside its shard: 140 GB for a 70B model at tp = pp = 1).

Two gloo ranks, zero=3 dp=2, Zero3Params.gather_all made to raise for the whole run: stopped at step 2 and
resumed, the losses equal the uninterrupted run's bit for bit (the resumed weights and moments are right).
The same with train.async_save=true and a save every step, each host copy held 0.2 s: every forward starts after
the pending copy ended (the loop's wait before a zero=3 forward, docs/CONTRACTS.md), and the resume is bit-exact.
Export (training/hf/export.py) straight from that zero=3 checkpoint equals the live model gathered in the ranks,
and from bf16 and fp16 zero=2 checkpoints: export.dtype=auto writes the live 16-bit weights, fp32 the masters.
(Resharding across zero stages, and resume at pp=2 with nvme offload,
are tests/engine/test_zero_levers.py's.)"""

from __future__ import annotations

import os

import torch
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
    import torch

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
    # Async saves: each host copy held 0.2 s, so a forward that did not wait for it would start inside it.
    import time

    from training.checkpoint.staging import HostStager

    log: list = []
    real_copy = HostStager.copy

    def slow_copy(self):
        log.append(("copy_start", time.monotonic()))
        time.sleep(0.2)
        real_copy(self)
        log.append(("copy_end", time.monotonic()))

    def timed(trainer):
        real_fb = trainer.schedule.forward_backward

        def fb(*a, **k):
            log.append(("forward", time.monotonic()))
            return real_fb(*a, **k)

        trainer.schedule.forward_backward = fb
        return trainer

    HostStager.copy = slow_copy
    try:
        async_cfg = dict(async_save=True, checkpoint_every=1)
        a_first = timed(Trainer(_cfg(exit_interval=2, **async_cfg), f"{base}/async", mesh))
        a_codes = [a_first.run()]
        a_second = timed(Trainer(_cfg(**async_cfg), f"{base}/async", mesh))
        a_codes.append(a_second.run())
    finally:
        HostStager.copy = real_copy
    Zero3Params.gather_all = real
    a_second.optimizer.zero3.gather_all()  # the live model, gathered in memory: export's reference
    live_zero3 = {n: p.detach().clone() for n, p in a_second.chunks[0].named_parameters()}
    # A bf16 zero=2 run with checkpoints: its bf16 weights beside the fp32 masters.
    bf16 = _cfg(precision="bf16", steps=2)
    bf16.parallel.zero = 2
    b = Trainer(bf16, f"{base}/bf16_zero2", mesh)
    b.run()
    live_bf16 = {n: p.detach().clone() for n, p in b.chunks[0].named_parameters()}
    # fp16 (loss scaling) at zero=2: auto is float16.
    fp16 = _cfg(precision="fp16", steps=2)
    fp16.parallel.zero = 2
    h = Trainer(fp16, f"{base}/fp16_zero2", mesh)
    h.run()
    live_fp16 = {n: p.detach().clone() for n, p in h.chunks[0].named_parameters()}
    if mesh.rank == 0:  # tensors go through a file: a queue would pass them as shared memory of a rank that exits
        torch.save({"zero3": live_zero3, "bf16": live_bf16, "fp16": live_fp16}, f"{base}/live.pt")
    mesh.destroy()
    return {
        "codes": (code_first, code_second),
        "whole": list(whole.losses),
        "resumed": list(first.losses) + list(second.losses),
        "async_codes": tuple(a_codes),
        "async_resumed": list(a_first.losses) + list(a_second.losses),
        "async_log": sorted(log, key=lambda e: e[1]),
    }


def _exported(run_dir: str, out: str, dtype: str):
    from safetensors.torch import load_file

    from training.hf.export import export

    result = export(run_dir, out, dtype=dtype)
    tensors = {}
    for f in result["weight_files"]:
        tensors.update(load_file(os.path.join(out, f)))
    return result, tensors


def _to_hf(run_dir: str, live):
    from training.hf.checkpoint_reader import read_checkpoint
    from training.hf.convert import to_hf
    from training.hf.hf_config import family_for_model

    cfg, _, full = read_checkpoint(run_dir)
    # The live embedding and output layer carry the vocabulary padding; the checkpoint's reader drops it.
    live = {n: t[: full[n].shape[0]] if t.shape != full[n].shape else t for n, t in live.items()}
    return to_hf(live, cfg.model, family_for_model(cfg.model))


def _same(got, ref, label):
    assert sorted(got) == sorted(ref) and got, label
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), f"{label}: {k}"


def test_zero3_saves_and_resumes_from_its_shards_without_gathering_the_model(tmp_path):
    results = run_distributed(_worker, 2, args=(str(tmp_path),), timeout_s=240)
    for r in results:
        assert r["codes"] == (3, 0)
        assert r["resumed"] == r["whole"] and len(r["whole"]) == STEPS  # bit for bit
        # Async saves at zero=3: stopped at step 2 and resumed, bit for bit too.
        assert r["async_codes"] == (3, 0)
        assert r["async_resumed"] == r["whole"]
        # Every copy is over before the next forward begins (4 saves: steps 1 to 4; forwards after 1 and 3).
        kinds = [k for k, _ in r["async_log"]]
        assert kinds.count("copy_start") == 4 and kinds.count("forward") == STEPS, kinds
        pending = False
        for k in kinds:
            pending = (pending or k == "copy_start") and k != "copy_end"
            assert not (k == "forward" and pending), f"a zero=3 forward started during the host copy: {kinds}"
    live = torch.load(str(tmp_path / "live.pt"))
    # Export straight from the zero=3 checkpoint (step 4, written from the async copies of both ranks' shards).
    result, got = _exported(str(tmp_path / "async"), str(tmp_path / "zero3_hf"), "auto")
    assert result["step"] == STEPS and result["dtype"] == "float32"
    _same(got, _to_hf(str(tmp_path / "async"), live["zero3"]), "zero=3 export vs the gathered model")
    # bf16 zero=2: auto is the bf16 weights the run trained in; fp32 the masters, which round to them.
    run = str(tmp_path / "bf16_zero2")
    result, auto = _exported(run, str(tmp_path / "bf16_auto"), "auto")
    assert result["dtype"] == "bfloat16"
    _same(auto, _to_hf(run, live["bf16"]), "bf16 auto export vs the live bf16 weights")
    result, masters = _exported(run, str(tmp_path / "bf16_fp32"), "fp32")
    assert result["dtype"] == "float32"
    _same({k: v.to(torch.bfloat16) for k, v in masters.items()}, auto, "fp32 masters rounded to bf16")
    assert any(not torch.equal(masters[k], auto[k].float()) for k in auto)  # more than the bf16 weights hold
    run = str(tmp_path / "fp16_zero2")
    result, auto = _exported(run, str(tmp_path / "fp16_auto"), "auto")
    assert result["dtype"] == "float16"
    _same(auto, _to_hf(run, live["fp16"]), "fp16 auto export vs the live fp16 weights")
