"""NUMA binding as applied to the rank process of a local launch (launcher/ranks/numa.py).

One short local launch (2 ranks, 1 step) with cluster.numa=explicit and cluster.numa_map=[0,0]: each rank is
started under `numactl --cpunodebind=0 --membind=0`. A sitecustomize that every rank process runs reads, inside
the rank, what the kernel applied to it: /proc/self/numa_maps (the memory policy of each mapping: `bind:0` under
--membind=0, `default` otherwise) and /proc/self/status (Cpus_allowed_list, Mems_allowed_list). This machine has
one NUMA node, so the CPU set of node 0 is every CPU; the memory policy is what shows that the binding reached
the rank (the test process itself, not bound, shows `default`). The Slurm side is tests/slurm's.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ROOT
from helpers.local_run import PYTHON, TINY_RUN

INJECT = """import json, os, sys
if "training.main" in getattr(sys, "orig_argv", []):
    _status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    _policies = sorted({l.split()[1] for l in open("/proc/self/numa_maps") if len(l.split()) > 1})
    with open(os.path.join(os.environ["NUMA_OUT"], "rank_" + os.environ.get("RANK", "?") + ".json"), "w") as _f:
        json.dump({"cpus": _status["Cpus_allowed_list"].strip(), "mems": _status["Mems_allowed_list"].strip(),
                   "policies": _policies, "pid": os.getpid()}, _f)
"""


@pytest.mark.slow
def test_local_ranks_run_under_the_numa_binding(tmp_path):
    import shutil

    if not shutil.which("numactl"):
        pytest.skip("numactl is not installed: the local launcher binds nothing (and warns)")
    inject, out = tmp_path / "inject", tmp_path / "out"
    inject.mkdir()
    out.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    env = dict(os.environ, PYTHONPATH=f"{inject}{os.pathsep}{ROOT}", NUMA_OUT=str(out))
    overrides = [o for o in TINY_RUN if not o.startswith("cluster.gpus_per_node")]
    r = subprocess.run(
        [PYTHON, "-m", "launcher", f"run.dir={tmp_path / 'run'}", *overrides, "parallel.dp=2"]
        + ["cluster.gpus_per_node=2", "train.steps=1", "cluster.numa=explicit", "cluster.numa_map=[0,0]"],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = {f: json.loads((out / f).read_text()) for f in sorted(os.listdir(out))}
    assert sorted(ranks) == ["rank_0.json", "rank_1.json"], ranks
    node0_cpus = open("/sys/devices/system/node/node0/cpulist").read().strip()
    for name, got in ranks.items():
        assert "bind:0" in got["policies"], (name, got)  # --membind=0 reached the rank's own memory policy
        assert "default" not in got["policies"], (name, got)
        assert got["mems"] == "0" and got["cpus"] == node0_cpus, (name, got)
    assert ranks["rank_0.json"]["pid"] != ranks["rank_1.json"]["pid"]
    with open("/proc/self/numa_maps") as f:  # the test process, not bound: the control
        assert "bind:0" not in {line.split()[1] for line in f if len(line.split()) > 1}
