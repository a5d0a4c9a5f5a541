"""training/parallel/rendezvous.py: a rank other than 0 waits for rank 0's store by polling its port, then torch's
client connects to a store that a silent probe connection left working."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from training.parallel.rendezvous import wait_for_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(monkeypatch, rank: str, port: int) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))


def test_waits_for_a_store_that_starts_later_and_leaves_it_working(monkeypatch):
    port = _free_port()
    _env(monkeypatch, "1", port)
    server: dict = {}

    def start_server() -> None:
        time.sleep(0.2)
        server["started"] = time.monotonic()
        server["store"] = dist.TCPStore(
            "127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
        )

    thread = threading.Thread(target=start_server)
    thread.start()
    try:
        wait_for_store(timeout_s=30)
        returned = time.monotonic()
    finally:
        thread.join()
    assert returned >= server["started"], "returned before rank 0's store existed"
    # The probe's connection came and went without a word; the store still serves a real client.
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
    client.set("rank1", "here")
    assert server["store"].get("rank1") == b"here"


def test_rank_zero_and_an_environment_without_a_store_do_not_wait(monkeypatch):
    port = _free_port()  # nothing listens there
    _env(monkeypatch, "0", port)
    wait_for_store(timeout_s=0.001)  # rank 0 is the store: it never waits for itself
    _env(monkeypatch, "1", port)
    monkeypatch.delenv("MASTER_ADDR")
    wait_for_store(timeout_s=0.001)  # init_process_group says what is missing, in its words


def test_no_store_within_the_timeout_names_the_address_and_the_fix(monkeypatch):
    port = _free_port()
    _env(monkeypatch, "3", port)
    with pytest.raises(RuntimeError) as err:
        wait_for_store(timeout_s=0.3)
    text = str(err.value)
    assert f"127.0.0.1:{port}" in text and "rank 3" in text and "MASTER_ADDR" in text
