"""InfiniBand port health from sysfs (what `ibstatus` prints, without needing infiniband-diags).

Layout and formats as the kernel writes them (drivers/infiniband/core/sysfs.c):
  <root>/<hca>/ports/<n>/state       "4: ACTIVE"
  <root>/<hca>/ports/<n>/phys_state  "5: LinkUp"
  <root>/<hca>/ports/<n>/rate        "400 Gb/sec (4X NDR)"
  <root>/<hca>/ports/<n>/link_layer  "InfiniBand" | "Ethernet"
  <root>/<hca>/ports/<n>/counters/<name>   a decimal integer
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from training.preflight.report import Check, fail, ok, warn

# Counters that only grow when the link or its cable misbehaves.
ERROR_COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
)
CONGESTION_COUNTERS = ("port_xmit_discards",)
"""Counters that also rise on a healthy link under congestion (packets dropped at a full output queue, e.g.
during the preflight's own all-reduce): rising, they warn; they never fail a node."""


@dataclass
class Port:
    hca: str
    port: int
    state: str = ""
    """ACTIVE, DOWN, INIT, ARMED ... (the word after "N: ")."""
    phys_state: str = ""
    """LinkUp, Polling, Disabled ..."""
    rate_gbps: float = 0.0
    rate_text: str = ""
    link_layer: str = ""
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.hca}/{self.port}"


def parse_enum(text: str) -> str:
    """'4: ACTIVE' -> 'ACTIVE'; tolerant of a missing number."""
    text = text.strip()
    return text.split(":", 1)[1].strip() if ":" in text else text


def parse_rate(text: str) -> float:
    """'400 Gb/sec (4X NDR)' -> 400.0; '2.5 Gb/sec (1X SDR)' -> 2.5."""
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text)
    if not m:
        raise ValueError(f"unrecognised IB rate {text!r}")
    return float(m.group(1))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def read_port(root: str, hca: str, port: int) -> Port:
    d = os.path.join(root, hca, "ports", str(port))
    p = Port(hca, port)
    p.state = parse_enum(_read(os.path.join(d, "state")))
    p.phys_state = parse_enum(_read(os.path.join(d, "phys_state")))
    p.rate_text = _read(os.path.join(d, "rate"))
    p.rate_gbps = parse_rate(p.rate_text)
    ll = os.path.join(d, "link_layer")
    p.link_layer = _read(ll) if os.path.exists(ll) else "InfiniBand"
    cdir = os.path.join(d, "counters")
    for name in ERROR_COUNTERS:
        path = os.path.join(cdir, name)
        if os.path.exists(path):
            try:
                p.counters[name] = int(_read(path))
            except (OSError, ValueError):
                pass  # some drivers refuse reads of unsupported counters
    return p


def list_ports(root: str) -> dict[str, list[int]]:
    """Every HCA under root and its port numbers; {} when root does not exist (no IB stack)."""
    if not os.path.isdir(root):
        return {}
    out = {}
    for hca in sorted(os.listdir(root)):
        pdir = os.path.join(root, hca, "ports")
        if os.path.isdir(pdir):
            out[hca] = sorted(int(p) for p in os.listdir(pdir) if p.isdigit())
    return out


def snapshot(root: str) -> dict[str, dict[str, int]]:
    """Error counters of every port now, to compare with a later read ("rising during preflight")."""
    out = {}
    for hca, ports in list_ports(root).items():
        for n in ports:
            try:
                out[f"{hca}/{n}"] = read_port(root, hca, n).counters
            except (OSError, ValueError):
                continue
    return out


def expected_hcas(ib_hcas: list[str], env: dict[str, str]) -> list[tuple[str, int | None]]:
    """(hca, port or None) the job needs: cluster.preflight.ib_hcas, else NCCL_IB_HCA from cluster.env.

    NCCL_IB_HCA syntax: 'mlx5_0:1,mlx5_1', a leading '=' for exact names; a leading '^' excludes,
    which names nothing we can require, so it is ignored.
    """
    spec = list(ib_hcas)
    if not spec:
        raw = env.get("NCCL_IB_HCA", "").strip()
        if raw and not raw.startswith("^"):
            spec = [s for s in raw.lstrip("=").split(",") if s]
    out = []
    for item in spec:
        name, _, port = item.strip().partition(":")
        out.append((name, int(port) if port else None))
    return out


def check_ib(
    root: str,
    expected: list[tuple[str, int | None]],
    rate_gbps: float,
    node: str,
    before: dict[str, dict[str, int]] | None = None,
) -> list[Check]:
    """Every expected HCA present, ACTIVE, LinkUp, at the rate; error counters nonzero (warn) or rising (fail)."""
    present = list_ports(root)
    checks: list[Check] = []

    def add(c: Check) -> Check:
        c.node = node
        checks.append(c)
        return c

    if not expected:
        reason = f"no HCA expected; {len(present)} found" if present else "no HCA expected, none found"
        add(ok("ib.hcas", reason, found=sorted(present), expected=[]))
    for hca, want_port in expected:
        if hca not in present:
            add(fail("ib.present", f"HCA {hca} missing under {root}", subject=hca, found=sorted(present), expected=hca))
            continue
        ports = [want_port] if want_port else present[hca]
        for n in ports:
            subject = f"{hca}/{n}"
            if n not in present[hca]:
                add(fail("ib.present", f"port {n} missing", subject=subject, found=present[hca], expected=n))
                continue
            try:
                p = read_port(root, hca, n)
            except (OSError, ValueError) as exc:
                add(fail("ib.read", f"cannot read port: {exc}", subject=subject))
                continue
            add(ok("ib.present", subject=subject, found=p.link_layer))
            add(
                ok("ib.state", subject=subject, found=p.state, expected="ACTIVE")
                if p.state == "ACTIVE"
                else fail(
                    "ib.state",
                    "port not ACTIVE (subnet manager / cable?)",
                    subject=subject,
                    found=p.state,
                    expected="ACTIVE",
                )
            )
            add(
                ok("ib.phys_state", subject=subject, found=p.phys_state, expected="LinkUp")
                if p.phys_state == "LinkUp"
                else fail(
                    "ib.phys_state",
                    "physical link not up (Polling: no peer; Disabled: port off)",
                    subject=subject,
                    found=p.phys_state,
                    expected="LinkUp",
                )
            )
            if rate_gbps and p.rate_gbps < rate_gbps:
                add(
                    fail(
                        "ib.rate",
                        "link trained below the expected rate (cable or switch port)",
                        subject=subject,
                        found=p.rate_text,
                        expected=f"{rate_gbps:g} Gb/sec",
                    )
                )
            else:
                add(
                    ok(
                        "ib.rate",
                        subject=subject,
                        found=p.rate_text,
                        expected=f"{rate_gbps:g} Gb/sec" if rate_gbps else None,
                    )
                )
            add(_counter_check(p, (before or {}).get(subject)))
    return checks


def _counter_check(p: Port, before: dict[str, int] | None) -> Check:
    subject = p.name
    if before is not None:
        rising = {k: v - before[k] for k, v in p.counters.items() if k in before and v > before[k]}
        congestion = {k: d for k, d in rising.items() if k in CONGESTION_COUNTERS}
        rising = {k: d for k, d in rising.items() if k not in CONGESTION_COUNTERS}
        if congestion and not rising:
            return warn(
                "ib.errors",
                "congestion drops during preflight (not a link fault): "
                + ", ".join(f"{k} +{d}" for k, d in sorted(congestion.items())),
                subject=subject,
                found=congestion,
                expected={},
            )
        if rising:
            return fail(
                "ib.errors",
                "error counters rising during preflight: " + ", ".join(f"{k} +{d}" for k, d in sorted(rising.items())),
                subject=subject,
                found=rising,
                expected={},
            )
    nonzero = {k: v for k, v in p.counters.items() if v}
    if nonzero:
        return warn(
            "ib.errors",
            "error counters nonzero since boot (not rising now)",
            subject=subject,
            found=nonzero,
            expected={},
        )
    return ok("ib.errors", subject=subject, found={}, expected={})
