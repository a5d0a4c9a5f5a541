"""A GPU user's first plans: a `parallel.dp=null` pin is no pin under
parallel=auto, plan-only commands without run.dir leave runs/ to launched runs (and `action=status` of a planned
directory says PLANNED), the plan's MFU on CPU is bounded and says it is uncalibrated, the DGX presets' inter-node
bandwidth is their NICs', every `fix:` line is typeable, a missing dataset is diagnosed alone, and a fixed layout
that does not fit names the node count that does."""

from __future__ import annotations

import json
import os
import re

from helpers.cli import run_cli

from launcher.recommend.auto import pinned_values
from training.contract.config import Config


def test_a_null_pin_pins_nothing():
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.dp = 2, None
    assert pinned_values(cfg, ["parallel.tp=2", "parallel.dp=null", "model=tiny"]) == {"tp": 2}
    cfg.parallel.dp = 4
    assert pinned_values(cfg, ["parallel.dp=4"]) == {"dp": 4}


def test_plan_only_commands_write_apart_from_runs_and_status_says_planned(tmp_path):
    tiny = ("model.num_layers=1", "parallel=single", "cluster.gpus_per_node=1", "data=synthetic")
    for extra in (("action=plan",), ("dry_run=true", "cluster=slurm_dev", "model=tiny", "cluster.cpus_per_task=4")):
        res = run_cli(*(tiny if "action=plan" in extra else ()), *extra, cwd=str(tmp_path))
        assert res.returncode == 0, res.stderr
    assert os.listdir(tmp_path / "runs") == [".plans"]  # no run directory, no runs/latest
    assert os.listdir(tmp_path / "runs" / ".plans")  # (one process: Hydra resolves the timestamp once)
    listing = run_cli("action=runs", cwd=str(tmp_path))
    assert listing.returncode == 0 and "no runs in runs" in listing.stdout, listing.stdout
    # A plan with run.dir is kept there, and that directory's status is PLANNED, naming no log.
    named = run_cli("action=plan", *tiny, "run.dir=runs/mine", cwd=str(tmp_path))
    assert named.returncode == 0, named.stderr
    status = run_cli("action=status", "run.dir=runs/mine", cwd=str(tmp_path))
    assert status.returncode == 0, status.stderr
    out = json.loads(status.stdout)
    assert out["state"] == "PLANNED" and out["log"] is None and out["total_steps"] == 100
    table = run_cli("action=status", "run.dir=runs/mine", "status.format=table", cwd=str(tmp_path))
    assert "PLANNED" in table.stdout and "rank_0.log" not in table.stdout
    listing = run_cli("action=runs", cwd=str(tmp_path))
    assert listing.stdout.splitlines()[1].split()[0] == "PLANNED" and ".plans" not in listing.stdout


def test_cpu_plan_does_not_claim_an_mfu_it_cannot_know(tmp_path):
    """The CPU plan's "peak" was the cost model's own assumed rate, so its MFU was the compute share (99.6 %):
    without cluster.peak_tflops the plan says the rate is uncalibrated and prints the share as a share."""
    res = run_cli(
        "action=plan",
        "model=tiny",
        "parallel=single",
        "parallel.cp=4",
        "cluster.gpus_per_node=4",
        "model.seq_length=4096",
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.strip().startswith("throughput")]
    assert "MFU unknown without cluster.peak_tflops" in line and "uncalibrated" in line and "per rank" in line
    assert "MFU 9" not in line
    (tmp_path / "gpu").mkdir()
    gpu = run_cli("action=plan", "model=llama3_8b", "cluster=dgx_h100", cwd=str(tmp_path / "gpu"))
    (line,) = [x for x in gpu.stdout.splitlines() if x.strip().startswith("throughput")]
    assert "MFU" in line and "(of 989 TFLOP/s per GPU)" in line


def test_dgx_presets_cross_nodes_at_their_nics_bandwidth():
    """dgx_h100: 8 x 400 Gb/s NDR = 400 GB/s per node -> 360 GB/s bus bandwidth (90 %, as dgx_a100's 180 of
    8 x 200 Gb/s HDR); a measured or configured figure wins; CPU clusters keep theirs."""
    from launcher.cli.fast import compose
    from launcher.plan.cost_model import cluster_rates

    h100 = compose(["cluster=dgx_h100"])
    assert h100 is not None
    rates = cluster_rates(h100)
    assert rates.inter_bw == 360e9 and "ib_hcas x ib_rate_gbps" in rates.sources["inter_bw"]
    a100 = compose(["cluster=dgx_a100"])
    assert a100 is not None and cluster_rates(a100).inter_bw == 180e9
    h100.cluster.preflight.busbw_inter_gbps = 300
    assert cluster_rates(h100).inter_bw == 300e9
    assert cluster_rates(Config()).inter_bw == 1e9  # CPU: no NICs counted


KEY_VALUE = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)*=\S+$")


def untypeable(fix: str) -> list[str]:
    """The alternatives of a `fix:` text a user cannot type: each alternative (split at "; ", ", or ", " or ",
    ", ") must be key=value tokens, a `meshrun ...`, `make ...` or `bash ...` command, or another value of the key
    before it (`parallel.global_batch=8 or 16`); `<placeholders>` stand for a value, "(...)" explains, ": ..."
    gives the figure."""
    fix = re.sub(r"<[^<>]*>", "<x>", fix)
    while re.search(r"\([^()]*\)", fix):  # innermost first: "(accumulation = global / (micro x dp))"
        fix = re.sub(r"\([^()]*\)", "", fix)
    bad = []
    for alt in re.split(r";\s+|,\s+or\s+|\s+or\s+|,\s+", fix):
        alt = re.sub(r":\s.*$", "", alt.strip()).strip()
        if not alt or alt.startswith(("meshrun ", "make ", "bash ")) or re.fullmatch(r"[\w.\-]+", alt):
            continue
        if not all(KEY_VALUE.match(t) for t in alt.split()):
            bad.append(alt)
    return bad


BAD_CONFIGS = [
    ["cluster.gpus_per_node=4", "parallel.tp=3"],
    ["cluster.gpus_per_node=3"],
    ["parallel.global_batch=15"],
    ["parallel.micro_batch=3"],
    ["parallel.pp=3"],
    ["parallel.recompute=selective"],
    ["parallel.pp=2", "parallel.vpp=3"],
    ["parallel=single", "cluster.gpus_per_node=1", "parallel.zero=1"],
    ["train.precision=fp16"],
    ["cluster.numa=explicit"],
    ["train.checkpoint_every_min=soon"],
    ["parallel.ep=2"],
    ["model.seq_length=100", "parallel.cp=3"],
    ["model=llama3_70b", "cluster=dgx_h100", "parallel=tp8"],
    ["model=gpt3_175b", "cluster=dgx_h100", "parallel=tp8_pp2"],
]


def test_every_fix_of_a_sample_of_bad_configs_is_typeable():
    from launcher.cli.fast import compose
    from launcher.plan.validate import validate

    seen = 0
    for argv in BAD_CONFIGS:
        cfg = compose(["cluster.gpus_per_node=4", *argv] if "cluster=dgx_h100" not in argv else argv)
        assert cfg is not None, argv
        for issue in validate(cfg).issues:
            if issue.fix:
                seen += 1
                assert not untypeable(issue.fix), (argv, issue.fix, untypeable(issue.fix))
    assert seen >= 15
    assert untypeable("cluster.gpus_per_node=2, or accept the slowdown") == ["accept the slowdown"]
    assert untypeable("make tp x pp x cp divide 4, or set cluster.nodes / cluster.gpus_per_node")


def test_a_missing_dataset_is_diagnosed_alone_with_typeable_fixes(tmp_path):
    res = run_cli("action=plan", "data=indexed", f"data.prefixes=[{tmp_path}/corpus]", cwd=str(tmp_path))
    assert res.returncode == 2
    assert "plan of the rejected layout" not in res.stderr and "total / GPU" not in res.stderr
    fixes = [line.split("fix: ", 1)[1] for line in res.stderr.splitlines() if "fix: " in line]
    assert fixes and all(not untypeable(f) for f in fixes), fixes


def test_a_fixed_layout_that_does_not_fit_names_the_nodes_that_fit(tmp_path):
    """llama3_70b at tp8 and mixtral_8x7b at tp2 on one DGX H100: the first fix is the smallest cluster.nodes at
    which a layout fits, with the keys it changes; "together:" lists only changed keys; that fix plans and fits."""
    for model, layout in (("llama3_70b", "tp8"), ("mixtral_8x7b", "tp2")):
        args = ["action=plan", f"model={model}", "cluster=dgx_h100", f"parallel={layout}"]
        res = run_cli(*args, cwd=str(tmp_path))
        assert res.returncode == 2, res.stderr
        (fix,) = [line.split("fix: ", 1)[1] for line in res.stderr.splitlines() if "fix: " in line]
        assert not untypeable(fix), untypeable(fix)
        first = fix.split("; ")[0]
        assert first.startswith("cluster.nodes=2 ") and "(fits" in first, first
        for part in fix.split("; "):
            if part.startswith("together: "):
                assert "parallel.vpp=1" not in part and "parallel.ep=1" not in part, part
        typed = first.split(":")[0].split()
        ok = run_cli(*args, *typed, f"run.dir={tmp_path}/{model}", cwd=str(tmp_path))
        assert ok.returncode == 0 and "-> fits" in ok.stdout, ok.stderr
