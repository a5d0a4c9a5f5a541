"""Where the optimizer state of an offloaded rank lives (parallel.offload): host memory or files.

- `HostStore` (offload=cpu): the fp32 state tensors (Adam moments, and the fp32 master weights) in one host
  arena, pinned when the model is on a GPU so that the block copies can be asynchronous. A CPU rank takes the
  same path (an arena of its own, standing for the pinned memory, with the same block copies in and out), so
  the CPU tests run what a GPU rank runs.
- `FileStore` (offload=nvme): one raw float32 file per state tensor under parallel.offload_dir/rank<r>/, read
  and written in blocks of OFFLOAD_BLOCK_ELEMS elements (positioned reads and writes into preallocated block
  buffers), so the rank holds only the blocks, never the state.
Both serve `block(name, lo, hi)` (a tensor of the state's elements [lo, hi) to update in place) and
`commit(name, lo, hi)` (after the update: FileStore writes the block back); `fill(name, lo, values)` writes a
range (the master copy is filled segment by segment from the parameters, never as a whole shard on the device);
`tensors()` gives every state tensor whole (FileStore: read into memory, for a checkpoint) and `store_all()`
writes such tensors back. `moved` counts the elements copied between the device and the store
(`to_store`, `from_store`): the transfers a step makes, which the tests compare with the shard's size.
"""

from __future__ import annotations

import os

import torch

from training.contract.precision import OFFLOAD_BLOCK_ELEMS


def _moved() -> dict[str, int]:
    return {"to_store": 0, "from_store": 0}


def host_device(device: torch.device) -> torch.device:
    """Where host memory is for a rank on `device`: the CPU, or meta under a rehearsal (training/rehearse/: meta
    tensors have no values to copy to a CPU; its memory counts the host state apart from the device's)."""
    return torch.device("meta") if device.type == "meta" else torch.device("cpu")


class HostStore:
    """State tensors in one host arena (pinned for a GPU rank: one pinned allocation, not one per state)."""

    def __init__(self, names: list[str], size: int, pin: bool, host: str = "cpu"):
        self.size = size
        self.arena = torch.zeros(len(names) * size, dtype=torch.float32, pin_memory=pin and host == "cpu", device=host)
        self.tensors_: dict[str, torch.Tensor] = {
            name: self.arena[i * size : (i + 1) * size] for i, name in enumerate(names)
        }
        self.moved = _moved()

    def fill(self, name: str, lo: int, values: torch.Tensor) -> None:
        """values (any device and float dtype) into the state's elements from lo."""
        self.tensors_[name][lo : lo + values.numel()].copy_(values)
        self.moved["to_store"] += values.numel()

    def block(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.tensors_[name][lo:hi]

    def commit(self, name: str, lo: int, hi: int) -> None:
        """Nothing to do: the block is a view of the state."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors_

    def store_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if t.data_ptr() != self.tensors_[name].data_ptr():
                self.tensors_[name].copy_(t)

    def host_bytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def file_bytes(self) -> int:
        return 0


class FileStore:
    """State tensors in files, touched one block at a time."""

    def __init__(self, names: list[str], size: int, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.size, self.directory = size, directory
        self.block_elems = max(1, min(OFFLOAD_BLOCK_ELEMS, size))
        self.paths = {name: os.path.join(directory, f"{name}.f32") for name in names}
        self.fds: dict[str, int] = {}
        # One block buffer per state: all a rank holds of the state between and during steps.
        self.buffers = {name: torch.zeros(self.block_elems, dtype=torch.float32) for name in names}
        for name, path in self.paths.items():
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size * 4)  # a sparse file of zeros (the moments start at zero)
            self.fds[name] = fd
        self._view: dict[str, torch.Tensor] | None = None
        self.moved = _moved()

    def fill(self, name: str, lo: int, values: torch.Tensor) -> None:
        """values (any device and float dtype, at most one block) into the file from element lo, through the
        state's block buffer."""
        buf = self.buffers[name][: values.numel()]
        buf.copy_(values)
        self._write_range(name, lo, buf)
        self.moved["to_store"] += values.numel()

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

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor read whole into memory (transient: a checkpoint's save or load)."""
        out = {}
        for name in self.paths:
            out[name] = torch.empty(self.size, dtype=torch.float32)
            self._read_range(name, 0, out[name])
        return out

    def store_all(self, tensors: dict[str, torch.Tensor]) -> None:
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
