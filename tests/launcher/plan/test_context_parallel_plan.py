"""The planner with context parallelism (launcher/plan/context_memory.py): device memory in GiB with the presets'
usable capacity, the distributed optimizer sharded over dp x cp, NVIDIA's published Llama 3 layouts on DGX H100
(BF16, seq 8192, micro-batch 1, global batch 128) planned as fitting with cp = 2 and not without, validate's
no-fit fix offering cp, and `action=recommend` searching cp."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.cli.schema import register
from launcher.plan.context_memory import MIB, gpu_memory_bytes
from launcher.plan.estimate import make_plan, with_parallel
from launcher.plan.validate import validate
from launcher.recommend.recommend import layouts, recommend
from training.contract.config import Config

register()


def compose_cfg(*overrides: str) -> Config:
    with initialize_config_dir(version_base=None, config_dir=os.path.join(ROOT, "conf")):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


# NVIDIA's published BF16 layouts on DGX H100 (8 x H100 80 GB per node): Llama 3 8B on 8 GPUs at tp1 cp2,
# Llama 3 70B on 64 GPUs at tp4 pp4 cp2 with 5 virtual stages (sp with tp), the distributed optimizer.
COMMON = (
    "cluster=dgx_h100",
    "train.precision=bf16",
    "model.seq_length=8192",
    "parallel.micro_batch=1",
    "parallel.global_batch=128",
    "parallel.zero=1",
    "parallel.recompute=none",
)
NVIDIA = {
    "llama3_8b": (
        "model=llama3_8b",
        "cluster.nodes=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.vpp=1",
        "parallel.sp=false",
        "parallel.schedule=1f1b",
    ),
    "llama3_70b": (
        "model=llama3_70b",
        "cluster.nodes=8",
        "parallel.tp=4",
        "parallel.pp=4",
        "parallel.vpp=5",
        "parallel.sp=true",
        "parallel.schedule=interleaved_1f1b",
    ),
}


@pytest.mark.parametrize("name", sorted(NVIDIA))
def test_nvidia_llama3_layouts_fit_with_cp2_and_not_without(name):
    with_cp = validate(compose_cfg(*COMMON, *NVIDIA[name], "parallel.cp=2", "action=plan"))
    assert with_cp.errors == [], [str(i.message) for i in with_cp.errors]
    assert with_cp.plan.fits and with_cp.plan.cp == 2
    without = validate(compose_cfg(*COMMON, *NVIDIA[name], "parallel.cp=1", "action=plan"))
    no_fit = [i for i in without.errors if i.code == "no_fit"]
    assert no_fit and not without.plan.fits, without.errors
    # Activation-bound at seq 8192: the no-fit error offers cp x 2 on the same ranks, and it fits.
    (more_cp,) = [f for f in no_fit[0].fix.split("; ") if f.startswith("parallel.cp=2")]
    assert more_cp.endswith("(fits)"), no_fit[0].fix


def test_device_memory_is_read_as_gib_and_presets_carry_usable_capacity():
    assert gpu_memory_bytes(compose_cfg("cluster=dgx_h100")) == 81_559 * MIB
    assert gpu_memory_bytes(compose_cfg("cluster=dgx_a100")) == 81_920 * MIB
    assert gpu_memory_bytes(compose_cfg("cluster=dgx_a100_40gb")) == 40_960 * MIB
    cfg = compose_cfg("cluster=local", "cluster.gpu_memory_gb=2")
    assert make_plan(cfg).gpu_memory_bytes == 2 * 2**30


def test_distributed_optimizer_is_sharded_over_dp_times_cp():
    base = compose_cfg(*COMMON, *NVIDIA["llama3_8b"])
    cp2 = make_plan(with_parallel(base, cp=2)).memory_bytes
    cp1 = make_plan(with_parallel(base, cp=1)).memory_bytes
    assert cp2["optimizer"] == cp1["optimizer"]  # dp 4 x cp 2 and dp 8 x cp 1: eight shards each
    assert cp2["weights"] == cp1["weights"] and cp2["grads"] == cp1["grads"]
    assert cp2["activations"] * 2 == pytest.approx(cp1["activations"], rel=0.01)
    plain = make_plan(with_parallel(base, cp=2, zero=0)).memory_bytes
    assert plain["optimizer"] == 8 * cp2["optimizer"]  # without zero: the whole state on every rank


def test_recommend_searches_cp_at_long_sequences():
    data = recommend(compose_cfg(*COMMON, "model=llama3_8b", "recommend.top=5"), "")
    objects = data.pop("_objects")["search"]
    best = objects.candidates[0]
    assert best.cfg.parallel.cp > 1 and best.plan.fits, best.short()
    assert "parallel.cp=" in best.overrides() and f" cp{best.cfg.parallel.cp} " in f" {best.short()} "
    assert any(c.cfg.parallel.cp == 1 for c in objects.candidates)  # cp = 1 is searched too
    assert {lay.parallel.cp for lay in layouts(compose_cfg(*COMMON, "model=llama3_8b"))} == {1, 2, 4, 8}
    assert {lay.parallel.cp for lay in layouts(compose_cfg("model=tiny", "cluster=local"))} == {1}  # seq 64: no cp
