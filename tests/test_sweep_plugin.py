"""hydra_plugins/meshrun_sweep: a `meshrun -m` sweep gives what Hydra's basic sweeper+launcher give
(summary, sweep.json, per-point files, exit codes), composing once per set of config-group choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable
BASIC = ["hydra/sweeper=basic", "hydra/launcher=basic"]


def meshrun(*args: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([PYTHON, "-m", "launcher", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _summary_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("sweep summary:"))


def _rows(data: dict) -> list:
    return [{k: v for k, v in r.items() if k != "run_dir"} for r in data["feasible"] + data["infeasible"]]


def test_same_sweep_as_basic_incl_invalid_point(tmp_path):
    # Two group choices (model) x two values (pp); pp=4 on the 4-layer tiny model is fine, on gpt2_125m
    # (12 layers) too, so pp=3 supplies the invalid points (4 layers not divisible by 3).
    sweep_args = ["-m", "action=plan", "model=tiny,gpt2_125m", "parallel.pp=1,3", "parallel.sp=false"]
    out = {}
    for name, extra in (("meshrun", []), ("basic", BASIC)):
        sweep = tmp_path / name
        p = meshrun(*sweep_args, *extra, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        out[name] = (p, json.loads((sweep / "sweep.json").read_text()), sweep)
    (p_new, new, sweep_new), (p_base, base, _) = out["meshrun"], out["basic"]
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
    import launcher.schema

    from hydra_plugins.meshrun_sweep._composer import CachedComposer

    launcher.schema.register()
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
