"""bench/gpu_engine_features.py (step 6 of bench/gpu_check.sh): its --dry CPU twin computes every check (zero=3
gathered bytes against the plan, offload=cpu's accounting after steps, the cp ring kernels against float64
attention), and the cp check fails when the ring's merge is wrong (nothing hard-wired to pass)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/this file
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_engine_features as gef  # noqa: E402


def test_dry_run_computes_every_check(tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_engine_features.py"), "--dry", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    checks = summary["checks"]
    assert summary["mode"] == "dry" and summary["ok"] and set(checks) == {"zero3", "offload_cpu", "cp_ring_numerics"}
    z3 = checks["zero3"]
    assert 0 < z3["peak_gathered_bytes"] <= z3["plan_zero3_gathered"]
    off = checks["offload_cpu"]
    assert off["measured"] == off["plan"] and off["measured"]["host_offload"] > 0
    errs = checks["cp_ring_numerics"]["relative_max_errors"]
    assert set(errs) == {"cp2", "cp4"}
    assert all(0 < e <= gef.CP_TOLERANCE for case in errs.values() for e in case.values()), errs


def test_cp_check_catches_a_wrong_merge(monkeypatch):
    from training.parallel import context

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 2, 32, 16, generator=g)
    k, v = (torch.randn(1, 1, 1, 32, 16, generator=g) for _ in range(2))
    dout = torch.randn(1, 1, 2, 32, 16, generator=g)
    want = gef.reference(q, k, v, dout)
    good = gef.ring_simulated(q, k, v, dout, 2)
    assert float((good[0].double() - want[0]).abs().max()) < 1e-5
    monkeypatch.setattr(context, "_merge", lambda acc, out, lse: (out, lse) if acc is None else acc)  # drops blocks
    bad = gef.ring_simulated(q, k, v, dout, 2)
    assert float((bad[0].double() - want[0]).abs().max() / want[0].abs().max()) > gef.CP_TOLERANCE
