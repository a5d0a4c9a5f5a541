"""Wait for rank 0's rendezvous store before torch's own client connects to it.

`init_process_group` with the env:// method makes rank 0 the TCPStore server at MASTER_ADDR:MASTER_PORT and every
other rank its client. A client that finds nothing listening yet backs off before it tries again, and goes on
waiting for a good part of a second after the server is up (measured in docs/PERFORMANCE.md, "The rendezvous"):
whenever a rank other than 0 starts first, the whole job pays that. A rank started by a warm agent
is up within milliseconds, so which rank is first is luck, on every start and every restart. Polling the port
with a plain TCP connect every few milliseconds, and letting torch connect only once it answers, makes the
process group come up as soon as rank 0 is there. The probe connects and closes without a word: the store
drops such a connection like any client that went away.
"""

from __future__ import annotations

import os
import socket
import time

POLL_S = 0.005
"""Between two connection attempts: a refused connect costs microseconds on a local network."""


def wait_for_store(timeout_s: float, addr: str | None = None, port: int | None = None, rank: int | None = None) -> None:
    """Return once rank 0's store accepts connections, at once on rank 0 itself or when the environment names no
    store (init_process_group then reports what is missing). addr, port and rank default to MASTER_ADDR,
    MASTER_PORT and RANK (the env:// method); a tcp:// caller passes its own. Raises RuntimeError naming the
    address after timeout_s, where torch's connect would have failed the same way, only later."""
    addr = addr if addr is not None else os.environ.get("MASTER_ADDR")
    port_text = str(port) if port is not None else os.environ.get("MASTER_PORT")
    rank_text = str(rank) if rank is not None else os.environ.get("RANK", "0")
    _wait(timeout_s, addr, port_text, rank_text)


def _wait(timeout_s: float, addr: str | None, port: str | None, rank: str) -> None:
    if rank == "0" or not addr or not port or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((addr, int(port)), timeout=min(1.0, left)):
                return
        except OSError as exc:  # refused (not listening yet), unreachable, name not resolved yet
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(POLL_S)
    raise RuntimeError(
        f"rank {rank}: rank 0's rendezvous at {addr}:{port} did not accept a connection within {timeout_s:g} s "
        f"(last: {last}). Rank 0 may have failed before it started (see its log), or this node cannot reach "
        f"{addr}: check MASTER_ADDR/MASTER_PORT and the firewall between the nodes"
    )
