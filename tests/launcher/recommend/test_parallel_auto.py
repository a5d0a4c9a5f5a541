"""parallel=auto, the default parallel group of the cuda cluster presets (launcher/recommend/auto.py): a GPU user's
first `meshrun action=plan model=M cluster=dgx_h100 cluster.nodes=N` plans and fits with no other key, the chosen
layout is the recommender's best (checked against a separate `action=recommend`), printed with the runner-up and
why; pinned keys are kept, a named preset is that preset, a resumed run keeps its layout, CPU presets keep theirs.
One sweep process plans every packaged model at 1, 8 and 64 nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.cli import run_cli

MODELS = sorted(f[: -len(".yaml")] for f in os.listdir(os.path.join(ROOT, "conf", "model")) if f.endswith(".yaml"))
NODES = (1, 8, 64)


def _meshrun(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], capture_output=True, text=True, cwd=str(cwd), timeout=600
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every packaged model at 1, 8 and 64 DGX H100 nodes, no other key: one sweep, one process."""
    d = tmp_path_factory.mktemp("auto_sweep")
    p = _meshrun(
        "-m",
        "action=plan",
        f"model={','.join(MODELS)}",
        "cluster=dgx_h100",
        f"cluster.nodes={','.join(map(str, NODES))}",
        f"hydra.sweep.dir={d}/sweep",
        cwd=d,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    with open(d / "sweep" / "sweep.json") as f:
        return d, json.load(f)


def _point(point):
    over = dict(o.split("=", 1) for o in point["overrides"])
    return over["model"], int(over["cluster.nodes"])


def test_every_packaged_model_plans_and_fits_on_dgx_h100_wherever_a_layout_fits(sweep):
    d, data = sweep
    points = {_point(p): p for p in data["points"]}
    assert set(points) == {(m, n) for m in MODELS for n in NODES}
    no_fit = []
    for (model, nodes), point in points.items():
        if point["status"] != "ok":
            assert point["status"] == "no_fit", point
            no_fit.append((model, nodes))
            continue
        with open(os.path.join(point["run_dir"], "plan.json")) as f:
            plan = json.load(f)
        with open(os.path.join(point["run_dir"], "config.json")) as f:
            config = json.load(f)
        assert plan["fits"], (model, nodes)
        auto = plan["auto"]
        assert 1 <= auto["chosen"]["rank"] <= 3, (model, nodes, auto)
        assert auto["why"] and auto["chosen"]["why"], auto
        # config.json keeps the chosen values (auto false: a resume keeps them) and the plan is of that layout.
        assert config["parallel"]["auto"] is False
        assert config["parallel"]["tp"] == plan["tp"] and config["parallel"]["pp"] == plan["pp"]
        assert f"parallel.tp={plan['tp']} " in auto["chosen"]["overrides"]
        # A GPU preset's global batch is about a million tokens, not the CPU demo's 16 sequences.
        tokens = config["parallel"]["global_batch"] * config["model"]["seq_length"]
        assert 2**19 <= tokens <= 2**21, (model, tokens)
    # Where nothing fits, the recommender (another action, with the same batch) agrees that no layout fits.
    assert len(no_fit) < len(points) // 2, no_fit
    for model, nodes in no_fit:
        p = _meshrun(
            "action=recommend", f"model={model}", "cluster=dgx_h100", f"cluster.nodes={nodes}", f"run.dir={d}/r", cwd=d
        )
        assert p.returncode == 0, p.stderr
        with open(d / "r" / "recommend.json") as f:
            assert json.load(f)["fitting"] == 0, (model, nodes)


@pytest.mark.parametrize("model,nodes", [("llama3_8b", 1), ("llama3_70b", 8), ("mixtral_8x7b", 8)])
def test_chosen_layout_is_within_recommends_top_three_and_printed_with_the_runner_up(tmp_path, model, nodes):
    args = (f"model={model}", "cluster=dgx_h100", f"cluster.nodes={nodes}")
    rec = run_cli("action=recommend", *args, f"run.dir={tmp_path}/rec", "recommend.top=3", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    with open(tmp_path / "rec" / "recommend.json") as f:
        top = [c["overrides"] for c in json.load(f)["candidates"] if c["fits"]][:3]
    plan = run_cli("action=plan", *args, f"run.dir={tmp_path}/plan", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "meshrun: parallel=auto chose " in plan.stdout and "meshrun: runner-up " in plan.stdout
    with open(tmp_path / "plan" / "plan.json") as f:
        auto = json.load(f)["auto"]
    assert auto["chosen"]["overrides"] in top, (auto, top)
    assert auto["runner_up"] is not None and auto["runner_up"]["layout"] != auto["chosen"]["layout"]


def test_pins_presets_resume_and_cpu_defaults(tmp_path):
    # A key given on the command line is kept; the rest are searched.
    pinned = run_cli(
        "action=plan",
        "model=llama3_70b",
        "cluster=dgx_h100",
        "cluster.nodes=8",
        "parallel.tp=4",
        f"run.dir={tmp_path}/pin",
    )
    assert pinned.returncode == 0, pinned.stderr
    with open(tmp_path / "pin" / "plan.json") as f:
        plan = json.load(f)
    assert plan["tp"] == 4 and plan["auto"]["pinned"] == {"tp": 4}
    # Naming a preset means exactly that preset.
    named = run_cli(
        "action=plan",
        "model=llama3_70b",
        "cluster=dgx_h100",
        "cluster.nodes=8",
        "parallel=tp8_pp2",
        f"run.dir={tmp_path}/named",
    )
    assert named.returncode == 0, named.stderr
    with open(tmp_path / "named" / "plan.json") as f:
        plan = json.load(f)
    assert "auto" not in plan and (plan["tp"], plan["pp"]) == (8, 2)
    assert "parallel=auto" not in named.stdout
    # An existing run keeps its layout: its config.json has the chosen values with auto false.
    again = run_cli("action=plan", "model=llama3_70b", "cluster=dgx_h100", "cluster.nodes=8", f"run.dir={tmp_path}/pin")
    assert again.returncode == 0, again.stderr
    assert "parallel=auto chose" not in again.stdout and "tp 4" in again.stdout.replace("tp  4", "tp 4")
    # CPU presets keep today's default layout (parallel=default: tp2 sp).
    cpu = run_cli("action=plan", f"run.dir={tmp_path}/cpu")
    assert cpu.returncode == 0, cpu.stderr
    with open(tmp_path / "cpu" / "plan.json") as f:
        plan = json.load(f)
    assert "auto" not in plan and plan["tp"] == 2


def test_no_fit_names_the_smallest_node_count_that_fits(tmp_path):
    p = run_cli("action=plan", "model=gpt3_175b", "cluster=dgx_h100", f"run.dir={tmp_path}/x")
    assert p.returncode == 2
    fix = [line for line in p.stderr.splitlines() if line.strip().startswith("fix: cluster.nodes=")]
    assert fix, p.stderr
    nodes = int(fix[0].split("cluster.nodes=")[1].split()[0])
    assert nodes > 1 and not os.path.exists(tmp_path / "x")
    # That node count plans and fits; half of it (when more than the one node asked) does not.
    ok = run_cli(
        "action=plan", "model=gpt3_175b", "cluster=dgx_h100", f"cluster.nodes={nodes}", f"run.dir={tmp_path}/y"
    )
    assert ok.returncode == 0, ok.stderr
