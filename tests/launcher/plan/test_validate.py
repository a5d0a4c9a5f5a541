"""Validation: every rule reported at once, errors vs warnings, each with its fix."""

from __future__ import annotations

import os
from dataclasses import replace

from helpers import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.cli.schema import register
from launcher.launch.gate import validate_for_launch
from launcher.plan.estimate import with_parallel
from launcher.plan.validate import validate
from training.contract.config import Config

register()


def compose_cfg(*overrides: str) -> Config:
    with initialize_config_dir(version_base=None, config_dir=os.path.join(ROOT, "conf")):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


def _keys(issues):
    return [i.key for i in issues]


def test_default_config_is_valid_and_planned():
    report = validate(compose_cfg())
    assert report.errors == []
    assert report.plan is not None and report.plan.fits


def test_all_errors_at_once_each_with_fix():
    cfg = compose_cfg("parallel.tp=3", "parallel.global_batch=10")
    # Hydra's schema rejects bad choices on the command line (test_cli); a config built in code still gets them listed.
    cfg.model.norm, cfg.parallel.schedule, cfg.cluster.numa = "batchnorm", "zigzag", "everywhere"
    report = validate(cfg)
    keys = _keys(report.errors)
    for key in ("parallel.tp", "model.norm", "parallel.schedule", "cluster.numa"):
        assert key in keys, (key, keys)
    assert all(i.fix for i in report.errors)
    tp = next(i for i in report.errors if i.key == "parallel.tp" and "heads" in i.message)
    assert "[1, 2, 4]" in tp.fix  # the tp values that divide 4 heads within a 4-GPU node


def test_tp_heads_and_query_groups():
    cfg = compose_cfg(
        "model=llama3_8b", "parallel=single", "parallel.tp=16", "cluster.gpus_per_node=16", "cluster.gpu_memory_gb=1000"
    )
    msgs = [i.message for i in validate(cfg).errors]
    assert any("num_query_groups 8 must be divisible by tp=16" in m for m in msgs), msgs


def test_hidden_heads_vocab_and_sizes():
    r = validate(compose_cfg("model.hidden_size=66"))
    assert any(i.key == "model.hidden_size" for i in r.errors)
    r = validate(compose_cfg("model.vocab_size=100", "data=text"))
    assert any(i.key == "model.vocab_size" and "byte" in i.message for i in r.errors)
    assert not any(
        i.key == "model.vocab_size" for i in validate(compose_cfg("model.vocab_size=100", "data=synthetic")).errors
    )
    r = validate(compose_cfg("model.num_layers=-2", "parallel.micro_batch=0"))
    assert {"model.num_layers", "parallel.micro_batch"} <= set(_keys(r.errors))
    assert r.plan is None


def test_vocab_padding_is_said():
    r = validate(compose_cfg("model.vocab_size=257", "parallel.tp=2"))
    note = next(i for i in r.notes if i.key == "model.vocab_size")
    assert "258" in note.message and "+1" in note.message


def test_layers_pipeline_and_interleaving():
    base = compose_cfg("parallel=single", "cluster.gpus_per_node=4")  # 4 layers
    r = validate(with_parallel(base, pp=3, dp=1, global_batch=3, micro_batch=1))
    assert any("not divisible by pp x vpp" in i.message for i in r.errors)
    r = validate(with_parallel(base, pp=8, dp=1))
    assert any("larger than num_layers" in i.message for i in r.errors)
    r = validate(with_parallel(base, pp=2, vpp=2, schedule="1f1b"))
    assert any("needs schedule=interleaved_1f1b" in i.message for i in r.errors)
    r = validate(with_parallel(base, pp=2, vpp=1, schedule="interleaved_1f1b"))
    assert any("needs vpp > 1" in i.message for i in r.errors)
    # dp = 2, micro 1, global 6 -> 3 micro-batches: not a multiple of pp = 2.
    r = validate(with_parallel(base, pp=2, vpp=2, schedule="interleaved_1f1b", micro_batch=1, global_batch=6))
    assert any("multiple of pp=2" in i.message for i in r.errors)
    r = validate(with_parallel(base, pp=2, vpp=2, schedule="interleaved_1f1b", micro_batch=1, global_batch=8))
    assert r.errors == []


def test_sp_cp_world_and_batch():
    base = compose_cfg("parallel=single", "cluster.gpus_per_node=4")
    # sp with tp=1: a warning, and sequence parallelism simply off (as in Megatron-LM), so tp sweeps plan.
    sp_tp1 = validate(with_parallel(base, sp=True))
    assert any(i.key == "parallel.sp" and "off" in i.message for i in sp_tp1.warnings)
    assert not any(i.key == "parallel.sp" for i in sp_tp1.errors) and sp_tp1.plan is not None
    odd = replace(base, model=replace(base.model, seq_length=63))
    assert any(i.key == "parallel.sp" for i in validate(with_parallel(odd, tp=2, sp=True)).errors)
    assert any(i.key == "parallel.cp" for i in validate(with_parallel(odd, cp=2)).errors)
    r = validate(with_parallel(base, dp=8))
    world = next(i for i in r.errors if i.code == "world")
    assert "= 8 but the cluster has 1 x 4 = 4" in world.message and "parallel.dp=4" in world.fix
    r = validate(with_parallel(base, global_batch=10))
    batch = next(i for i in r.errors if i.code == "batch")
    assert "micro_batch x dp = 1 x 4 = 4" in batch.message and "global_batch=8" in batch.fix


def test_tp_across_nodes():
    cfg = compose_cfg("parallel=single", "cluster.gpus_per_node=2", "cluster.nodes=2", "parallel.tp=4")
    assert any("exceeds the 2 GPUs of a node" in i.message for i in validate(cfg).errors)
    allowed = with_parallel(cfg, allow_tp_across_nodes=True)
    assert not any("exceeds" in i.message for i in validate(allowed).errors)


def test_warnings_are_not_errors():
    cfg = compose_cfg(
        "parallel=single",
        "cluster.gpus_per_node=2",
        "parallel.pp=2",
        "parallel.zero=1",
        "parallel.micro_batch=1",
        "parallel.global_batch=1",
    )
    r = validate(cfg)
    assert r.errors == []
    assert {"parallel.zero", "parallel.global_batch"} <= set(_keys(r.warnings))


def test_no_fit_reports_breakdown_and_working_fixes():
    # math attention: selective recompute drops the stored s x s scores (under flash it saves nothing and is not
    # offered, tests/launcher/cli/test_keys_do_what_they_say.py).
    cfg = compose_cfg(
        "model=gpt3_175b",
        "parallel=tp8_pp2",
        "cluster=dgx_h100",
        "cluster.nodes=4",
        "model.attention=math",
        "train.precision=bf16",
        "parallel.recompute=none",
        "parallel.sp=false",
        "parallel.zero=0",
    )
    r = validate(cfg)
    nofit = [i for i in r.errors if i.code == "no_fit"]
    assert len(nofit) == 1 and r.no_fit
    assert "weights" in nofit[0].message and "GiB" in nofit[0].message
    assert "parallel.recompute=selective" in nofit[0].fix and "parallel.sp=true" in nofit[0].fix
    # 3.2 GiB: after the CUDA reserve (context, one NCCL communicator per parallel dimension, fragmentation)
    # the model states and activations get about 1.35 GiB, which some fixes reach and the layout as given does not.
    small = compose_cfg(
        "model=gpt_1p3b",
        "parallel=tp8_pp2",
        "cluster=dgx_h100",
        "cluster.nodes=4",
        "cluster.gpu_memory_gb=3.2",
        "parallel.recompute=none",
        "parallel.sp=false",
        "parallel.micro_batch=1",
        "train.precision=bf16",
    )
    fix = next(i for i in validate(small).errors if i.code == "no_fit").fix
    assert "(fits)" in fix
    # The fix it names really fits.
    label = next(part.split(":")[0] for part in fix.split("; ") if "(fits)" in part and "=" in part)
    changes = {}
    for setting in label.split():  # a fix may set several keys (recompute=full recompute_num_layers=N)
        key, value = setting.split("=")
        changes[key.split(".")[1]] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    assert validate(with_parallel(small, **changes)).errors == []
    assert "kept back" in next(i for i in validate(small).errors if i.code == "no_fit").message


def test_context_parallel_is_planned_and_trained():
    """cp > 1 plans and trains (the engine splits attention over the cp group); its rules still name fixes."""
    planned = validate(compose_cfg("action=plan", "parallel.cp=2", "parallel.tp=1", "parallel.sp=false"))
    assert planned.errors == [] and "parallel.cp" not in _keys(planned.warnings)
    trained = validate(compose_cfg("action=train", "parallel.cp=2", "parallel.tp=1", "parallel.sp=false"))
    assert "parallel.cp" not in _keys(trained.errors)
    odd = validate(
        compose_cfg("action=train", "parallel.cp=2", "parallel.tp=1", "parallel.sp=false", "model.seq_length=18")
    )
    err = next(i for i in odd.errors if i.key == "parallel.cp")
    assert "2 x cp" in err.message and "model.seq_length=20" in err.fix
    dropped = validate(
        compose_cfg("action=train", "parallel.cp=2", "parallel.tp=1", "parallel.sp=false", "model.dropout=0.1")
    )
    assert "model.dropout" in _keys(dropped.errors)
    bad = validate(compose_cfg("action=plan", "parallel.cp_comm=tree"))
    assert "parallel.cp_comm" in _keys(bad.errors)


def test_slurm_settings_are_listed_with_the_layout_errors():
    cfg = compose_cfg("cluster=slurm_dev", "cluster.partition=a$b", "parallel.tp=3")
    report = validate_for_launch(cfg)
    messages = [i.message for i in report.errors]
    assert any("cluster.partition='a$b'" in m and "plain name" in m for m in messages), messages
    assert "parallel.tp" in _keys(report.errors)
    assert validate(compose_cfg("cluster=slurm_dev")).errors == []


def test_missing_data_path_is_an_error_before_launch():
    report = validate_for_launch(compose_cfg("data.paths=[/nonexistent/corpus.txt]"))
    assert "data.paths" in _keys(report.errors)


def test_nan_and_infinity_rejected_for_every_float_key():
    """Walks every float field (train.lr=nan passes `< 0` tests and trained NaN weights before)."""
    from dataclasses import fields, is_dataclass

    cfg = compose_cfg()
    keys = []

    def walk(obj, prefix):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif isinstance(value, float):
                keys.append(f"{prefix}{f.name}")
                setattr(obj, f.name, float("nan") if len(keys) % 2 else float("-inf"))

    walk(cfg, "")
    assert {
        "train.lr",
        "train.min_lr",
        "model.dropout",
        "cluster.gpu_memory_gb",
        "train.dist_timeout_s",
        "cluster.preflight.busbw_intra_gbps",
    } <= set(keys), keys
    finite = {i.key for i in validate(cfg).errors if i.code == "finite"}
    assert finite == set(keys)
    assert len(keys) >= 20  # every float key of the tree, counted by this walk, not by the validator


def test_timeout_port_numa_and_cores(monkeypatch):
    from launcher.launch import host_checks as v

    bad = compose_cfg(
        "train.dist_timeout_s=0",
        "cluster.master_port=80",
        "cluster.numa=explicit",
        "cluster.gpus_per_node=2",
        "parallel=single",
        "parallel.dp=2",
        "cluster.numa_map=[0,7]",
    )
    errors = {i.key: i for i in validate_for_launch(bad).errors}
    assert {"train.dist_timeout_s", "cluster.master_port", "cluster.numa_map"} <= set(errors)
    assert "[7]" in errors["cluster.numa_map"].message and "cluster.numa=auto" in errors["cluster.numa_map"].fix
    for port, ok in ((0, True), (1023, False), (1024, True), (65535, True), (65536, False)):
        got = "cluster.master_port" in _keys(validate(compose_cfg(f"cluster.master_port={port}")).errors)
        assert got is not ok, port
    # A machine with NUMA nodes 0 and 1 (sysfs format "0-1"): node 1 is fine there.
    monkeypatch.setattr(v, "online_numa_nodes", lambda: [0, 1])
    two = compose_cfg("cluster.numa=explicit", "cluster.numa_map=[0,1,1,0]")
    assert "cluster.numa_map" not in _keys(validate_for_launch(two).errors)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # the process's CPUs, not the machine's
    many = validate_for_launch(compose_cfg("cluster.gpus_per_node=4"))
    warn = next(i for i in many.warnings if i.key == "cluster.gpus_per_node")
    assert "4 local ranks on 2 CPU cores" in warn.message and many.errors == []


def test_online_numa_nodes_parses_sysfs_ranges(tmp_path):
    from launcher.ranks.numa import online_numa_nodes

    path = tmp_path / "online"
    path.write_text("0-2,5\n")
    assert online_numa_nodes(str(path)) == [0, 1, 2, 5]
    assert online_numa_nodes(str(tmp_path / "absent")) is None


def test_the_oversubscription_warning_counts_the_cpus_this_process_may_use():
    """The tests audit's D2: under `taskset -c 0` on a 2-CPU machine, 2 local ranks gave no warning (the check
    counted os.cpu_count()). A real affinity limit, set on this process for the check and restored after."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        report = validate_for_launch(compose_cfg("cluster.gpus_per_node=2"))
    finally:
        os.sched_setaffinity(0, before)
    warn = [i for i in report.warnings if i.key == "cluster.gpus_per_node"]
    assert warn and "2 local ranks on 1 CPU cores" in warn[0].message, report.warnings
