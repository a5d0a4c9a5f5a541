"""ZeRO-2, ZeRO-3, optimizer offload and partial recompute against one process, and their memory against the plan.

A tiny GPT (4 layers, h=32, tied embeddings) on synthetic data, global batch 8 in micro-batches of 2: at dp=2
every rank accumulates 2 micro-batches per step. One 4-rank spawn runs every layout (tp2 sp x dp2, pp2 x dp2
1f1b with partial recompute, pp2 x dp2 interleaved with full recompute) through the real Trainer; the
reference is the same Trainer in this process. Each layout must give the reference's losses (relative 1e-5
over the steps) and its first step's dp-reduced grads (relative norm 1e-5), hold only its shard of the main
grads (no full-size `.grad` left after backward), reduce buckets during backward, and hold exactly plan.json's
per-rank bytes for weights, grads and optimizer state (zero=3: its gathered units within the plan's bound).

The same spawn checks offload (cpu and nvme runs equal their offload=none twins bit for bit), bit-exact resume
at zero=2 and at zero=3 with nvme offload, and checkpoints resharded across stages (saved at tp2 x dp2 zero=1,
resumed at dp4 zero=3, and back): the full state right after resuming equals the state saved, exactly. A
2-process spawn runs one single-rank job per process: fp16 (loss scaling) zero=1 without offload against zero=3
with nvme offload (the fp32 masters offloaded too: losses, loss scale and weights equal bit for bit), and a
larger model whose resident memory with nvme is lower by the optimizer state's size.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from helpers.dist import run_distributed

from training.contract.config import Config, config_from_dict, config_to_dict

STEPS = 4


def _cfg(
    tp=1,
    pp=1,
    dp=1,
    zero=0,
    schedule="1f1b",
    vpp=1,
    recompute="none",
    recompute_num_layers=0,
    reshard=True,
    offload="none",
    offload_dir="",
    **train,
) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 16
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero, p.schedule, p.vpp = tp, pp, dp, tp > 1, zero, schedule, vpp
    p.recompute, p.recompute_num_layers, p.zero3_reshard_after_forward = recompute, recompute_num_layers, reshard
    p.offload, p.offload_dir = offload, offload_dir
    p.micro_batch, p.global_batch, p.bucket_mb = 2, 8, 0.01  # several buckets even for this tiny model
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * dp, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.dist_timeout_s = STEPS, 2, False, 60
    t.keep_last = 5
    for k, v in train.items():
        setattr(t, k, v)
    cfg.data.kind = "synthetic"
    return cfg


LAYOUTS = {
    "tp2_sp_dp2_zero2": dict(tp=2, dp=2, zero=2),
    "pp2_dp2_zero2_1f1b_recompute1": dict(pp=2, dp=2, zero=2, recompute="full", recompute_num_layers=1),
    "pp2_dp2_zero2_interleaved_recompute": dict(
        pp=2, dp=2, zero=2, schedule="interleaved_1f1b", vpp=2, recompute="full"
    ),
    "tp2_sp_dp2_zero3": dict(tp=2, dp=2, zero=3, eval_every=2),
    "pp2_dp2_zero3_1f1b_recompute1": dict(pp=2, dp=2, zero=3, recompute="full", recompute_num_layers=1),
    "pp2_dp2_zero3_interleaved_keep": dict(pp=2, dp=2, zero=3, schedule="interleaved_1f1b", vpp=2, reshard=False),
}
# Offloaded twins of two layouts above: the same run, bit for bit.
OFFLOAD = {
    "tp2_sp_dp2_zero2_nvme": ("tp2_sp_dp2_zero2", dict(offload="nvme")),
    "pp2_dp2_zero3_1f1b_recompute1_cpu": ("pp2_dp2_zero3_1f1b_recompute1", dict(offload="cpu")),
}


def _full_grads(trainer) -> dict[str, np.ndarray]:
    """Every local parameter's reduced grad in its global shape, assembled from the dp shards and tp parts."""
    import torch.distributed as dist

    opt, mesh = trainer.optimizer, trainer.mesh
    shard = opt.reduce_grads().detach().float()
    lay = opt.layout
    flat = torch.zeros(lay.total, dtype=torch.float32)
    flat[lay.shard_lo : lay.shard_hi] = shard
    if lay.zero >= 1 and lay.dp > 1:
        dist.all_reduce(flat, group=opt.dp_group)  # disjoint shards: the sum assembles them
    out = {}
    for name, p, o in zip(opt.names, opt.params, lay.offsets):
        g = flat[o : o + p.numel()].view_as(p).clone()
        dim = getattr(p, "tp_shard_dim", None)
        if dim is not None and mesh.tp > 1:
            parts = [torch.empty_like(g) for _ in range(mesh.tp)]
            dist.all_gather(parts, g, group=mesh.tp_group)
            g = torch.cat(parts, dim=dim)
        out[name] = g.numpy()
    return out


def _full_state(trainer) -> dict[str, np.ndarray]:
    """Every local parameter's values and Adam moments in their global shapes (any layout; collective)."""
    import torch.distributed as dist

    opt, mesh = trainer.optimizer, trainer.mesh
    opt.finish_param_gather()  # a reader of the whole model: zero=3 gathers the parameters
    state = opt.state_dict()
    lay = opt.layout
    out = {}
    for _i, (name, p) in enumerate(zip(opt.names, opt.params)):
        tensors = {"param": p.detach().float().clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(p.numel(), dtype=torch.float32)
            for shard in state["params"]:
                if shard.name == name:
                    t = shard.tensors[key]
                    full[shard.param_start : shard.param_start + t.numel()] = t
            if lay.zero >= 1 and lay.dp > 1:
                dist.all_reduce(full, group=opt.dp_group)
            tensors[key] = full.view_as(p)
        dim = getattr(p, "tp_shard_dim", None)
        for key, g in tensors.items():
            if dim is not None and mesh.tp > 1:
                parts = [torch.empty_like(g) for _ in range(mesh.tp)]
                dist.all_gather(parts, g.contiguous(), group=mesh.tp_group)
                g = torch.cat(parts, dim=dim)
            out[f"{key}/{name}"] = g.numpy()
    out["step_count"] = np.array(opt.step_count)
    return out


def _train(cfg: Config, run_dir: str, mesh, capture_resume: bool = False) -> dict[str, Any]:
    """A whole run with checkpoints; the full state at its end and, resuming, right after the resume."""
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh)
    captured: dict[str, Any] = {}
    if capture_resume:
        real = trainer._resume

        def _resume():
            real()
            captured["state"] = _full_state(trainer)

        trainer._resume = _resume
    code = trainer.run()
    return {"code": code, "losses": list(trainer.losses), "state": _full_state(trainer), "resumed": captured}


def _stop_and_resume(layout: dict[str, Any], base: str, mesh, stop: int = 2) -> dict[str, Any]:
    """The run stopped at `stop` and resumed (its uninterrupted twin is a LAYOUTS run of the same config)."""
    from training.contract.config import config_from_dict, config_to_dict

    first = _train(_cfg(**layout, exit_interval=stop), f"{base}/run", mesh)
    cont = config_from_dict(config_to_dict(_cfg(**layout)))
    second = _train(cont, f"{base}/run", mesh, capture_resume=True)
    return {"first": first, "second": second}


def _reshard(src_layout: dict[str, Any], dst_layout: dict[str, Any], base: str, stop: int = 2) -> dict[str, Any]:
    """Save at one layout (stopped at `stop`), resume the checkpoint at another."""
    import shutil

    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh

    src_cfg, dst_cfg = _cfg(**src_layout, exit_interval=stop), _cfg(**dst_layout)
    p = src_cfg.parallel
    saved = _train(src_cfg, f"{base}/src", ProcessMesh.from_env(p.tp, p.pp, 1, p.dp, timeout_s=60))
    if dist.get_rank() == 0:
        shutil.copytree(f"{base}/src/checkpoints", f"{base}/dst/checkpoints")
    dist.barrier()
    p = dst_cfg.parallel
    loaded = _train(
        dst_cfg, f"{base}/dst", ProcessMesh.from_env(p.tp, p.pp, 1, p.dp, timeout_s=60), capture_resume=True
    )
    return {"saved": saved, "loaded": loaded}


def _run(cfg: Config, run_dir: str, mesh) -> dict[str, Any]:
    """Step-1 grads (before any update), then the whole run from scratch, with what the optimizer holds."""
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh, checkpointing=False)
    opt = trainer.optimizer
    micro = trainer.sampler.micro_batches(0)
    opt.zero_grad(len(micro))
    trainer.schedule.forward_backward(micro)
    left = [n for n, p in zip(opt.names, opt.params) if p.grad is not None]
    grads = _full_grads(trainer)
    opt.zero_grad()
    for c in trainer.chunks:
        c.micro_step = 0  # the dropout key sequence starts over
    trainer.run()
    trainer.optimizer.finish_param_gather()
    params = {n: p.detach().float().numpy().copy() for n, p in zip(opt.names, opt.params)}
    return {
        "losses": list(trainer.losses),
        "grads": grads,
        "grads_left": left,
        "params": params,
        "eval": list(trainer.eval_losses),
        "memory": opt.memory_report(),
        "in_backward": getattr(opt.grads, "launched_in_backward", 0),
        "stage": mesh.pp_rank,
        "gathered": opt.zero3.peak_gathered_bytes if opt.zero3 is not None else 0,
        "prefetched": opt.zero3.prefetched if opt.zero3 is not None else 0,
    }


def _four_ranks(base: str) -> dict[str, Any]:
    from training.parallel.mesh import ProcessMesh

    out = {}
    for name, layout in LAYOUTS.items():
        cfg = _cfg(**layout)
        p = cfg.parallel
        mesh = ProcessMesh.from_env(p.tp, p.pp, 1, p.dp, timeout_s=60)
        out[name] = _run(cfg, f"{base}/{name}", mesh)
    for name, (twin, extra) in OFFLOAD.items():
        cfg = _cfg(**LAYOUTS[twin], **extra, offload_dir=f"{base}/nvme")
        p = cfg.parallel
        mesh = ProcessMesh.from_env(p.tp, p.pp, 1, p.dp, timeout_s=60)
        out[name] = _run(cfg, f"{base}/{name}", mesh)
    tp2 = ProcessMesh.from_env(2, 1, 1, 2, timeout_s=60)
    out["resume_zero2"] = _stop_and_resume(LAYOUTS["tp2_sp_dp2_zero2"], f"{base}/resume_zero2", tp2)
    pp2 = ProcessMesh.from_env(1, 2, 1, 2, timeout_s=60)
    out["resume_zero3_nvme"] = _stop_and_resume(
        dict(LAYOUTS["pp2_dp2_zero3_1f1b_recompute1"], offload="nvme", offload_dir=f"{base}/nvme"),
        f"{base}/resume_zero3",
        pp2,
    )
    # A checkpoint written at pp2 x dp2 zero=2 with 2 virtual stages per rank, for the export test.
    vpp = _train(_cfg(**LAYOUTS["pp2_dp2_zero2_interleaved_recompute"]), f"{base}/export_vpp", pp2)
    out["export_vpp_zero2"] = dict(vpp, dir=f"{base}/export_vpp")
    out["reshard_zero1_to_zero3"] = _reshard(dict(tp=2, dp=2, zero=1), dict(dp=4, zero=3), f"{base}/to3")
    out["reshard_zero3_to_zero1"] = _reshard(dict(dp=4, zero=3), dict(tp=2, dp=2, zero=1), f"{base}/to1")
    pp2.destroy()
    return out


@pytest.fixture(scope="module")
def reference():
    from training.parallel.mesh import ProcessMesh

    torch.set_num_threads(1)
    return _run(_cfg(eval_every=2), tempfile.mkdtemp(), ProcessMesh.single())


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_distributed(_four_ranks, 4, args=(str(tmp_path_factory.mktemp("zero")),), timeout_s=400)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_layout_reproduces_single_process(reference, four, layout):
    from launcher.plan.estimate import make_plan

    ranks = [r[layout] for r in four]
    assert len(ranks[0]["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(ranks[0]["losses"], reference["losses"])):
        assert _rel(a, b) < 1e-5, f"step {step + 1}: loss {a} vs single-process {b}"
    if LAYOUTS[layout].get("eval_every"):  # evaluation (forward only) gathers and releases the units too
        assert len(ranks[0]["eval"]) == 2 and [s for s, _ in ranks[0]["eval"]] == [s for s, _ in reference["eval"]]
        for (_, a), (_, b) in zip(ranks[0]["eval"], reference["eval"]):
            assert _rel(a, b) < 1e-5, (ranks[0]["eval"], reference["eval"])
    grads: dict[str, np.ndarray] = {}
    for r in ranks:
        for name, g in r["grads"].items():
            if name in grads:  # the tied embedding on both pipeline ends, or a tp/dp replica: the same sums
                assert np.allclose(grads[name], g, rtol=1e-6, atol=1e-9), name
            grads[name] = g
    assert set(grads) == set(reference["grads"])
    for name, g in grads.items():
        r = reference["grads"][name]
        err = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-12))
        assert err < 1e-5, f"grad of {name} differs by {err:.2e} (relative norm)"
    plan = make_plan(config_from_dict(config_to_dict(_cfg(**LAYOUTS[layout]))))
    for rank, r in enumerate(ranks):
        assert r["grads_left"] == [], f"rank {rank} kept full-size grads of {r['grads_left']}"
        assert r["in_backward"] > 0, f"rank {rank}: no bucket was reduced during backward"
        expected = plan.stages[r["stage"]].memory_bytes
        assert r["memory"] == {k: expected[k] for k in ("weights", "grads", "optimizer")}, (rank, r["memory"])
        # zero=3: the units gathered at once stay within the plan's bound, and something was gathered.
        assert 0 < r["gathered"] <= expected["zero3_gathered"] if "zero3" in layout else r["gathered"] == 0, (
            rank,
            r["gathered"],
            expected["zero3_gathered"],
        )
        if "zero3" in layout:  # the next unit's gather was issued while the current one computed
            assert r["prefetched"] > 0, rank


@pytest.mark.parametrize("name", list(OFFLOAD))
def test_offload_is_exact_against_no_offload(four, name):
    from launcher.plan.estimate import make_plan

    twin, extra = OFFLOAD[name]
    for rank, r in enumerate(four):
        got, ref = r[name], r[twin]
        assert got["losses"] == ref["losses"], (rank, got["losses"], ref["losses"])  # bit for bit
        for pname, values in ref["params"].items():
            assert np.array_equal(got["params"][pname], values), (rank, pname)
        plan = make_plan(_cfg(**LAYOUTS[twin], **extra, offload_dir="/x")).stages[got["stage"]].memory_bytes
        keys = ("weights", "grads", "optimizer", "host_offload", "nvme_offload")
        assert got["memory"] == {k: plan[k] for k in keys}, (rank, got["memory"])
        assert got["memory"]["optimizer"] == 0 and plan["host_offload"] + plan["nvme_offload"] > 0


def _assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b) and len(a) > 10
    for key in a:
        assert np.array_equal(a[key], b[key]), key


# Each resumed run and its uninterrupted twin (offload=nvme is bit-exact against none: test above).
RESUMED = {"resume_zero2": "tp2_sp_dp2_zero2", "resume_zero3_nvme": "pp2_dp2_zero3_1f1b_recompute1"}


@pytest.mark.parametrize("name", list(RESUMED))
def test_bit_exact_resume(four, name):
    for rank, r in enumerate(four):
        res, twin = r[name], r[RESUMED[name]]
        assert res["first"]["code"] == 3 and res["second"]["code"] == 0, rank
        ref = twin["losses"]
        assert res["first"]["losses"] == ref[:2] and res["second"]["losses"] == ref[2:], rank  # exactly
        _assert_same_state(res["first"]["state"], res["second"]["resumed"]["state"])


@pytest.mark.parametrize("name", ["reshard_zero1_to_zero3", "reshard_zero3_to_zero1"])
def test_checkpoint_reshards_across_zero_stages(four, reference, name):
    saved: dict[str, np.ndarray] = {}
    loaded: dict[str, np.ndarray] = {}
    for r in four:
        saved.update(r[name]["saved"]["state"])
        loaded.update(r[name]["loaded"]["resumed"]["state"])
    _assert_same_state(saved, loaded)
    assert four[0][name]["saved"]["code"] == 3 and four[0][name]["loaded"]["code"] == 0
    # And the resumed run goes on as the single process does.
    losses = four[0][name]["saved"]["losses"] + four[0][name]["loaded"]["losses"]
    assert len(losses) == STEPS
    for a, b in zip(losses, reference["losses"]):
        assert _rel(a, b) < 1e-5, (losses, reference["losses"])


def test_export_from_a_vpp_zero2_checkpoint_is_the_trained_model(four, tmp_path):
    """action=export's code straight from the final checkpoint of a pp2 x dp2 zero=2 interleaved (vpp=2) run: the
    tensors equal the trained model held in the ranks (every stage's parameters at the end of the run), converted
    to Hugging Face names, bit for bit."""
    from safetensors.torch import load_file

    from training.hf.checkpoint_reader import read_checkpoint
    from training.hf.convert import to_hf
    from training.hf.export import export
    from training.hf.hf_config import family_for_model

    live: dict[str, torch.Tensor] = {}
    for r in four:
        assert r["export_vpp_zero2"]["code"] == 0
        for key, value in r["export_vpp_zero2"]["state"].items():
            if key.startswith("param/"):
                live[key[len("param/") :]] = torch.from_numpy(value)
    run = four[0]["export_vpp_zero2"]["dir"]
    cfg, step, full = read_checkpoint(run)
    assert (cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.zero, step) == (2, 2, 2, STEPS)
    assert sorted(live) == sorted(full)  # every virtual stage's parameters, from both pipeline ranks
    live = {n: t[: full[n].shape[0]] if t.shape != full[n].shape else t for n, t in live.items()}  # vocab padding
    ref = to_hf(live, cfg.model, family_for_model(cfg.model))
    result = export(run, str(tmp_path / "hf"))
    got: dict[str, torch.Tensor] = {}
    for f in result["weight_files"]:
        got.update(load_file(str(tmp_path / "hf" / f)))
    assert result["dtype"] == "float32" and sorted(got) == sorted(ref) and got
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def _resident_bytes() -> int:
    """This process's resident bytes once the C allocator has handed back the memory it holds free: the engine
    keeps freed heap memory mapped on CPU (training/run/host_memory.py), so without the trim how much of an
    earlier run's freed memory a later run reuses would decide its measured growth."""
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _offload_single(base: str) -> dict[str, Any]:
    """One single-rank job per process (no process group): rank 0 zero=1 without offload, rank 1 zero=3 with nvme."""
    import gc

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mode = "none" if os.environ["RANK"] == "0" else "nvme"
    nvme = dict(offload=mode, offload_dir=f"{base}/nvme{os.environ['RANK']}")
    # A larger model (3.2 M parameters, 25 MiB of fp32 moments): resident memory after two steps. First, while
    # both processes' heaps are the forkserver's (an earlier run's freed memory, kept by the engine on CPU, would be
    # reused by this one by chance).
    big = _cfg(**nvme)
    big.model.hidden_size, big.model.num_layers, big.model.num_attention_heads = 256, 4, 4
    big.parallel.global_batch = big.parallel.micro_batch = 1
    big.train.steps = 2
    before = _resident_bytes()
    trainer = Trainer(big, f"{base}/big_{mode}", ProcessMesh.single(), checkpointing=False)
    trainer.run()
    out: dict[str, Any] = {
        "resident_growth": _resident_bytes() - before,
        "big_memory": trainer.optimizer.memory_report(),
    }
    del trainer
    gc.collect()
    # fp16 with dynamic loss scaling (a window of 2: the scale moves): the fp32 masters are offloaded with the
    # moments. At dp=1 zero=3 gathers its units from the shard without communication and sums each
    # micro-batch's grads in the order autograd does at zero=1: the two runs must agree bit for bit.
    cfg = _cfg(zero=1 if mode == "none" else 3, precision="fp16", loss_scale_window=2, loss_scale_init=2.0**15, **nvme)
    trainer = Trainer(cfg, f"{base}/fp16_{mode}", ProcessMesh.single(), checkpointing=False)
    trainer.run()
    trainer.optimizer.finish_param_gather()
    out.update(
        {
            "losses": list(trainer.losses),
            "memory": trainer.optimizer.memory_report(),
            "loss_scale": trainer.optimizer.loss_scale,
            "params": {
                n: p.detach().float().numpy().copy() for n, p in zip(trainer.optimizer.names, trainer.optimizer.params)
            },
        }
    )
    return out


@pytest.fixture(scope="module")
def offload_pair(tmp_path_factory):
    return run_distributed(_offload_single, 2, args=(str(tmp_path_factory.mktemp("offload")),), timeout_s=300)


def test_zero3_fp16_with_nvme_offload_of_the_masters_is_exact(offload_pair):
    none, nvme = offload_pair
    assert nvme["losses"] == none["losses"] and len(none["losses"]) == STEPS
    assert none["loss_scale"] == nvme["loss_scale"] != 2.0**15  # the scaler moved, the same way
    for name, values in none["params"].items():
        assert np.array_equal(nvme["params"][name], values), name
    assert nvme["memory"]["optimizer"] == 0 and nvme["memory"]["nvme_offload"] == none["memory"]["optimizer"]


def test_nvme_offload_lowers_resident_memory_by_the_state(offload_pair):
    none, nvme = offload_pair
    state = none["big_memory"]["optimizer"]
    assert nvme["big_memory"]["nvme_offload"] == state and state > 20 * 2**20
    saved = none["resident_growth"] - nvme["resident_growth"]
    # What nvme still holds in host memory is its block buffers (plan.json's host_offload).
    expected = state - nvme["big_memory"]["host_offload"]
    assert saved >= 0.8 * expected, (saved, expected, none["resident_growth"], nvme["resident_growth"])


def _saved_bytes(trainer) -> int:
    """Bytes autograd saves for backward in one micro-batch's forward (parameters excluded, each tensor once)."""
    from training.observe.saved_bytes import saved_activation_bytes

    return saved_activation_bytes(trainer)


def test_recompute_num_layers_activations_match_the_plan():
    """The first N layers keep only their input: the bytes saved for backward (measured with saved-tensor hooks)
    fall between full recompute and none as the plan says (within 10 %, as for the other settings)."""
    from launcher.plan.estimate import make_plan
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    torch.set_num_threads(1)
    measured, planned = {}, {}
    for n in (0, 1, 3):
        cfg = _cfg(recompute="full", recompute_num_layers=n)
        cfg.parallel.global_batch = 2  # one micro-batch in flight: the plan's activations are one micro-batch's
        trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single(), checkpointing=False)
        measured[n], planned[n] = _saved_bytes(trainer), make_plan(cfg).memory_bytes["activations"]
        assert abs(measured[n] - planned[n]) <= 0.10 * planned[n], (n, measured[n], planned[n])
    # 0 recomputes every layer (least kept), 3 all but one, 1 only one (most kept).
    assert measured[0] < measured[3] < measured[1] and planned[0] < planned[3] < planned[1]


# ---- the planner's side (pure Python, no processes) ----------------------------------------------------------


def _13b(**parallel) -> Config:
    """docs/GUIDE.md's example (tests/repo/test_readme.py checks its table): a 13B GPT in fp16 on 8 x 80 GB, pure data parallelism."""
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 40, 5120, 40, 2048, 50257
    c = cfg.cluster
    c.device, c.gpus_per_node, c.gpu_memory_gb = "cuda", 8, 80
    cfg.train.precision = "fp16"
    p = cfg.parallel
    p.tp, p.pp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, 1, False, 1, 2, 64
    for k, v in parallel.items():
        setattr(p, k, v)
    return cfg


def test_zero_stage_bytes_per_parameter_are_the_published_ones():
    from launcher.plan.memory import model_state_bytes_per_param

    for d in (1, 2, 8, 64):
        assert model_state_bytes_per_param("fp16", 2, d) == 2 + 14 / d  # ZeRO Figure 1: 2 + (2 + K)/Nd
        assert model_state_bytes_per_param("fp16", 3, d) == 16 / d
        assert model_state_bytes_per_param("bf16", 2, d) == 2 + 16 / d
        assert model_state_bytes_per_param("fp32", 3, d) == 16 / d


def test_13b_example_plan_by_stage():
    from launcher.plan.estimate import make_plan

    GIB = 2**30
    plans = {z: make_plan(_13b(zero=z)) for z in (1, 2, 3)}
    n = plans[1].params_per_gpu
    shard = -(-n // 8)
    assert not plans[1].fits and plans[2].fits and plans[3].fits
    assert plans[2].memory_bytes["grads"] == shard * 2 and plans[2].memory_bytes["weights"] == n * 2
    assert plans[3].memory_bytes["weights"] == shard * 2 and plans[3].memory_bytes["zero3_gathered"] > 0
    assert round(plans[1].memory_bytes["total"] / GIB, 2) == 91.71  # docs/GUIDE.md's table
    assert round(plans[2].memory_bytes["total"] / GIB, 2) == 70.76
    assert round(plans[3].memory_bytes["total"] / GIB, 2) == 50.99  # at pp = 1 two neighbouring units gathered
    # ZeRO-3 moves 1.5x an all-reduce of the parameters per micro-batch (ZeRO §7): at m = 1, G = W,
    one = {z: make_plan(_13b(zero=z, global_batch=16)) for z in (0, 3)}
    assert one[0].num_microbatches == 1
    assert abs(one[3].comm_bytes["dp"] / one[0].comm_bytes["dp"] - 1.5) < 1e-6
    offloaded = make_plan(_13b(offload="cpu")).memory_bytes
    assert offloaded["optimizer"] == 0 and offloaded["host_offload"] == plans[1].memory_bytes["optimizer"]
    nvme = make_plan(_13b(zero=2, offload="nvme", offload_dir="/x")).memory_bytes
    assert nvme["nvme_offload"] == plans[2].memory_bytes["optimizer"] and nvme["host_offload"] == 3 * 4 * 2**18


def test_validate_and_recommend_reach_the_levers():
    from launcher.plan.cost_model import cluster_rates
    from launcher.plan.validate import validate
    from launcher.recommend.recommend import _deeper_zero, _partial_recompute

    report = validate(_13b())
    text = "\n".join(f"{i.key}: {i.message}; {i.fix}" for i in report.issues)
    for fix in (
        "parallel.zero=2: 70.76 GiB (fits)",
        "parallel.zero=3: 50.99 GiB (fits)",
        "parallel.offload=cpu",
        "parallel.recompute_num_layers=",
    ):
        assert fix in text, text
    bad = validate(_13b(zero=4, offload="nvme"))
    text = "\n".join(f"{i.key}: {i.message}" for i in bad.errors)
    assert "parallel.zero" in text and "parallel.offload_dir" in text
    rates = cluster_rates(_13b())
    deeper = _deeper_zero(_13b(), rates)
    assert deeper is not None and deeper.cfg.parallel.zero == 2 and deeper.plan.fits
    partial = _partial_recompute(_13b(zero=2, recompute="full"), rates)
    assert partial and all(c.plan.fits and c.cfg.parallel.recompute_num_layers > 0 for c in partial)
