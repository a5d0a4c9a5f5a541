"""Local `meshrun` launches as the launcher tests start them: the interpreter, a tiny one-rank run, waiting.

The tests that start real local runs through the CLI (cancel, observability, report, the run-directory trust
tests, warm starts) share these instead of each keeping its own copy.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from helpers import ROOT

PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
"""The project's interpreter (what `make` installs), else the one running the tests."""
if not os.path.exists(PYTHON):
    PYTHON = sys.executable

TINY_RUN: list[str] = [
    "data=synthetic",
    "parallel=single",
    "cluster.gpus_per_node=1",
    "model.num_layers=2",
    "model.seq_length=32",
    "parallel.global_batch=2",
    "parallel.micro_batch=1",
]
"""One rank, a tiny model, random tokens: for launches that are about files, signals and locks, not numbers."""

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """The first truthy value of `predicate()`, polled every `poll_s`; past `timeout_s` an AssertionError
    naming `what` (a test that waits for a process never hangs the suite)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
