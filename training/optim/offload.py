"""Where the optimizer state of an offloaded rank lives (parallel.offload): host memory or files.

- `HostStore` (offload=cpu): the fp32 state tensors (Adam moments, and the fp32 master weights) in host
  memory, pinned when the model is on a GPU so that the block copies can be asynchronous.
- `FileStore` (offload=nvme): one raw float32 file per state tensor under parallel.offload_dir/rank<r>/, read
  and written in blocks of OFFLOAD_BLOCK_ELEMS elements (positioned reads and writes into preallocated block
  buffers), so the rank holds only the blocks, never the state.
Both serve `block(name, lo, hi)` (a tensor of the state's elements [lo, hi) to update in place) and
`commit(name, lo, hi)` (after the update: FileStore writes the block back); `tensors()` gives every state
tensor whole (FileStore: read into memory, for a checkpoint) and `store_all()` writes such tensors back.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from training.contract.precision import OFFLOAD_BLOCK_ELEMS


class HostStore:
    """State tensors in host memory."""

    def __init__(self, names: List[str], size: int, initial: Dict[str, torch.Tensor], pin: bool):
        self.size = size
        self.tensors_: Dict[str, torch.Tensor] = {}
        for name in names:
            t = torch.zeros(size, dtype=torch.float32, pin_memory=pin)
            if name in initial:
                t.copy_(initial[name])
            self.tensors_[name] = t

    def block(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.tensors_[name][lo:hi]

    def commit(self, name: str, lo: int, hi: int) -> None:
        """Nothing to do: the block is a view of the state."""

    def tensors(self) -> Dict[str, torch.Tensor]:
        return self.tensors_

    def store_all(self, tensors: Dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if t.data_ptr() != self.tensors_[name].data_ptr():
                self.tensors_[name].copy_(t)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors_.values())

    def file_bytes(self) -> int:
        return 0


class FileStore:
    """State tensors in files, touched one block at a time."""

    def __init__(self, names: List[str], size: int, initial: Dict[str, torch.Tensor], directory: str):
        os.makedirs(directory, exist_ok=True)
        self.size, self.directory = size, directory
        self.block_elems = max(1, min(OFFLOAD_BLOCK_ELEMS, size))
        self.paths = {name: os.path.join(directory, f"{name}.f32") for name in names}
        self.fds: Dict[str, int] = {}
        # One block buffer per state: all a rank holds of the state between and during steps.
        self.buffers = {name: torch.zeros(self.block_elems, dtype=torch.float32) for name in names}
        for name, path in self.paths.items():
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size * 4)  # a sparse file of zeros (the moments start at zero)
            self.fds[name] = fd
            if name in initial:
                self._write_range(name, 0, initial[name].detach().to(torch.float32).cpu())
        self._view: Optional[Dict[str, torch.Tensor]] = None

    def _write_range(self, name: str, lo: int, values: torch.Tensor) -> None:
        """values (fp32, host) into the file from element lo, straight from the tensor's memory."""
        view = memoryview(values.contiguous().numpy()).cast("B")
        done = 0
        while done < len(view):  # a positioned write may be partial (the kernel caps one call near 2 GiB)
            done += os.pwrite(self.fds[name], view[done:], lo * 4 + done)

    def _read_range(self, name: str, lo: int, out: torch.Tensor) -> None:
        """The file's elements from lo into `out` (contiguous fp32), straight into its memory."""
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fds[name], [view[done:]], lo * 4 + done)
            if n <= 0:
                raise OSError(f"optimizer state file {self.paths[name]} ended early (offload=nvme)")
            done += n

    def block(self, name: str, lo: int, hi: int) -> torch.Tensor:
        buf = self.buffers[name][: hi - lo]
        self._read_range(name, lo, buf)
        return buf

    def commit(self, name: str, lo: int, hi: int) -> None:
        self._write_range(name, lo, self.buffers[name][: hi - lo])

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every state tensor read whole into memory (transient: a checkpoint's save or load)."""
        out = {}
        for name in self.paths:
            out[name] = torch.empty(self.size, dtype=torch.float32)
            self._read_range(name, 0, out[name])
        return out

    def store_all(self, tensors: Dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self._write_range(name, 0, t.detach().to(torch.float32).cpu())

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def file_bytes(self) -> int:
        return self.size * 4 * len(self.paths)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
