"""CPU runs: the C allocator keeps the memory one step frees for the next step (the Trainer's keep_host_memory,
on in every run; the rehearsal turns it off).

PyTorch's CPU tensors come from malloc. glibc gives freed memory at the top of its heap back to the system
once more than M_TRIM_THRESHOLD bytes lie free there, and serves a block above M_MMAP_THRESHOLD with its own
mmap, unmapped again when it is freed. Both thresholds move with the sizes the process has freed so far, so
whether a step's activations (allocated during the forward, freed during the backward) are handed back and
faulted in again at the next step, the kernel zeroing every page in whichever thread first writes it, depends
on what the process happened to allocate and free before: the engine's long-lived flat buffers left it doing
that every step at one bench shape, the plain PyTorch model at another (docs/PERFORMANCE.md has the page
faults measured). Setting both thresholds fixes the choice: blocks up to glibc's largest mmap threshold come
from the heap, and the heap stays mapped between steps, as PyTorch's caching allocator keeps GPU memory.
Only where memory comes from changes, not what is computed (CPU tensors are aligned by PyTorch itself), so
every result is bit for bit the same; the process keeps its peak heap between steps.
"""

from __future__ import annotations

import ctypes
import platform

import torch

M_TRIM_THRESHOLD = -1
"""mallopt's parameter numbers (glibc's malloc.h)."""
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap: glibc's upper limit for M_MMAP_THRESHOLD on 64-bit systems."""
TRIM_THRESHOLD = 2**31 - 1
"""Free bytes at the top of the heap kept mapped: the largest value mallopt takes (a C int)."""

_applied = False


def keep_freed_host_memory(device: torch.device) -> bool:
    """On a CPU device under glibc: fix the two thresholds for this process (once). True when they are set."""
    global _applied
    if _applied:
        return True
    if device.type != "cpu" or platform.system() != "Linux":
        return False
    libc = ctypes.CDLL(None)  # the symbols this process already has
    # glibc's mallopt only: other C libraries have none, or parameters that mean other things.
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: setting either one stops glibc adjusting both, so set alone the trim
    # threshold would freeze the mmap threshold wherever it stands (128 KiB in a fresh process).
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
