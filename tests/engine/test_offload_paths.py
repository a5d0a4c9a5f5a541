"""parallel.offload=cpu|nvme on CPU ranks run the GPU's path (training/optim/offload.py, adamw.py):

- offload=cpu keeps the state in a host arena of its own (standing for the pinned memory of a GPU rank), not in
  the device's tensors; nvme in files with block buffers; both updated block by block with the same copies
  in and out as on a GPU, and the result equals offload=none bit for bit (fp32, and fp16 with the fp32 masters
  in the store, which is a GPU rank's path whatever the precision);
- where each byte lives: the store's host bytes equal plan.json's host_offload (and nvme's files its
  nvme_offload), and the elements copied into and out of the store per step equal the shard's size;
- the store's master copy is filled from the parameters segment by segment, never from a whole-shard fp32
  copy on the device (14 B/param at build time on a GPU against the plan's 6).

One process, no process group (dp = 1: the store path has no collective of its own)."""

from __future__ import annotations

import os

import pytest
import torch

from launcher.plan.estimate import make_plan
from training.contract.config import Config
from training.parallel.mesh import ProcessMesh

STEPS = 3


def _cfg(offload: str, precision: str, offload_dir: str, zero: int = 1) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    p = cfg.parallel
    p.zero, p.offload, p.offload_dir = zero, offload, offload_dir
    p.micro_batch, p.global_batch = 2, 4
    cfg.cluster.device, cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = "cpu", 1, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.precision = STEPS, 1, False, precision
    if precision == "fp16":
        t.loss_scale_init, t.loss_scale_window = 2.0**12, 2
    cfg.data.kind = "synthetic"
    return cfg


def _run(cfg: Config, run_dir: str):
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, ProcessMesh.single(), checkpointing=False)
    opt = trainer.optimizer
    store = opt.adamw.store
    built = dict(store.moved) if store is not None else None
    trainer.run()
    opt.finish_param_gather()
    files = {}  # offload=nvme: every file in the store's directory, as the file system holds it after the run
    for root, _, names in os.walk(store.directory) if cfg.parallel.offload == "nvme" else ():
        for name in names:
            st = os.stat(os.path.join(root, name))
            files[os.path.join(root, name)] = (st.st_size, st.st_blocks * 512)
    return {
        "files": files,
        "losses": list(trainer.losses),
        "params": {n: p.detach().float().clone() for n, p in zip(opt.names, opt.params)},
        "memory": opt.memory_report(),
        "store": store,
        "built": built,
        "moved": dict(store.moved) if store is not None else None,
        "shard": opt.shard_size,
        "param_storages": {p.untyped_storage().data_ptr() for p in opt.params},
        "grad_storage": opt.grads.views[0].untyped_storage().data_ptr() if opt.grads.views else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("offload_paths")
    out = {}
    for precision in ("fp32", "fp16"):
        for offload in ("none", "cpu", "nvme"):
            cfg = _cfg(offload, precision, str(base / f"nvme_{precision}"))
            out[offload, precision] = (_run(cfg, str(base / f"{offload}_{precision}")), cfg)
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_on_cpu_runs_the_store_and_equals_no_offload(runs, offload, precision):
    got, cfg = runs[offload, precision]
    ref, _ = runs["none", precision]
    assert got["losses"] == ref["losses"] and len(ref["losses"]) == STEPS
    for name, values in ref["params"].items():
        assert torch.equal(got["params"][name], values), name
    store = got["store"]
    assert store is not None, "offload on a CPU rank must run the store, as on a GPU"
    assert type(store).__name__ == {"cpu": "HostStore", "nvme": "FileStore"}[offload]
    if offload == "cpu":  # a host arena of its own: neither the parameters' nor the grads' memory
        arena = store.arena.untyped_storage().data_ptr()
        assert arena not in got["param_storages"] and arena != got["grad_storage"]
    # Where each byte lives, against plan.json.
    plan = make_plan(cfg).memory_bytes
    keys = ("weights", "grads", "optimizer", "host_offload", "nvme_offload")
    assert got["memory"] == {k: plan[k] for k in keys}
    assert got["memory"]["optimizer"] == 0 and store.host_bytes() == plan["host_offload"] > 0
    if offload == "nvme":  # measured on disk: the state files' sizes, and their blocks really written (not sparse)
        files = got["files"]
        assert sorted(files) == sorted(store.paths.values()), files  # one file per state, nothing else
        assert os.path.dirname(store.directory) == cfg.parallel.offload_dir
        assert sum(size for size, _ in files.values()) == plan["nvme_offload"] > 0
        assert all(on_disk >= size for size, on_disk in files.values()), files
    else:
        assert got["files"] == {}
    # The copies: the master filled once at build (16-bit weights), then per step the grads into the store and,
    # with a master, the new weights out of it.
    master = precision == "fp16"
    shard = got["shard"]
    assert got["built"] == {"to_store": shard if master else 0, "from_store": 0}
    assert got["moved"] == {
        "to_store": got["built"]["to_store"] + STEPS * shard,
        "from_store": STEPS * shard if master else 0,
    }


def test_offload_fills_the_master_segment_by_segment_without_a_device_copy(tmp_path, monkeypatch):
    """No whole-shard fp32 copy of the parameters is made while building an offloaded optimizer (read_shard is
    that copy); the store's master holds the parameters' values exactly."""
    from training.optim.flat import FlatLayout
    from training.run.loop import Trainer

    def refuse(self):
        raise AssertionError("an offloaded optimizer read the whole shard into one fp32 tensor")

    monkeypatch.setattr(FlatLayout, "read_shard", refuse)
    for offload in ("cpu", "nvme"):
        cfg = _cfg(offload, "fp16", str(tmp_path / "nvme"))
        opt = Trainer(cfg, str(tmp_path / offload), ProcessMesh.single(), checkpointing=False).optimizer
        master = opt.adamw.store.tensors()["master"]
        flat = torch.cat([p.detach().float().reshape(-1) for p in opt.params])
        assert torch.equal(master[: flat.numel()], flat) and not master[flat.numel() :].any()
