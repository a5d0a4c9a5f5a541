"""NCCL and CUDA software checks of the operations checklist (no torch at import):

- nccl.transport: NCCL_IB_DISABLE=1, NCCL_NET=Socket, an NCCL_IB_HCA that names none of the node's HCAs, or no
  ACTIVE InfiniBand port on a node that has HCAs: NCCL would use TCP sockets (a warning naming the cause);
- nccl.ib_settings: NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT as the ranks see them (reported; unset means NCCL's
  defaults);
- version.nccl_min: NCCL at least MIN_NCCL on every rank (a minimum, not an exact match);
- version.cudnn: the same cuDNN on every rank;
- version.cuda_runtime: torch's CUDA runtime no newer than the CUDA version the driver supports.
The versions travel in each rank's `versions` (extra_versions) with those training/preflight/collectives.py sends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from training.preflight import ib_sysfs
from training.preflight.report import Check, fail, ok, warn

MIN_NCCL = (2, 18)
"""Oldest NCCL the checklist accepts."""


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """'2.21.5' -> (2, 21, 5); '12.4' -> (12, 4); None or garbage -> None."""
    if not text:
        return None
    parts = []
    for piece in str(text).split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def _hca_selected(spec: str, hca: str) -> bool:
    """Whether NCCL_IB_HCA (prefix list; '=' exact; '^' excludes) lets NCCL use this HCA."""
    spec = spec.strip()
    if not spec:
        return True
    exclude = spec.startswith("^")
    body = spec.lstrip("^")
    exact = body.startswith("=")
    names = [s.partition(":")[0] for s in body.lstrip("=").split(",") if s]
    hit = any(hca == n if exact else hca.startswith(n) for n in names)
    return not hit if exclude else hit


def transport_checks(env: Mapping[str, str], ib_root: str, node: str) -> list[Check]:
    """Would NCCL use InfiniBand on this node? And the IB timeout/retry settings."""
    checks: list[Check] = []
    ports = ib_sysfs.list_ports(ib_root)
    settings = {
        k: env.get(k)
        for k in (
            "NCCL_IB_TIMEOUT",
            "NCCL_IB_RETRY_CNT",
            "NCCL_IB_DISABLE",
            "NCCL_NET",
            "NCCL_IB_HCA",
            "NCCL_SOCKET_IFNAME",
        )
    }
    checks.append(
        ok(
            "nccl.ib_settings",
            "NCCL_IB_TIMEOUT="
            + (settings["NCCL_IB_TIMEOUT"] or "unset (NCCL's default)")
            + ", NCCL_IB_RETRY_CNT="
            + (settings["NCCL_IB_RETRY_CNT"] or "unset (NCCL's default)"),
            node=node,
            found={k: v for k, v in settings.items() if v is not None},
        )
    )
    if not ports:
        checks.append(
            ok(
                "nccl.transport",
                "no InfiniBand HCA on this node: NCCL uses NVLink/PCIe inside it and "
                "sockets (or another network plugin) between nodes",
                node=node,
            )
        )
        return checks
    hcas = sorted(ports)
    active = []
    for hca, numbers in ports.items():
        for n in numbers:
            try:
                p = ib_sysfs.read_port(ib_root, hca, n)
            except (OSError, ValueError):
                continue
            if p.state == "ACTIVE":
                active.append(hca)
    causes = []
    if str(env.get("NCCL_IB_DISABLE", "")).strip().lower() in ("1", "true", "yes"):
        causes.append("NCCL_IB_DISABLE=1")
    if str(env.get("NCCL_NET", "")).strip().lower() == "socket":
        causes.append("NCCL_NET=Socket")
    spec = env.get("NCCL_IB_HCA", "")
    if spec and not any(_hca_selected(spec, h) for h in hcas):
        causes.append(f"NCCL_IB_HCA={spec} selects none of {', '.join(hcas)}")
    if not active:
        causes.append(f"no ACTIVE port on {', '.join(hcas)}")
    elif spec and not any(_hca_selected(spec, h) for h in active):
        causes.append(f"NCCL_IB_HCA={spec} selects no ACTIVE HCA ({', '.join(sorted(set(active)))})")
    if causes:
        checks.append(
            warn(
                "nccl.transport",
                "NCCL would fall back to TCP sockets although this node has InfiniBand "
                f"({', '.join(hcas)}): " + "; ".join(causes),
                node=node,
                found=causes,
                expected="InfiniBand (unset NCCL_IB_DISABLE / NCCL_NET, an NCCL_IB_HCA naming the HCAs)",
            )
        )
    else:
        checks.append(
            ok("nccl.transport", f"InfiniBand available to NCCL ({', '.join(sorted(set(active)))})", node=node)
        )
    return checks


def extra_versions(facts: dict[str, Any] | None = None) -> dict[str, str | None]:
    """cuDNN of this rank's torch and the driver's CUDA version (from the node's NVML facts, if read)."""
    import torch

    cudnn = None
    try:
        if torch.backends.cudnn.is_available():
            cudnn = str(torch.backends.cudnn.version())
    except Exception:  # noqa: BLE001 - a build without cuDNN reports none
        cudnn = None
    return {"cudnn": cudnn, "cuda_driver": (facts or {}).get("cuda_driver")}


def version_checks(per_rank: list[dict[str, Any]], minimum: tuple[int, ...] = MIN_NCCL) -> list[Check]:
    """NCCL minimum, cuDNN agreement, CUDA runtime against the driver: one check per finding."""
    checks: list[Check] = []
    low = []
    for r in per_rank:
        v = parse_version(r["versions"].get("nccl"))
        if v is not None and v[: len(minimum)] < minimum:
            low.append(r)
            checks.append(
                fail(
                    "version.nccl_min",
                    f"NCCL {r['versions'].get('nccl')} is older than {'.'.join(map(str, minimum))}",
                    subject=f"rank{r['rank']}",
                    node=r["node"],
                    found=r["versions"].get("nccl"),
                    expected=">= " + ".".join(map(str, minimum)),
                )
            )
    if not low and any(r["versions"].get("nccl") for r in per_rank):
        checks.append(ok("version.nccl_min", f"NCCL >= {'.'.join(map(str, minimum))} on every rank"))
    values = [r["versions"].get("cudnn") for r in per_rank]
    if any(values):
        majority, _ = Counter(values).most_common(1)[0]
        odd = [r for r in per_rank if r["versions"].get("cudnn") != majority]
        for r in odd:
            checks.append(
                fail(
                    "version.cudnn",
                    "cuDNN differs from the other ranks",
                    subject=f"rank{r['rank']}",
                    node=r["node"],
                    found=r["versions"].get("cudnn"),
                    expected=majority,
                )
            )
        if not odd:
            checks.append(ok("version.cudnn", f"same on all {len(per_rank)} ranks", found=majority))
    for r in per_rank:
        runtime, driver = parse_version(r["versions"].get("cuda")), parse_version(r["versions"].get("cuda_driver"))
        if runtime is None or driver is None:
            continue
        if runtime[:2] > driver[:2]:
            checks.append(
                fail(
                    "version.cuda_runtime",
                    f"torch's CUDA runtime {r['versions'].get('cuda')} is newer "
                    f"than the driver supports ({r['versions'].get('cuda_driver')}): update the driver or "
                    "use a torch built for an older CUDA",
                    subject=f"rank{r['rank']}",
                    node=r["node"],
                    found=r["versions"].get("cuda"),
                    expected=f"<= {r['versions'].get('cuda_driver')}",
                )
            )
    if any(parse_version(r["versions"].get("cuda_driver")) for r in per_rank) and not any(
        c.name == "version.cuda_runtime" for c in checks
    ):
        checks.append(ok("version.cuda_runtime", "torch's CUDA runtime is supported by the driver on every rank"))
    return checks
