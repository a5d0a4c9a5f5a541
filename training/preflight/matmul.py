"""GPU function: a short dense matmul per rank, its TFLOP/s against the expected rate, stragglers."""

from __future__ import annotations

import statistics
import time

from training.preflight.report import Check, fail, ok, warn


def measure_tflops(device: str, n: int, iters: int = 0, dtype=None) -> dict[str, float]:
    """TFLOP/s of an n x n x n matmul: bf16 on GPU (tensor cores), fp32 on CPU (bf16 is emulated there),
    or `dtype` (training/run/loop.py's MFU peak: the run's parameter dtype)."""
    import torch

    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.mm(a, b)  # warm-up: kernel selection, first-touch allocation
    sync()
    if not iters:
        # Enough iterations for ~0.2 s of work, judged from one timed call; at least 3.
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        iters = max(3, min(200, int(0.2 / max(time.perf_counter() - t, 1e-6))))
    t = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    sync()
    dt = time.perf_counter() - t
    return {"tflops": 2.0 * n**3 * iters / dt / 1e12, "n": n, "iters": iters, "dtype": str(dtype).split(".")[-1]}


def check_matmul(
    per_rank: list[dict], expected_tflops: float, min_fraction: float, straggler_ratio: float, on_gpu: bool
) -> list[Check]:
    """per_rank: [{rank, node, tflops, ...}] from every rank. Below expected or far below peers: bad rank."""
    checks: list[Check] = []
    med = statistics.median(r["tflops"] for r in per_rank)
    for r in per_rank:
        t, subj, node = r["tflops"], f"rank{r['rank']}", r["node"]
        found = round(t, 4)
        if expected_tflops and t < min_fraction * expected_tflops:
            checks.append(
                fail(
                    "gpu.matmul",
                    f"{t:.1f} TFLOP/s is below {min_fraction:g} x expected",
                    subject=subj,
                    node=node,
                    found=found,
                    expected=expected_tflops,
                )
            )
        elif len(per_rank) > 1 and t < straggler_ratio * med:
            # CPU ranks share cores with each other (and with anything else running), so a slow one
            # there says nothing about the node; on GPUs each rank owns its device.
            make = fail if on_gpu else warn
            checks.append(
                make(
                    "gpu.straggler",
                    f"{t / med:.2f} x the ranks' median ({med:.3g} TFLOP/s)",
                    subject=subj,
                    node=node,
                    found=found,
                    expected=f">= {straggler_ratio:g} x median",
                )
            )
        else:
            checks.append(
                ok(
                    "gpu.matmul",
                    f"TFLOP/s, {r['dtype']} n={r['n']}",
                    subject=subj,
                    node=node,
                    found=found,
                    expected=expected_tflops or None,
                )
            )
    return checks
