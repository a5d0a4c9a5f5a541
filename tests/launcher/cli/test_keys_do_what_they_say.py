"""Keys that do what they say: unknown keys refused even with Hydra's '+', action=keys with
the effective values, NUMA binding and Slurm-only keys on local runs, selective recompute that saves nothing,
pipeline idle share, recommend's complete use: line and headroom, dist_timeout_s, throughput and MFU in the plan,
prepare's skipped files and empty held-out split, generate.prompt_file and the quoting hint."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers.cli import compose_cfg, meshrun

import launcher.data.prepare as lp
from launcher.cli.unknown_keys import nearest_key, quoting_hint
from launcher.data.prepare.config import PrepareConfig
from launcher.plan.estimate import format_plan, make_plan, with_parallel
from launcher.plan.settings import PIPELINE_IDLE_WARN, ignored_on_local, micro_batches_for_idle
from launcher.plan.validate import validate
from launcher.ranks.numa import local_binding, rank_prefix
from launcher.recommend.recommend import recommend
from training.contract.config import Config

# ---- 1. unknown keys, even with '+' -----------------------------------------------------------------------------


def test_plus_typo_is_rejected_with_the_nearest_key(tmp_path):
    run = tmp_path / "r"
    p = meshrun("action=plan", "+parallel.tpp=2", f"run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2 and "'parallel.tpp' is not a config key (did you mean parallel.tp?)" in p.stderr
    assert not run.exists()
    # Without '+', Hydra refuses it; meshrun adds the suggestion.
    q = meshrun("action=plan", "train.nsteps=3", f"run.dir={run}", cwd=tmp_path)
    assert q.returncode == 2 and "did you mean train.steps?" in q.stderr
    # Dict fields still take new keys.
    ok = meshrun(
        "action=plan", "+cluster.env.NCCL_DEBUG=INFO", "cluster.gpus_per_node=2", f"run.dir={run}", cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert nearest_key("cluster.preflight.ib_hca") == "cluster.preflight.ib_hcas"
    assert nearest_key("cluster.tp") == "parallel.tp"  # a leaf under the wrong group


# ---- 2. action=keys: the effective value beside the built-in one -----------------------------------------------


def test_keys_show_effective_values_beside_builtin_defaults(tmp_path):
    p = meshrun("action=keys", "keys.group=parallel", "parallel.micro_batch=3", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    # conf/parallel/default.yaml (the plain launch's preset): tp2, sp, zero1; the command line: micro_batch=3.
    assert "parallel.tp: int = 1    (effective: 2)" in lines
    assert "parallel.sp: bool = False    (effective: True)" in lines
    assert "parallel.zero: int = 0    (effective: 1)" in lines
    assert "parallel.micro_batch: int = 1    (effective: 3)" in lines
    assert "parallel.pp: int = 1" in lines  # unchanged keys carry no annotation


# ---- 3. NUMA on local runs, Slurm-only keys noted ---------------------------------------------------------------


def _fake_numa(tmp_path, nodes):
    root = tmp_path / "node"
    for n in range(nodes):
        (root / f"node{n}").mkdir(parents=True)
        (root / f"node{n}" / "cpulist").write_text(f"{n * 4}-{n * 4 + 3}\n")
    return str(root)


def test_local_ranks_are_numa_bound_as_slurm_ranks(tmp_path):
    cfg = compose_cfg("cluster.gpus_per_node=4")
    two = _fake_numa(tmp_path / "a", 2)
    one = _fake_numa(tmp_path / "b", 1)
    # auto on a two-node machine: contiguous spread, numactl prefix as on Slurm (launcher/slurm/rank_task.py).
    assert [local_binding(cfg, r, 4, two) for r in range(4)] == [0, 0, 1, 1]
    prefix, node = rank_prefix(cfg, 3, 4, two)
    assert node == 1 and prefix == ["numactl", "--cpunodebind=1", "--membind=1"]
    # auto on one NUMA node: nothing to choose; off: never; explicit: the map.
    assert local_binding(cfg, 0, 4, one) is None
    assert local_binding(compose_cfg("cluster.numa=off"), 0, 4, two) is None
    explicit = compose_cfg("cluster.gpus_per_node=2", "cluster.numa=explicit", "cluster.numa_map=[1,0]")
    assert [local_binding(explicit, r, 2, two) for r in range(2)] == [1, 0]


def test_slurm_only_keys_on_a_local_run_get_one_note():
    cfg = compose_cfg(
        "cluster.time_min=5",
        "cluster.max_retries=0",
        "+cluster.sbatch_extra.gres=gpu",
        "cluster.container.image=img.sqsh",
        "cluster.elastic.min_nodes=1",
        "cluster.gpus_per_node=2",
    )
    notes = [i for i in validate(cfg).notes if i.code == "slurm_only"]
    assert len(notes) == 1
    for key in (
        "cluster.time_min",
        "cluster.max_retries",
        "cluster.sbatch_extra",
        "cluster.container.image",
        "cluster.elastic.min_nodes",
    ):
        assert key in notes[0].message
    assert ignored_on_local(compose_cfg("cluster.gpus_per_node=2")) == []
    assert ignored_on_local(compose_cfg("cluster=slurm_dev")) == []  # Slurm reads them


# ---- 4. selective recompute under flash attention -----------------------------------------------------------------


def test_selective_recompute_with_flash_is_warned_and_not_offered():
    cfg = compose_cfg("model=llama3_70b", "cluster=dgx_h100", "parallel=tp8_pp2", "cluster.nodes=2")
    assert str(cfg.model.attention) == "flash" and str(cfg.parallel.recompute) == "selective"
    r = validate(cfg)
    warn = [i for i in r.warnings if i.code == "selective_no_saving"]
    assert len(warn) == 1 and "parallel.recompute=none" in warn[0].fix
    saved = make_plan(with_parallel(cfg, recompute="none")).memory_bytes["total"] - r.plan.memory_bytes["total"]
    assert f"{saved / 2**20:.1f} MiB" in warn[0].message
    # No fit with recompute=none: the fix list does not offer selective (it changes nothing), does offer full.
    nofit = next(i for i in validate(with_parallel(cfg, recompute="none")).errors if i.code == "no_fit")
    assert "recompute=selective" not in nofit.fix and "parallel.recompute=full" in nofit.fix
    # With math attention selective drops the stored scores: no warning.
    math = compose_cfg(
        "model=llama3_70b", "cluster=dgx_h100", "parallel=tp8_pp2", "cluster.nodes=2", "model.attention=math"
    )
    assert not [i for i in validate(math).warnings if i.code == "selective_no_saving"]


# ---- 5. pipeline idle share; recommend's use: line and headroom ---------------------------------------------------


def test_pipeline_idle_share_is_warned_with_the_global_batch_that_fixes_it():
    base = ("parallel=single", "cluster.gpus_per_node=4", "parallel.pp=4", "parallel.micro_batch=1")
    cfg = compose_cfg(*base, "parallel.global_batch=4")
    r = validate(cfg)
    assert r.plan.bubble_idle_fraction == pytest.approx(3 / 7)
    warn = next(i for i in r.warnings if i.code == "pipeline_idle")
    assert "43 %" in warn.message
    gb = int(warn.fix.split("parallel.global_batch=")[1].split()[0])
    fixed = validate(compose_cfg(*base, f"parallel.global_batch={gb}"))
    assert fixed.plan.bubble_idle_fraction <= PIPELINE_IDLE_WARN
    assert not [i for i in fixed.warnings if i.code == "pipeline_idle"]
    # The smallest such batch: one micro-batch fewer is still above the threshold.
    assert (
        validate(compose_cfg(*base, f"parallel.global_batch={gb - 1}")).plan.bubble_idle_fraction > PIPELINE_IDLE_WARN
    )
    assert micro_batches_for_idle(4, 2) % 4 == 0  # interleaved: a multiple of pp


def test_recommend_use_line_is_complete_and_headroom_is_kept():
    over = ("model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=2", "recommend.top=3")
    data = recommend(compose_cfg(*over), "")
    best = data.pop("_objects")["search"].candidates[0]
    use = best.overrides().split()
    assert any(o.startswith("parallel.cp=") for o in use) and any(o.startswith("parallel.dp=") for o in use)
    # Pasted after an explicit, different dp and cp, the line still gives the recommended (valid) layout.
    pasted = compose_cfg(*over, "parallel.dp=16", "parallel.cp=2", *use)
    assert validate(pasted).errors == []
    assert (pasted.parallel.tp, pasted.parallel.pp, pasted.parallel.dp) == (best.plan.tp, best.plan.pp, best.plan.dp)
    # recommend.min_headroom_gb: every candidate leaves that much free; the tightest before is now excluded.
    tightest = min(c["gpu_memory_bytes"] - c["memory_bytes"] for c in data["candidates"] if c["fits"])
    want = (tightest + 2**30) / 2**30
    kept = recommend(compose_cfg(*over, f"recommend.min_headroom_gb={want}"), "")
    kept.pop("_objects")
    assert all(c["gpu_memory_bytes"] - c["memory_bytes"] >= want * 2**30 for c in kept["candidates"] if c["rank"])


# ---- 6. dist_timeout_s ------------------------------------------------------------------------------------------


def test_dist_timeout_defaults_to_ten_minutes_and_says_why(tmp_path):
    assert Config().train.dist_timeout_s == 600.0
    assert compose_cfg().train.dist_timeout_s == 600.0  # no preset lowers it
    p = meshrun("action=keys", "keys.group=train", cwd=tmp_path)
    text = p.stdout.split("train.dist_timeout_s:", 1)[1].split("\ntrain.", 1)[0]
    assert text.startswith(" float = 600.0") and "10 minutes" in text and "thousands of ranks" in text


# ---- 7. tokens/s per GPU and MFU in the plan ----------------------------------------------------------------------


def test_plan_shows_tokens_per_gpu_and_mfu():
    cfg = compose_cfg("model=llama3_8b", "cluster=dgx_h100", "parallel=tp8", "cluster.nodes=1")
    plan = make_plan(cfg)
    assert plan.tokens_per_s_per_gpu == pytest.approx(plan.tokens_per_step / plan.predicted_step_s / plan.world_size)
    assert plan.peak_flops == cfg.cluster.peak_tflops * 1e12 > 0
    assert plan.mfu == pytest.approx(
        plan.model_flops_per_step / (plan.predicted_step_s * plan.world_size * plan.peak_flops)
    )
    assert 0 < plan.mfu < 1
    row = next(line for line in format_plan(plan).splitlines() if line.strip().startswith("throughput"))
    assert f"{plan.tokens_per_s_per_gpu:.4g} tokens/s per GPU" in row and f"MFU {100 * plan.mfu:.1f} %" in row
    assert {"tokens_per_s_per_gpu", "mfu", "peak_flops"} <= set(plan.to_json())


# ---- 8. prepare: skipped files, suffixes, empty held-out split; generate: prompt_file, quoting ------------------


def test_prepare_lists_skipped_files_reads_given_suffixes_and_warns_on_no_held_out(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 20)
    (src / "b.c").write_text("int main(void) { return 0; }\n" * 20)
    (src / "c.dat").write_text("data\n")
    out = str(tmp_path / "out" / "ds")
    desc = lp.prepare(PrepareConfig(inputs=[str(src)], output=out, progress=False, workers=1, valid_fraction=0.01))
    err = capsys.readouterr().err
    assert "skipped 2 files whose suffix is not read" in err and "b.c" in err and "c.dat" in err
    assert "prepare.suffixes" in err and desc["skipped_suffix_files"] == 2 and desc["documents"] == 1
    assert "no document was held out" in err  # one document at 1 %
    desc2 = lp.prepare(
        PrepareConfig(
            inputs=[str(src)],
            output=str(tmp_path / "out" / "ds2"),
            progress=False,
            workers=1,
            suffixes=["txt", ".c"],
            valid_fraction=0.0,
        )
    )
    err2 = capsys.readouterr().err
    assert desc2["documents"] == 2 and "c.dat" in err2 and "b.c" not in err2
    assert "held out" not in err2  # valid_fraction=0 asks for none


def test_generate_prompt_file_and_quoting_hint(tmp_path, monkeypatch):
    from launcher.hf import generate

    prompt = tmp_path / "p.txt"
    prompt.write_text('def main(argv=["a, b"]):\n    print("hi")\n')
    seen = {}

    def fake_run(argv, **kw):
        seen["options"] = json.loads(argv[argv.index("--options") + 1])
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(generate.subprocess, "run", fake_run)
    cfg = compose_cfg("action=generate", f"generate.prompt_file={prompt}")
    generate.run_generate(cfg, str(tmp_path))
    assert seen["options"]["prompt"] == prompt.read_text()  # the file's text, byte for byte, reaches the engine
    both = compose_cfg("action=generate", f"generate.prompt_file={prompt}", "generate.prompt=x")
    with pytest.raises(SystemExit) as exc:
        generate.run_generate(both, str(tmp_path))
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        generate.run_generate(compose_cfg(f"generate.prompt_file={tmp_path / 'none.txt'}"), str(tmp_path))
    monkeypatch.undo()  # subprocess.run is the module's: the CLI calls below need the real one
    # The Hydra parse error comes with a quoting example that works.
    p = meshrun("action=generate", "generate.prompt=def main(", f"run.dir={tmp_path}/nope", cwd=tmp_path)
    assert p.returncode == 2 and "'generate.prompt=\"def main(\"'" in p.stderr and "generate.prompt_file" in p.stderr
    q = meshrun("action=generate", 'generate.prompt="def main("', f"run.dir={tmp_path}/nope", cwd=tmp_path)
    assert q.returncode == 2 and "does not exist" in q.stderr  # parsed: it got as far as the run directory
    assert quoting_hint(["prepare.inputs=[a,b]", "parallel.tp=1,2"]) == ""
