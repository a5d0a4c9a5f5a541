"""hydra_plugins/meshrun_sweep: a `meshrun -m` sweep gives what Hydra's basic sweeper+launcher give
(summary, sweep.json, per-point files, exit codes), composing once per set of config-group choices.
The summary (launcher/sweep/summary.py) is built from the points' files, so every Hydra launcher gives the same
one; it fits 120 columns; a Slurm sweep under dry_run=true prints its job arrays and submits nothing.

Sweeps of plans start no ranks: they run in this process through the console entry point (tests/helpers/cli.py),
except under the joblib and submitit launchers, whose workers and jobs are processes of their own: those run
as `python -m launcher`. One sweep per launcher (module fixtures) serves every test that reads it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.cli import run_cli
from omegaconf import OmegaConf

PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable
BASIC = ["hydra/sweeper=basic", "hydra/launcher=basic"]


def meshrun(*args: str, cwd):
    """A sweep of plans in this process (no rank starts)."""
    return run_cli(*args, cwd=str(cwd))


def meshrun_subprocess(*args: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [PYTHON, "-m", "launcher", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _summary_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("sweep summary:"))


def _rows(data: dict) -> list:
    return [{k: v for k, v in r.items() if k != "run_dir"} for r in data["feasible"] + data["infeasible"]]


def _table(stdout: str) -> list:
    """The summary's lines, from its first line to the sweep.json path (excluded)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("sweep summary:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("sweep.json: "))
    return lines[start:end]


# Two group choices (model) x two values (pp); pp=4 on the 4-layer tiny model is fine, on gpt2_125m
# (12 layers) too, so pp=3 supplies the invalid points (4 layers not divisible by 3).
SMALL_SWEEP = ["-m", "action=plan", "model=tiny,gpt2_125m", "parallel.pp=1,3", "parallel.sp=false"]
IN_PROCESS = {"meshrun": [], "basic": BASIC}  # launchers that run the points in the calling process
OWN_PROCESSES = {  # joblib workers, submitit jobs: processes of their own, started by a real `meshrun`
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    "submitit_local": ["hydra/launcher=submitit_local"],
}


def _small_sweeps(base, launchers, run):
    out = {}
    for name, extra in launchers.items():
        sweep = base / name
        p = run(*SMALL_SWEEP, *extra, f"hydra.sweep.dir={sweep}", cwd=base)
        assert p.returncode == 0, (name, p.stdout[-2000:], p.stderr[-3000:])
        out[name] = (p, json.loads((sweep / "sweep.json").read_text()), sweep)
    return out


@pytest.fixture(scope="module")
def small_sweeps(tmp_path_factory):
    """SMALL_SWEEP under meshrun's launcher and Hydra's basic one: (result, sweep.json, sweep dir) by name."""
    return _small_sweeps(tmp_path_factory.mktemp("small_sweeps"), IN_PROCESS, meshrun)


def test_same_sweep_as_basic_incl_invalid_point(small_sweeps):
    (p_new, new, sweep_new), (p_base, base, _) = small_sweeps["meshrun"], small_sweeps["basic"]
    assert _summary_line(p_new.stdout) == _summary_line(p_base.stdout)
    assert new["infeasible"] and new["feasible"], _summary_line(p_new.stdout)
    assert _rows(new) == _rows(base)
    assert [pt["overrides"] for pt in new["points"]] == [pt["overrides"] for pt in base["points"]]
    for r in new["feasible"]:  # each point's own directory, from HydraConfig's runtime.output_dir
        assert r["run_dir"] == str(sweep_new / str(r["num"]))
        cfg = json.loads(open(os.path.join(r["run_dir"], "config.json")).read())
        point = dict(o.split("=", 1) for o in r["overrides"])
        assert cfg["model"]["name"] == point["model"] and str(cfg["parallel"]["pp"]) == point["parallel.pp"]
        assert os.path.exists(os.path.join(r["run_dir"], "plan.json"))
    for r in new["infeasible"]:
        assert not os.path.exists(sweep_new / str(r["num"]) / "plan.json")


def test_typo_in_swept_key_exits_2(tmp_path):
    for bad in (["parallel.tpp=1,2"], ["parallel.tp=1,two"], ["parallel.tp=1,2", "model.hiden_size=10"]):
        sweep = tmp_path / "sweep"
        p = meshrun("-m", "action=plan", *bad, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
        assert p.returncode == 2, (bad, p.returncode, p.stdout, p.stderr)
        key = bad[-1].split("=")[0]
        assert key in p.stderr, p.stderr
        assert not (sweep / "sweep.json").exists()  # no job ran


def test_composer_matches_hydra_and_composes_once_per_group_set():
    """In-process: CachedComposer.build == ConfigLoader.load_sweep_config, point by point."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import setup_globals
    from hydra.types import RunMode

    sys.path.insert(0, ROOT)
    import launcher.cli.schema
    from hydra_plugins.meshrun_sweep._composer import CachedComposer

    launcher.cli.schema.register()
    setup_globals()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(os.path.join(ROOT, "conf")))
    master = loader.load_configuration("config", ["action=plan", "hydra.sweep.dir=/tmp/x"], RunMode.MULTIRUN)
    composer = CachedComposer(loader, master)
    points = [[f"model={m}", f"parallel.tp={tp}", "parallel.sp=false"] for m in ("tiny", "gpt2_125m") for tp in (1, 2)]
    for overrides in points:
        got = composer.build(overrides)
        want = loader.load_sweep_config(master, overrides)
        assert OmegaConf.to_container(got, resolve=False) == OmegaConf.to_container(want, resolve=False)
    assert composer.compositions == 2  # model=tiny, model=gpt2_125m


@pytest.mark.slow  # joblib workers and submitit jobs: processes of their own
def test_every_hydra_launcher_gives_the_same_summary(small_sweeps, tmp_path):
    """The summary and sweep.json come from what each point wrote in its own directory, read in the
    parent process: identical with meshrun's launcher, basic, joblib and submitit's local launcher."""
    out = {**small_sweeps, **_small_sweeps(tmp_path, OWN_PROCESSES, meshrun_subprocess)}
    out = {name: (_table(p.stdout), data, sweep) for name, (p, data, sweep) in out.items()}
    table, data, sweep = out["meshrun"]
    assert (
        table[0] == "sweep summary: 1 feasible, 3 infeasible; ranked by predicted step time (compute, "
        "communication, bubble); memory per GPU"
    ), table
    for name, (other_table, other, other_sweep) in out.items():
        assert _rows(other) == _rows(data), name
        assert other_table == table, name
        assert [pt["overrides"] for pt in other["points"]] == [pt["overrides"] for pt in data["points"]], name
        for r in other["feasible"]:
            assert r["run_dir"] == str(other_sweep / str(r["num"])), name
    # A sweep directory used again (a copy of meshrun's, the fixture's stays as it was): only this sweep's
    # points count, not the older ones still there.
    sweep = shutil.copytree(sweep, tmp_path / "again", symlinks=True)
    assert sorted(int(d) for d in os.listdir(sweep) if d.isdigit()) == [0, 1, 2, 3]
    p = meshrun(
        "-m",
        "action=plan",
        "model=tiny",
        "parallel.pp=1,3",
        "parallel.sp=false",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    again = json.loads((sweep / "sweep.json").read_text())
    assert [pt["num"] for pt in again["points"]] == [0, 1]
    assert _summary_line(p.stdout).startswith("sweep summary: 1 feasible, 1 infeasible;")


def test_summary_fits_120_columns_and_ranks_by_predicted_step_time(tmp_path):
    sys.path.insert(0, ROOT)
    from launcher.plan.estimate import fmt_bytes
    from launcher.sweep.summary import fmt_rate

    sweep = tmp_path / "sweep"
    p = meshrun(
        "-m",
        "action=plan",
        "model=tiny,gpt2_125m",
        "parallel.tp=1,2,4",
        "parallel.pp=1,2",
        "parallel.micro_batch=1,2",
        "parallel.sp=true",
        "train.precision=fp32",
        "cluster.gpu_memory_gb=4",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    table = _table(p.stdout)
    assert max(len(line) for line in table) <= 120, "\n".join(line for line in table if len(line) > 120)
    # The overrides every point has are shown once, above the table, and not in its rows.
    common = "every point: action=plan parallel.sp=True train.precision=fp32 cluster.gpu_memory_gb=4"
    assert table[1] == common, table[:3]
    data = json.loads((sweep / "sweep.json").read_text())
    assert data["common_overrides"] == common[len("every point: ") :].split()
    feasible, infeasible = data["feasible"], data["infeasible"]
    assert feasible and infeasible
    steps = [r["predicted_step_s"] for r in feasible]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    header = next(i for i, line in enumerate(table) if line.lstrip().startswith("rank"))
    assert table[header].split()[2:9] == ["layout", "step", "tok/s/GPU", "MFU", "memory", "headroom", "bubble"], table[
        header
    ]
    for rank, (line, r) in enumerate(zip(table[header + 2 :], feasible), 1):
        plan = json.loads(open(os.path.join(r["run_dir"], "plan.json")).read())
        point = dict(o.split("=", 1) for o in r["overrides"])
        assert plan["predicted_step_s"] == r["predicted_step_s"]
        assert r["headroom_bytes"] == plan["gpu_memory_bytes"] - plan["memory_bytes"]["total"]
        sp = " sp" if plan["tp"] > 1 else ""  # sequence parallelism needs tp > 1
        assert r["layout"] == f"tp{plan['tp']}·pp{plan['pp']}·dp{plan['dp']} vpp{plan['vpp']}{sp}"
        cells = line.split()
        assert cells[:3] == [str(rank), str(r["num"]), r["layout"].split()[0]], line
        assert "action=plan" not in line and fmt_bytes(r["headroom_bytes"]) in line
        assert f" {fmt_rate(plan['tokens_per_s_per_gpu'])} " in line and f"{100 * plan['mfu']:.1f}%" in line
        assert f"micro_batch={point['parallel.micro_batch']}" in line  # own overrides, short keys
    below = table[table.index("infeasible (first reason):") + 1 :]
    assert len(below) == len(infeasible)
    for line, r in zip(below, infeasible):
        assert line.split()[:2] == ["x", str(r["num"])]
        assert f"{r['status']}: {r['reason'][:20]}" in line


def test_slurm_sweep_dry_run_prints_the_job_arrays_and_submits_nothing(tmp_path):
    """No cluster needed: dry_run=true checks every point, groups the valid ones into the job arrays
    that would be submitted (here: one per time limit) and prints each array's batch script."""
    sweep = tmp_path / "sweep"
    p = meshrun(
        "-m",
        "cluster=slurm_dev",
        "dry_run=true",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "model=tiny",
        "data=synthetic",
        "parallel.tp=1",
        "parallel.zero=0",
        "parallel.global_batch=8",
        # Given, not read from the partition (0 would ask sinfo): a dry run needs no Slurm.
        "cluster.cpus_per_task=1",
        "parallel.micro_batch=1,2,3",
        "cluster.time_min=10,11",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "submitted Slurm job" not in p.stdout
    scripts = p.stdout.split("# job array of ")[1:]
    assert len(scripts) == 2, p.stdout
    data = json.loads((sweep / "sweep.json").read_text())
    by_time = {}
    for r in data["feasible"]:
        point = dict(o.split("=", 1) for o in r["overrides"])
        by_time.setdefault(point["cluster.time_min"], []).append(r["run_dir"])
        assert r["status"] == "dry_run" and "job_id" not in r
    assert sorted(len(v) for v in by_time.values()) == [2, 2] and len(data["infeasible"]) == 2
    for script in scripts:
        assert script.startswith("2 sweep points") and "nothing was submitted: dry_run=true" in script
        assert "#SBATCH --array=0-1%2" in script and "#SBATCH --cpus-per-task=1" in script
        assert f"#SBATCH --output={sweep}/submitit/%A_%a_0_log.out" in script
        time_min = re.search(r"#SBATCH --time=(\d+)", script).group(1)
        dirs = by_time[time_min]
        assert f"MESHRUN_RUN_DIRS=({' '.join(dirs)})" in script
        assert all(f"#   {task}: {d}" in script for task, d in enumerate(dirs))
        assert "srun " in script and "submitit.core._submit" in script
    for dirs in by_time.values():
        for d in dirs:
            assert not os.path.exists(os.path.join(d, "events.jsonl"))  # no `submitted` event
    assert not (sweep / "submitit").exists()  # no pickles: submitit never ran


def _loader_and_master(overrides):
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import setup_globals
    from hydra.types import RunMode

    sys.path.insert(0, ROOT)
    import launcher.cli.schema

    launcher.cli.schema.register()
    setup_globals()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(os.path.join(ROOT, "conf")))
    return loader, loader.load_configuration("config", overrides, RunMode.MULTIRUN)


def test_sweep_over_values_reuses_the_master_composition():
    """No group swept: the points' base is the sweep's own composition (no extra compose), and every point
    still equals Hydra's load_sweep_config. A non-sweep +key=value (not idempotent) disables the reuse."""
    from hydra_plugins.meshrun_sweep._composer import CachedComposer

    fixed = ["action=plan", "model=gpt2_125m", "cluster.nodes=2", "parallel.sp=false"]
    loader, master = _loader_and_master(fixed + ["parallel.tp=1,2", "hydra.sweep.dir=/tmp/x"])
    composer = CachedComposer(loader, master)
    for tp in (1, 2):
        point = fixed + [f"parallel.tp={tp}"]
        got, want = composer.build(point), loader.load_sweep_config(master, point)
        assert OmegaConf.to_container(got, resolve=False) == OmegaConf.to_container(want, resolve=False)
        assert got.parallel.tp == tp and got.cluster.nodes == 2
    assert composer.compositions == 0

    added = fixed + ["+cluster.env.EXTRA=1"]
    loader, master = _loader_and_master(added + ["parallel.tp=1,2", "hydra.sweep.dir=/tmp/x"])
    composer = CachedComposer(loader, master)
    point = added + ["parallel.tp=2"]
    got, want = composer.build(point), loader.load_sweep_config(master, point)
    assert OmegaConf.to_container(got, resolve=False) == OmegaConf.to_container(want, resolve=False)
    assert composer.compositions == 1


def test_task_view_is_the_config_without_hydra():
    """What the task gets from a point's own config (no copy) equals run_job's deepcopy with hydra deleted,
    typed the same; the point's hydra node still resolves interpolations of the user's keys."""
    import copy

    from omegaconf import open_dict, read_write

    from hydra_plugins.meshrun_sweep._composer import CachedComposer
    from hydra_plugins.meshrun_sweep._run_job import _task_view
    from launcher.cli.options import AppConfig  # the schema the command line composes

    loader, master = _loader_and_master(["action=plan", "model=tiny,gpt2_125m", "hydra.sweep.dir=/tmp/x"])
    # run.dir pinned: its default interpolates the clock's second, which two resolutions may straddle.
    config = CachedComposer(loader, master).build(["action=plan", "model=tiny", "parallel.tp=2", "run.dir=/tmp/x/p"])
    want = copy.deepcopy(config)
    with read_write(want), open_dict(want):
        del want["hydra"]
    view = _task_view(config)
    assert "hydra" not in view and "hydra" in config
    assert OmegaConf.to_container(view, resolve=False) == OmegaConf.to_container(want, resolve=False)
    assert OmegaConf.get_type(view) is OmegaConf.get_type(want) is AppConfig
    assert OmegaConf.is_struct(view)
    assert OmegaConf.to_object(view) == OmegaConf.to_object(want)
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.job.name = "${model.name}-${parallel.tp}"
    assert config.hydra.job.name == "tiny-2"


def test_config_yaml_is_yaml_dump():
    """config.yaml from cached sections is byte for byte what one yaml.dump of the whole config writes."""
    import yaml

    sys.path.insert(0, ROOT)
    from training.contract.config import Config, config_to_dict
    from training.contract.rundir.config_files import _DUMPER, config_yaml

    plain = config_to_dict(Config())
    plain["cluster"]["env"] = {"A": "yes", "B": "1.0", "C": "line\nbreak", "D": "ünïcode: x", "E": ""}
    plain["train"]["lr"] = 1e-05
    for _ in range(2):  # the second time from the cache
        assert config_yaml(plain) == yaml.dump(plain, Dumper=_DUMPER, sort_keys=False)
    other = dict(plain, parallel=dict(plain["parallel"], tp=True))  # True is not 1: another section
    assert config_yaml(other) == yaml.dump(other, Dumper=_DUMPER, sort_keys=False)
    assert config_yaml({}) == yaml.dump({}, Dumper=_DUMPER, sort_keys=False)
