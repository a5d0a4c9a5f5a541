"""bench/gpu_engine_features.py (step 7 of bench/gpu_check.sh): the cp check fails when the ring's merge is wrong
(nothing hard-wired to pass). Its --dry CPU run (every check computed: zero=3 gathered bytes against the plan,
offload=cpu's accounting after steps, the cp ring kernels against float64 attention) is asserted in
tests/bench/test_gpu_check.py, from the one --dry run of bench/gpu_check.sh that runs it anyway."""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, above tests/
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_engine_features as gef  # noqa: E402


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
