"""The host copy of an asynchronous save: persistent buffers, filled off the training thread.

An asynchronous save writes a snapshot of the training state while training goes on, so the state is first
copied ("staged") to host memory that training does not touch. `HostStager` keeps that memory from one save
to the next (one compact buffer per saved piece, allocated at the first save that needs it), so a save after
the first neither allocates nor page-faults; and the copy runs in the checkpoint's background thread, so
the training loop runs the next step's forward and backward meanwhile: they only read the parameters and
the optimizer state. The loop waits for the copy (CheckpointManager.wait_staged) before the optimizer
changes them.

Per save (one at a time: CheckpointManager.save waits for the previous one first):
    pieces = stager.prepare(pieces)   # training thread: the same pieces, over the host buffers
    ...                               # background thread:
    stager.copy()                     #   fill the buffers (never raises: the loop's barrier must not)
    dcp.save(...)                     #   the writer calls stager.raise_if_failed() before writing anything
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from training.checkpoint.layout import Piece

_Copy = tuple[torch.Tensor, torch.Tensor]  # (live source, host buffer)


class HostStager:
    """Copies a save's pieces into host buffers that are reused from one save to the next."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._copies: list[_Copy] = []
        self._ready: Any | None = None  # a CUDA event: where the training stream was at prepare()
        self._error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        """Host memory held for staging."""
        return sum(b.nbytes for b in self._buffers.values())

    def prepare(self, pieces: Sequence[Piece]) -> list[Piece]:
        """The pieces with their tensors replaced by this stager's host buffers; `copy` fills them.

        Buffers are compact (their storage is exactly the piece's bytes), so DCP's writer writes them as
        they are instead of cloning views of larger flat buffers."""
        buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        copies: list[_Copy] = []
        out: list[Piece] = []
        for p in pieces:
            src = p.tensor.detach()
            key = (p.key, p.offsets, tuple(src.shape), src.dtype)
            dst = buffers.get(key)
            if dst is None:
                dst = self._buffers.get(key)
                if dst is None:
                    # Pinned for a GPU source: a pageable destination makes the copy synchronous and staged
                    # through the driver's own bounce buffer. Pinning locks the pages now (cudaHostAlloc), on the
                    # training thread, at the first async save and after a layout change; later saves reuse the
                    # buffers. torch's host allocator rounds each pinned buffer up to a power of two (up to 2x
                    # the piece). A CPU source: pageable, and allocating only reserves address space (the first
                    # copy, in the background thread, touches the pages).
                    # A meta source (the rehearsal, training/rehearse/runner.py): a meta buffer of the same bytes.
                    host = "meta" if src.is_meta else "cpu"
                    dst = torch.empty(src.shape, dtype=src.dtype, device=host, pin_memory=src.is_cuda)
                buffers[key] = dst
            copies.append((src, dst))
            out.append(Piece(p.key, dst, p.offsets, p.global_shape))
        # Buffers of pieces this save no longer has (a changed layout) are released.
        self._buffers, self._copies, self._error, self._ready = buffers, copies, None, None
        if any(src.is_cuda for src, _ in copies):
            self._ready = torch.cuda.Event()
            self._ready.record()  # after every kernel the training thread has queued so far
        return out

    def copy(self) -> None:
        """Fill the buffers `prepare` handed out (the background thread). Never raises: a failure is kept
        for `raise_if_failed`."""
        copies, ready = self._copies, self._ready
        self._copies, self._ready = [], None
        try:
            with torch.no_grad():
                if ready is None:
                    for src, dst in copies:
                        dst.copy_(src)
                else:
                    self._copy_from_cuda(copies, ready)
        except BaseException as exc:  # noqa: BLE001 - re-raised inside DCP's write step, on every rank
            self._error = exc

    @staticmethod
    def _copy_from_cuda(copies: list[_Copy], ready: Any) -> None:
        """Device-to-host copies on a side stream that starts where the training stream was at prepare()."""
        stream = torch.cuda.Stream(device=next(src.device for src, _ in copies if src.is_cuda))
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for src, dst in copies:
                dst.copy_(src)
        stream.synchronize()

    def raise_if_failed(self) -> None:
        """Re-raise a failed copy; the checkpoint writer calls this before it writes anything, inside DCP's
        write step, which reports a failure on every rank (no rank is left waiting in a collective)."""
        if self._error is not None:
            raise RuntimeError(
                f"copying the state to host memory failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def close(self) -> None:
        """Release the buffers."""
        self._buffers, self._copies = {}, []
