"""Collective bandwidth over the job's ranks (nccl-tests' definitions) and version agreement.

nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time; busbw = algbw x factor with factor
2(n-1)/n for all-reduce and (n-1)/n for all-gather and reduce-scatter, where for the latter two the
bytes are the whole array (n x the per-rank chunk). busbw is comparable with the link's peak
whatever n is, which is why it is the number checked against the expected rate.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from training.preflight.report import Check, fail, ok, warn

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def bandwidths(op: str, nbytes: int, n: int, seconds: float) -> dict[str, float]:
    """algbw and busbw in GB/s (1e9 bytes/s) of one call moving `nbytes` (the whole array) in `seconds`."""
    algbw = nbytes / seconds / 1e9
    return {"algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, n)}


def group_levels(world: int, per_node: int) -> list[int]:
    """Group sizes to measure: powers of two inside a node, the node, then the world.

    Each level splits the ranks into consecutive blocks that run at the same time, so every
    device and link is exercised and a slow block points at its node (rank order keeps blocks of
    up to per_node ranks inside one node).
    """
    per_node = min(per_node, world)
    levels, n = [], 2
    while n < per_node:
        if per_node % n == 0 and world % n == 0:
            levels.append(n)
        n *= 2
    if 1 < per_node <= world and world % per_node == 0:
        levels.append(per_node)
    if world > 1 and world not in levels:
        levels.append(world)
    return levels


def _elements(nbytes: int, n: int, elem: int) -> int:
    """Whole-array elements, rounded down to a multiple of n so every rank gets an equal chunk."""
    return max(n, (nbytes // elem) // n * n)


def run_sweep(
    rank: int,
    world: int,
    per_node: int,
    sizes_mb: list[float],
    iters: int,
    device: str,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Every rank calls this; returns this rank's timings of the blocks it leads (lowest rank of a block).
    timeout_s bounds the block groups' collectives (a dead peer is an error, not a hang)."""
    import torch

    from training.parallel import collectives as comm
    from training.parallel.mesh import consecutive_block_group

    results = []
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for n in group_levels(world, per_node):
        if n == world:
            group, first = None, 0
        else:
            group = consecutive_block_group(n, timeout_s)
            first = rank // n * n
        for op in OPS:
            for mb in sizes_mb:
                count = _elements(int(mb * 2**20), n, 4)
                full = torch.ones(count, dtype=torch.float32, device=device)
                chunk = torch.empty(count // n, dtype=torch.float32, device=device)

                def once(op=op, full=full, chunk=chunk, group=group):
                    if op == "all_reduce":
                        comm.all_reduce_op(full, group=group)
                    elif op == "all_gather":
                        comm.all_gather_single(full, chunk, group=group)
                    else:
                        comm.reduce_scatter_single(chunk, full, group=group)

                once()  # warm-up: connection setup, NCCL channel init
                comm.barrier(group=group)
                sync()
                t = time.perf_counter()
                for _ in range(iters):
                    once()
                sync()
                elapsed = torch.tensor([(time.perf_counter() - t) / iters], dtype=torch.float64, device=device)
                # The slowest member defines the collective's time, as in nccl-tests.
                comm.all_reduce_op(elapsed, op=comm.ReduceOp.MAX, group=group)
                if rank == first:
                    nbytes = count * 4
                    results.append(
                        {
                            "op": op,
                            "n": n,
                            "ranks": [first, first + n - 1],
                            "bytes": nbytes,
                            "time_s": elapsed.item(),
                            **bandwidths(op, nbytes, n, elapsed.item()),
                        }
                    )
        if group is not None:
            comm.barrier()
    return results


GPU_BUSBW_MB = 256.0
"""Smallest largest-message size (MB) of the sweep on GPUs: NVLink all-reduce reaches its bus bandwidth only
with messages of tens to hundreds of MB (at 1-8 MB launch and protocol latency dominate), and check_bandwidth
judges the largest size against busbw_intra_gbps / busbw_inter_gbps."""


def sweep_sizes_mb(sizes_mb: list[float], on_gpu: bool) -> list[float]:
    """The sweep's message sizes: cluster.preflight.collective_sizes_mb, plus GPU_BUSBW_MB on GPUs when the
    configured sizes stop short of it (the CPU default of 1 and 8 MB only checks that collectives work)."""
    sizes = sorted(float(s) for s in sizes_mb)
    if on_gpu and (not sizes or sizes[-1] < GPU_BUSBW_MB):
        sizes.append(GPU_BUSBW_MB)
    return sizes


def _significant(x: float, digits: int = 4) -> float:
    """x to `digits` significant figures: a fixed number of decimals would drop most of a slow link's figure
    (gloo on shared CPU cores reports about 0.01 GB/s)."""
    return float(f"{x:.{digits}g}")


def check_bandwidth(
    results: list[dict[str, Any]], node_of_rank: list[str], intra_gbps: float, inter_gbps: float, min_fraction: float
) -> list[Check]:
    """One check per (block, op) at its largest size; all-reduce busbw against the expected rate."""
    checks = []
    largest: dict[tuple, dict] = {}
    for r in results:
        key = (r["n"], r["ranks"][0], r["op"])
        if key not in largest or r["bytes"] > largest[key]["bytes"]:
            largest[key] = r
    for (n, first, op), r in sorted(largest.items()):
        last = r["ranks"][1]
        nodes = sorted(set(node_of_rank[first : last + 1]))
        within = len(nodes) == 1
        expected = intra_gbps if within else inter_gbps
        found = {
            "busbw_gbps": _significant(r["busbw_gbps"]),
            "algbw_gbps": _significant(r["algbw_gbps"]),
            "bytes": r["bytes"],
            "time_ms": _significant(r["time_s"] * 1e3),
        }
        kw = dict(subject=f"ranks[{first}-{last}]", node=nodes[0] if within else "", found=found)
        name = f"coll.{op}"
        if op == "all_reduce" and expected and r["busbw_gbps"] < min_fraction * expected:
            checks.append(
                warn(
                    name,
                    f"busbw {r['busbw_gbps']:.1f} GB/s below {min_fraction:g} x expected "
                    f"({'NVLink/intra-node' if within else 'inter-node'})",
                    expected=expected,
                    **kw,
                )
            )
        else:
            checks.append(ok(name, f"n={n}", expected=expected if op == "all_reduce" and expected else None, **kw))
    return checks


def local_versions(driver: str | None = None) -> dict[str, str | None]:
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL reports none
            nccl = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "driver": driver}


def check_versions(per_rank: list[dict[str, Any]], expected_nccl: str) -> list[Check]:
    """Every rank must agree on torch/CUDA/NCCL/driver; ranks off the majority mark their node bad."""
    checks = []
    for key in ("torch", "cuda", "nccl", "driver"):
        ranks = per_rank
        if key == "driver":
            # Only each node's leader reads NVML; the other ranks of a node report no driver and agree with it.
            ranks = [r for r in per_rank if r["versions"].get(key) is not None] or per_rank
        values = [r["versions"].get(key) for r in ranks]
        majority, _ = Counter(values).most_common(1)[0]
        odd = [r for r in ranks if r["versions"].get(key) != majority]
        for r in odd:
            checks.append(
                fail(
                    f"version.{key}",
                    f"rank {r['rank']} differs from the other ranks",
                    subject=f"rank{r['rank']}",
                    node=r["node"],
                    found=r["versions"].get(key),
                    expected=majority,
                )
            )
        if not odd:
            checks.append(ok(f"version.{key}", f"same on all {len(ranks)} ranks", found=majority))
    if expected_nccl:
        for r in per_rank:
            v = r["versions"].get("nccl") or ""
            if not (v == expected_nccl or v.startswith(expected_nccl + ".")):
                checks.append(
                    fail(
                        "version.nccl",
                        "NCCL differs from cluster.preflight.nccl_version",
                        subject=f"rank{r['rank']}",
                        node=r["node"],
                        found=v or None,
                        expected=expected_nccl,
                    )
                )
    return checks
