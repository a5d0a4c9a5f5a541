"""GPU paths that need several ranks, shown on CPU (gloo ranks with a small collective
timeout, a patched torch.cuda). One 2-rank spawn runs the multi-process cases in the same ranks:
- zero=0 saves (dp rank 0 writes all replicated state) wait under the checkpoint phases' own timeout, not
  the training's collective timeout (a deliberately slow write on rank 0, 3 s collective timeout);
- fp16 main grads are summed over dp in fp32 (a sum that overflows fp16 while its average fits);
- the zero=1 deferred all-gather of the updated shards holds a bounded window of chunks, not a second copy
  of the weights, with the same values, and the plan counts that window.
Single-process: the plan's param_gather bytes, and the reserved-memory check of bench/gpu_check.sh."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.dist import run_distributed

COLLECTIVE_TIMEOUT_S = 3.0
SLOW_WRITE_S = 5.0  # longer than the collective timeout: rank 1 waits this long for rank 0's files


# ---------------------------------------------------------------- multi-process cases
def _fp16_case(mesh):
    """Every rank's grad is 40,000 (fits fp16); their dp sum, 80,000, does not: summed in fp16 it is inf."""
    import torch.distributed as dist

    from training.contract.config import Config
    from training.optim import DistributedOptimizer

    probe = torch.full((4,), 40000.0, dtype=torch.float16)
    dist.all_reduce(probe)  # what a reduction in fp16 gives (gloo sums fp16 in fp16)
    out = {"fp16_sum": float(probe[0])}
    for name, zero, overlap in (
        ("zero0", 0, True),
        ("zero1_scatter", 1, False),
        ("zero1_owner", 1, True),
        ("zero2", 2, True),
    ):
        cfg = Config()
        cfg.parallel.zero, cfg.parallel.dp, cfg.parallel.overlap_grad_reduce = zero, 2, overlap
        cfg.parallel.bucket_mb = 64 / 2**20  # several buckets
        cfg.train.precision = "fp16"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Linear(13, 3)).half()
        opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
        opt.zero_grad(1)
        sum(p.float().sum() for p in model.parameters()).mul(40000.0).backward()  # every grad element 40,000
        shard = opt.reduce_grads()
        counted = torch.cat([shard[lo:hi] for lo, hi in opt._runs])
        out[name] = {
            "dtype": str(shard.dtype),
            "min": float(counted.float().min()),
            "max": float(counted.float().max()),
            "n": counted.numel(),
        }
    return out


def _param_gather_case(mesh):
    """zero=1 dp=2, overlap on: the step returns with the all-gather deferred, the next forward waits for it.
    A tiny in-flight bound (3 chunks) against the unbounded gather: the same parameters bit for bit."""
    import training.contract.precision as precision
    from launcher.plan.estimate import make_plan
    from training.contract.config import Config
    from training.model.gpt import build_gpt
    from training.optim import DistributedOptimizer

    def cfg_():
        cfg = Config()
        m = cfg.model
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 32, 4, 16, 64
        cfg.parallel.zero, cfg.parallel.dp, cfg.parallel.micro_batch, cfg.parallel.global_batch = 1, 2, 1, 2
        cfg.parallel.bucket_mb = 0.01  # 2,621 fp32 grads per bucket: 1,310 elements per rank and chunk
        cfg.cluster.gpus_per_node = 2
        return cfg

    def run(bound):
        precision.PARAM_GATHER_INFLIGHT_BYTES = bound
        cfg = cfg_()
        torch.manual_seed(0)
        chunks = build_gpt(cfg, mesh, torch.float32)
        opt = DistributedOptimizer([(n, p) for c in chunks for n, p in c.named_parameters()], cfg, mesh)
        opt.watch_modules(chunks)
        g = torch.Generator().manual_seed(1 + mesh.dp_rank)
        for _ in range(2):
            tokens = torch.randint(0, 64, (1, 16), generator=g)
            opt.zero_grad(1)
            chunks[0](tokens, tokens).backward()
            opt.step(1e-2, defer_param_gather=True)
            deferred = sum(1 for _ in opt.param_gather._pending) if opt.param_gather._pending else 0
        with torch.no_grad():  # the next forward: each part waits for its chunks through the pre-hooks
            loss = float(chunks[0](tokens, tokens))
        opt.finish_param_gather()
        pg = opt.param_gather
        return {
            "params": torch.cat([p.detach().reshape(-1) for p in opt.params]).numpy(),
            "loss": loss,
            "peak": pg.peak_bytes,
            "inflight": pg.max_inflight,
            "chunks": len(pg.starts),
            "deferred": deferred,
            "report": opt.transient_report()["param_gather"],
            "plan": make_plan(cfg).memory_bytes["param_gather"],
            "full_copy": (opt.dp + 1) * opt.shard_size * 4,
        }

    real = precision.PARAM_GATHER_INFLIGHT_BYTES
    try:
        bounded = run(3 * 3 * 1310 * 4)  # 3 chunks of (dp + 1) x 1,310 fp32 elements
        unbounded = run(1 << 40)
    finally:
        precision.PARAM_GATHER_INFLIGHT_BYTES = real
    return {"bounded": bounded, "unbounded": unbounded}


def _slow_save_case(mesh, run_dir):
    """zero=0 dp=2: dp rank 0 writes every replicated tensor; its write takes SLOW_WRITE_S, longer than the
    3 s collective timeout, while rank 1 waits for it in DCP's collectives and the commit's broadcast."""
    import torch.distributed as dist
    from helpers.checkpoint import StandInModel
    from helpers.checkpoint import stand_in_cfg as _cfg

    from training.checkpoint import CheckpointManager, crc_writer, storage
    from training.optim import DistributedOptimizer

    cfg = _cfg(1, 2, 0)
    model = StandInModel(1, 0)
    opt = DistributedOptimizer(model.named_parameters(), cfg, mesh)
    ck = CheckpointManager(run_dir, mesh, cfg)
    real_write = crc_writer.CrcFileSystemWriter.write_data

    def slow_write(self, plan, planner):
        if dist.get_rank() == 0:
            time.sleep(SLOW_WRITE_S)
        return real_write(self, plan, planner)

    crc_writer.CrcFileSystemWriter.write_data = slow_write
    t = time.monotonic()
    try:
        stats = ck.save(3, [model], opt, {"consumed_samples": 6})
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        stats, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        crc_writer.CrcFileSystemWriter.write_data = real_write
    took = time.monotonic() - t
    problems = storage.verify(storage.step_dir(run_dir, 3)).problems if error is None else None
    # The same files, read back at once by the resume path (also on the checkpoint group).
    resumed = CheckpointManager(run_dir, mesh, cfg).maybe_resume([model], opt, {}) if error is None else None
    return {
        "error": error,
        "took": took,
        "bytes": stats.bytes if stats else 0,
        "problems": problems,
        "resumed": resumed,
    }


def _timeout_control(mesh):
    """The training's collective timeout is really COLLECTIVE_TIMEOUT_S: the same wait on the default group
    fails (last: a timed-out gloo group is not used again)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(SLOW_WRITE_S)
    box = [dist.get_rank()]
    try:
        dist.broadcast_object_list(box, src=0)
        return None
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__


def _two_ranks(run_dir):
    from training.parallel.mesh import ProcessMesh

    mesh = ProcessMesh.from_env(1, 1, 1, 2, timeout_s=COLLECTIVE_TIMEOUT_S, checkpoint_timeout_s=60.0)
    out = {"fp16": _fp16_case(mesh), "gather": _param_gather_case(mesh), "save": _slow_save_case(mesh, run_dir)}
    out["control"] = _timeout_control(mesh)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("round2"))
    return run_distributed(_two_ranks, world_size=2, args=(run_dir,), timeout_s=240)


def test_zero0_save_outlives_the_collective_timeout(two_ranks):
    """Item 7, second half: dp rank 0 writes all replicated state for longer than the collective timeout;
    the other rank waits on the checkpoint group (its own timeout) and the save commits on both."""
    for r in two_ranks:
        save = r["save"]
        assert save["error"] is None, save["error"]
        assert save["took"] >= SLOW_WRITE_S > COLLECTIVE_TIMEOUT_S
        assert save["problems"] == []
        assert save["resumed"] == (3, 6)
    assert two_ranks[0]["save"]["bytes"] > 0  # rank 0 committed it
    # Control: the same wait on the training's default group times out (rank 1 gives up after 3 s).
    assert two_ranks[1]["control"] is not None


def test_fp16_grads_are_summed_over_dp_in_fp32(two_ranks):
    """Risk 'fp16 main grads summed in fp16': 40,000 on each of 2 ranks averages to 40,000, though the sum
    (80,000) overflows fp16 (the control all-reduce in fp16 gives inf). Every reduction path: zero=0
    all-reduce, zero=1 reduce-scatter and reduce-to-owner, zero=2's staged reduce."""
    for r in two_ranks:
        assert r["fp16"]["fp16_sum"] == float("inf")
        for name in ("zero0", "zero1_scatter", "zero1_owner", "zero2"):
            got = r["fp16"][name]
            assert got["dtype"] == "torch.float16" and got["n"] > 0, (name, got)  # the buffer stays fp16
            assert got["min"] == got["max"] == 40000.0, (name, got)


def test_zero1_gather_holds_a_bounded_window_not_a_second_copy(two_ranks):
    """Risk 'the deferred zero=1 gather allocates an unplanned full copy of the weights': with a bound of 3
    chunks, at most 3 chunks' buffers are held (the unbounded gather held the full copy); the values are bit
    for bit those of the unbounded gather; the plan's param_gather equals the optimizer's transient_report
    and bounds what was held."""
    import numpy as np

    for r in two_ranks:
        b, u = r["gather"]["bounded"], r["gather"]["unbounded"]
        assert b["chunks"] > 3 == b["inflight"] and b["deferred"] > 0  # the step returned with gathers pending
        assert np.array_equal(b["params"], u["params"]) and b["loss"] == u["loss"]
        assert u["peak"] == u["full_copy"] > 3 * b["peak"]  # unbounded: every chunk at once
        assert b["peak"] <= b["report"] == b["plan"] == 3 * 3 * 1310 * 4
        assert u["peak"] <= u["report"] == u["plan"]


# ---------------------------------------------------------------- single process
def test_plan_keeps_the_param_gather_back():
    """The window is kept back beside the CUDA reserve: `fits` and the headroom count it (total, the model
    states and activations, stays the published figures)."""
    from launcher.plan.estimate import make_plan
    from launcher.plan.memory import FRAGMENTATION, device_reserve_bytes, param_gather_bytes
    from training.contract.config import Config
    from training.contract.precision import PARAM_GATHER_INFLIGHT_BYTES

    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 4, 512, 8
    cfg.cluster.gpus_per_node, cfg.parallel.dp, cfg.parallel.global_batch = 8, 8, 8
    cfg.train.precision = "bf16"
    cfg.cluster.device = "cuda"
    plans = {}
    for zero in (0, 1, 2, 3):
        cfg.parallel.zero = zero
        plans[zero] = make_plan(cfg)
    assert plans[0].memory_bytes["param_gather"] == plans[3].memory_bytes["param_gather"] == 0
    for zero in (1, 2):
        cfg.parallel.zero = zero
        plan, mem = plans[zero], plans[zero].memory_bytes
        assert 0 < mem["param_gather"] <= PARAM_GATHER_INFLIGHT_BYTES
        assert plan.reserve_bytes == device_reserve_bytes(cfg, plan.gpu_memory_bytes) + mem["param_gather"]
        # Exactly as much GPU as the plan without the window: no longer fits.
        fixed = plan.reserve_bytes - mem["param_gather"] - int(FRAGMENTATION * plan.gpu_memory_bytes)
        cfg.cluster.gpu_memory_gb = ((mem["total"] + fixed) / (1 - FRAGMENTATION) + 2**20) / 2**30
        tight = make_plan(cfg)
        assert tight.memory_bytes["param_gather"] == mem["param_gather"] and not tight.fits
        assert 0 < tight.headroom_bytes + mem["param_gather"] < 2**20  # it would, without the window
        cfg.cluster.gpu_memory_gb = 80
    # Large enough that the bound binds: a 7B-class model's weights at dp=8 would be GBs, the window is not.
    cfg.parallel.zero = 1
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 32, 4096, 32
    n = make_plan(cfg).params_per_gpu
    assert param_gather_bytes(cfg, n, 8) <= PARAM_GATHER_INFLIGHT_BYTES < 9 * -(-n // 8) * 2 // 10


def test_reserved_memory_is_compared_with_the_plan_and_its_fragmentation_share(monkeypatch):
    """(d): `fits` counts allocated bytes; the allocator reserves more. The run records max_memory_reserved
    (patched torch.cuda here) and bench/gpu_check.sh compares it with the plan's total plus FRAGMENTATION of
    the GPU, and with the rest of the reserve against the device."""
    import training.run.loop as loop
    from launcher.plan.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, reserved_check

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 7 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 6 * 2**30)
    cuda = torch.device("cuda", 0)
    assert loop.peak_reserved_bytes(cuda) == 7 * 2**30 and loop.peak_memory_bytes(cuda) == 6 * 2**30
    cpu = torch.device("cpu")
    assert loop.peak_reserved_bytes(cpu) == loop.peak_memory_bytes(cpu) > 0
    gpu = 80 * 2**30
    frag = int(FRAGMENTATION * gpu)
    plan = {"gpu_memory_bytes": gpu, "memory_bytes": {"total": 6 * 2**30}, "reserve_bytes": CUDA_CONTEXT_BYTES + frag}
    ok = reserved_check(plan, 6 * 2**30 + frag)
    assert ok["within_plan"] and ok["within_device"] and ok["plan_limit"] == 6 * 2**30 + frag
    over = reserved_check(plan, 6 * 2**30 + frag + 1)  # allocated fits the plan; reserved does not
    assert not over["within_plan"] and over["within_device"]
    full = reserved_check(plan, gpu - CUDA_CONTEXT_BYTES + 1)
    assert not full["within_device"]


def test_checkpoint_staging_buffers_are_pinned_for_gpu_sources(monkeypatch):
    """Risk 'pageable staging buffers': the async save's host buffers are pinned when the state is on a GPU
    (a pageable destination makes the copy synchronous), pageable for CPU state. Stand-in: a tensor that
    says it is on CUDA, torch.empty recording what it was asked for."""
    from training.checkpoint.layout import Piece
    from training.checkpoint.staging import HostStager

    asked = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        asked.append(kw.get("pin_memory"))
        return real_empty(*shape, **{k: v for k, v in kw.items() if k != "pin_memory"})

    class OnGpu:
        def __init__(self, t):
            self.t, self.shape, self.dtype, self.is_cuda, self.is_meta = t, t.shape, t.dtype, True, False

        def detach(self):
            return self

    class Event:
        def record(self, stream=None):
            pass

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    pieces = [Piece("model/w", OnGpu(torch.ones(3)), (0,), (3,)), Piece("model/b", torch.ones(2), (0,), (2,))]
    HostStager().prepare(pieces)
    assert asked == [True, False]


def test_checkpoint_rng_holds_the_ranks_own_gpu_only(monkeypatch):
    """Risk 'RNG of every visible GPU': a checkpoint keeps the rank's own device's CUDA RNG state, and restores it
    under a binding that shows fewer GPUs (set_rng_state_all raised IndexError). An earlier checkpoint's list of
    every visible GPU restores this rank's entry. Stand-in: a torch.cuda of 2 visible GPUs, current device 1."""
    from training.checkpoint import manager

    states = {0: torch.full((8,), 10, dtype=torch.uint8), 1: torch.full((8,), 11, dtype=torch.uint8)}
    current = {"index": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[current["index"]].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, device="cuda": states.__setitem__(current["index"], t))

    def all_states(*a, **k):
        raise AssertionError("every visible GPU's RNG state touched")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", all_states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", all_states)
    saved = manager._rng_state()
    assert saved["cuda_device"] == [11] * 8 and "cuda" not in saved
    current["index"], states[0] = 0, torch.zeros(8, dtype=torch.uint8)  # resumed as another binding's device 0
    manager._set_rng_state(saved)
    assert states[0].tolist() == [11] * 8
    old = {**saved, "cuda": [[20] * 8, [21] * 8]}
    del old["cuda_device"]
    current["index"] = 1
    manager._set_rng_state(old)
    assert states[1].tolist() == [21] * 8
