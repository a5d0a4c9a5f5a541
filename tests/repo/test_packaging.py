"""meshrun as an installed tool: the wheel carries the code, the config tree (conf/ as the package
meshrun_conf) and the Hydra sweeper plugin, and runs from any directory in a fresh virtual environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from helpers import ROOT

CODE_DIRS = ("launcher", "training", "hydra_plugins")
# What a build must not read from the checkout: environments, earlier builds (setuptools' build/ keeps
# modules deleted since), run outputs, caches.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "runs", "multirun", "outputs", "__pycache__", ".pytest_cache"
)


def _setuptools_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the listing check only needs to run somewhere
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_directory_is_listed_and_conf_ships_as_meshrun_conf():
    # pyproject.toml lists packages by hand (discovery cannot rename conf/); an editable install imports an
    # unlisted subpackage anyway, so only this check (or the wheel test) notices one missing from the wheel.
    st = _setuptools_config()
    found = set()
    for top in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if any(f.endswith(".py") for f in filenames):
                found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    missing = sorted(found - set(st["packages"]))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    assert st["package-dir"]["meshrun_conf"] == "conf" and "meshrun_conf" in st["packages"]
    assert os.path.isfile(os.path.join(ROOT, "conf", "__init__.py"))  # Hydra's pkg:// source requires one


def _run(cmd, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_outside_the_checkout(tmp_path):
    src, dist, venv, elsewhere = (tmp_path / n for n in ("src", "dist", "venv", "elsewhere"))
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("meshrun-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in (
        "meshrun_conf/__init__.py",
        "meshrun_conf/config.yaml",
        "meshrun_conf/model/tiny.yaml",
        "meshrun_conf/parallel/tp2.yaml",
        "hydra_plugins/meshrun_sweep/__init__.py",
        "launcher/cli/app.py",
        "training/run/loop.py",
    ):
        assert must in names, must
    assert "hydra_plugins/__init__.py" not in names  # a namespace other Hydra plugins share

    # A fresh environment: no pip of its own (this pip installs into it), no site-packages of this one. The
    # dependencies (torch is ~1 GB) are not copied in: a .pth file puts a folder of links to this environment's
    # installed distributions on its path, without meshrun's own (editable) install and without .pth files, so
    # pip checks the wheel's requirements against them and installs only the wheel.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    vpy = str(venv / "bin" / "python")
    deps = tmp_path / "deps"
    deps.mkdir()
    here = sysconfig.get_paths()["purelib"]
    for name in os.listdir(here):
        if name.endswith(".pth") or "meshrun" in name or name in ("__pycache__", "hydra_plugins"):
            continue
        os.symlink(os.path.join(here, name), deps / name)
    # hydra_plugins is a namespace the wheel adds to: the other plugins' folders, linked one by one.
    (deps / "hydra_plugins").mkdir()
    for name in os.listdir(os.path.join(here, "hydra_plugins")):
        if name != "meshrun_sweep":
            os.symlink(os.path.join(here, "hydra_plugins", name), deps / "hydra_plugins" / name)
    site = _run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout
    with open(os.path.join(site.strip(), "_test_deps.pth"), "w") as f:
        f.write(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--python", vpy, "install", "-q"]
    _run(pip + [str(wheel)], cwd=tmp_path)
    # Installed the wheel, nothing else: the distributions in the venv's site-packages are what `pip list --path`
    # reads (their metadata folders), read here without another pip start.
    listed = sorted(n for n in os.listdir(site.strip()) if n.endswith((".dist-info", ".egg-info")))
    assert [n.split("-")[0] for n in listed] == ["meshrun"], listed

    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = _run(
        [vpy, "-c", "import launcher, meshrun_conf; print(launcher.__file__, meshrun_conf.__file__)"],
        cwd=elsewhere,
        env=env,
    ).stdout
    assert str(venv) in where and ROOT not in where, where  # the installed copy, not the checkout

    meshrun = str(venv / "bin" / "meshrun")
    plan_dir = elsewhere / "plan"
    p = _run([meshrun, "action=plan", f"run.dir={plan_dir}"], cwd=elsewhere, env=env, timeout=120)
    assert "Primary config" not in p.stdout + p.stderr
    assert json.loads((plan_dir / "plan.json").read_text())["world_size"] == 4

    run_dir = elsewhere / "run"
    _run(
        [meshrun, "train.steps=5", "cluster.gpus_per_node=2", "parallel=tp2", f"run.dir={run_dir}"],
        cwd=elsewhere,
        env=env,
        timeout=240,
    )
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert (run_dir / "plan.json").is_file()
