"""AdamW on this rank's flat shard: fp32 moments and, for 16-bit weights, an fp32 master copy.

The update is torch.optim.AdamW's single-tensor algorithm with the same operation order, applied
elementwise to the whole shard at once; weight decay applies only to the segments that take it.
With train.fused_adamw the moment and weight update is torch's fused AdamW kernel (the one behind
torch.optim.AdamW(fused=True)) on the whole shard: one pass instead of seven, equal up to the last bits
(docs/PERFORMANCE.md gives the measured difference and the test that bounds it).
"""

from __future__ import annotations

import bisect
import os

import torch

from training.optim.flat import FlatLayout


class ShardedAdamW:
    """Adam moments (and the fp32 master weights when the parameters are not fp32) of one shard."""

    STATES = ("exp_avg", "exp_avg_sq", "master")
    """Names of the per-element state tensors (master only exists for 16-bit weights)."""
    BLOCK = 1 << 18
    """Elements per block of the CPU update (measured against smaller blocks and whole-shard passes:
    docs/PERFORMANCE.md "CPU AdamW block size"). Each op costs a few microseconds of dispatch per block, and five
    1 MiB blocks still stay in the last-level cache for the seven passes; a whole-shard pass per op streams the
    state through memory seven times."""
    DEVICE_BLOCK = 1 << 24
    """Elements per block on accelerators: bounds the fp32 scratch at 64 MiB (a whole-shard scratch is 4 B per
    element of the shard, e.g. 4.9 GiB for gpt_1p3b at dp=1, that no memory report or plan counted), while each
    block's passes stay long enough that the per-op launch cost does not show."""

    def __init__(
        self,
        layout: FlatLayout,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        fused: bool = False,
        offload: str = "none",
        offload_dir: str = "",
        rank: int = 0,
    ):
        self.layout = layout
        self.fused = fused
        self.offload = offload
        self._step_t = torch.zeros((), dtype=torch.float32, device=layout.params[0].device)
        self._scratch: torch.Tensor | None = None  # one block of the update's fp32 square roots
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        device = layout.params[0].device
        self.master: torch.Tensor | None = None
        sixteen_bit = any(p.dtype != torch.float32 for p in layout.params)
        self.store = None
        """offload=cpu|nvme: where the state lives (training/optim/offload.py), on CPU ranks too (their own host
        arena standing for pinned memory: the GPU's path, the same copies); None: on the device."""
        self._store_master = False
        if offload in ("cpu", "nvme"):
            self._init_store(offload, offload_dir, rank, device, sixteen_bit)
            self.exp_avg = self.exp_avg_sq = None
        else:
            if sixteen_bit:
                self.master = layout.read_shard()
            self.exp_avg = torch.zeros(layout.shard_size, dtype=torch.float32, device=device)
            self.exp_avg_sq = torch.zeros(layout.shard_size, dtype=torch.float32, device=device)
        # The shard ranges that take weight decay, adjacent segments merged.
        self._decay_runs: list[tuple[int, int]] = []
        for seg in layout.segments:
            if not seg.decay:
                continue
            if self._decay_runs and self._decay_runs[-1][1] == seg.shard_start:
                self._decay_runs[-1] = (self._decay_runs[-1][0], seg.shard_end)
            else:
                self._decay_runs.append((seg.shard_start, seg.shard_end))
        self._decay_ends = [b for _, b in self._decay_runs]

    def _init_store(self, offload: str, offload_dir: str, rank: int, device: torch.device, sixteen_bit: bool) -> None:
        from training.optim.offload import FileStore, HostStore, host_device

        self.host = host_device(device)

        names = ["exp_avg", "exp_avg_sq"]
        # The update runs where the state is: a master copy there unless the weights are fp32 in host memory.
        self._store_master = sixteen_bit or device.type != "cpu"
        if self._store_master:
            names.append("master")
        size = self.layout.shard_size
        if offload == "cpu":
            self.store = HostStore(names, size, pin=device.type == "cuda", host=self.host.type)
        else:
            import atexit
            import shutil
            import tempfile

            if not offload_dir:
                raise ValueError("parallel.offload=nvme needs parallel.offload_dir (a node-local directory)")
            os.makedirs(offload_dir, exist_ok=True)
            where = tempfile.mkdtemp(prefix=f"meshrun-optimizer-rank{rank}-", dir=offload_dir)
            atexit.register(shutil.rmtree, where, True)
            self.store = FileStore(names, size, where)
        if self._store_master:
            self._fill_master()

    def _fill_master(self) -> None:
        """The store's master copy from the parameters, segment by segment in blocks: the device never holds
        an fp32 copy of the shard (two such copies at once were 8 B/param above the plan while building)."""
        lay, block = self.layout, getattr(self.store, "block_elems", self.BLOCK)
        for s in lay.segments:
            p = lay.params[s.param_index].detach().reshape(-1)
            for lo in range(s.shard_start, s.shard_end, block):
                hi = min(lo + block, s.shard_end)
                start = s.param_start + lo - s.shard_start
                self.store.fill("master", lo, p[start : start + hi - lo])

    def store_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write back whole state tensors obtained from `tensors()` (offloaded state: a checkpoint's load)."""
        if self.store is not None:
            self.store.store_all(tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors that exist, by name (offload=nvme: read whole from the files, a copy)."""
        if self.store is not None:
            return self.store.tensors()
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            out["master"] = self.master
        return out

    def weights(self) -> torch.Tensor:
        """The fp32 values to update: the master copy; for fp32 params, this rank's shard of the flat parameter
        buffer itself (updated in place, no copy), or a fresh read when the parameters are not flattened."""
        if self.master is not None:
            return self.master
        if getattr(self.layout, "shard_values", None) is not None:
            return self.layout.shard_values  # zero=3: the shard of fp32 weights, updated in place
        if self.layout.param_buffer is not None:
            return self.layout.shard_of(self.layout.param_buffer)
        return self.layout.read_shard()

    def _decay(self, w: torch.Tensor, lr: float, lo: int, hi: int, base: int = 0) -> None:
        """Weight decay of the decayed elements of shard range [lo, hi) (torch's AdamW: p *= 1 - lr wd first);
        w holds the shard from element `base` on."""
        if not self.weight_decay:
            return
        runs = self._decay_runs
        i = bisect.bisect_right(self._decay_ends, lo)  # the first run ending after lo
        while i < len(runs) and runs[i][0] < hi:
            a, b = max(runs[i][0], lo), min(runs[i][1], hi)
            w[a - base : b - base].mul_(1 - lr * self.weight_decay)
            i += 1

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: float, step: int, grad_coef: float = 1.0) -> None:
        """One AdamW step number `step` (1-based) of the shard `w` with grads `g` times `grad_coef` (the clipping
        coefficient; g is scaled in place, as a separate g.mul_(grad_coef) would), in place."""
        if self.fused:
            self._fused_update(w, g, lr, step, grad_coef)
            return
        bc1 = 1 - self.beta1**step
        bc2 = 1 - self.beta2**step
        # In blocks that stay in cache, with one reused scratch: seven whole-shard passes stream the state
        # through memory seven times and allocate a shard-sized temporary each step (measured on CPU: slower
        # than torch's per-parameter loop). The clipping and the weight decay join each block's passes instead
        # of streaming the shard once more each. Elementwise, so every element gets exactly the same operations
        # in the same order as torch.optim.AdamW (clip, decay, then the moments and the update).
        # The blocks run in order at the caller's intra-op thread count, as torch.optim.AdamW's passes do:
        # spreading them over Python threads at one intra-op thread each cost the whole step about 6 % on CPU
        # (docs/PERFORMANCE.md, "The update's threads, reverted").
        n = w.numel()
        block = self.block_elements(w.device)

        def one_block(b: int) -> None:
            lo = b * block
            hi = min(lo + block, n)
            m, v, gg = self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], g[lo:hi]
            if grad_coef != 1.0:
                gg.mul_(grad_coef)
            self._decay(w, lr, lo, hi)
            m.lerp_(gg, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(gg, gg, value=1 - self.beta2)
            denom = torch.sqrt(v, out=self._scratch[: hi - lo])
            denom.div_(bc2**0.5).add_(self.eps)
            w[lo:hi].addcdiv_(m, denom, value=-lr / bc1)

        if self._scratch is None or self._scratch.numel() < min(block, n):
            self._scratch = torch.empty(min(block, n), dtype=torch.float32, device=w.device)
        for b in range(-(-n // block)):
            one_block(b)

    def _fused_update(self, w: torch.Tensor, g: torch.Tensor, lr: float, step: int, grad_coef: float) -> None:
        """train.fused_adamw: torch's fused kernel on the whole shard, after the clipping and the decay."""
        if grad_coef != 1.0:
            g.mul_(grad_coef)
        self._decay(w, lr, 0, w.numel())
        self._step_t.fill_(step)  # the kernel reads the step count (torch increments it before the call)
        torch._fused_adamw_(
            [w],
            [g],
            [self.exp_avg],
            [self.exp_avg_sq],
            [],
            [self._step_t],
            lr=lr,
            beta1=self.beta1,
            beta2=self.beta2,
            weight_decay=0.0,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
        )

    def block_elements(self, device: torch.device) -> int:
        """Elements per block of the non-fused update on this device (its fp32 scratch holds one block)."""
        return self.BLOCK if device.type == "cpu" else self.DEVICE_BLOCK

    def scratch_bytes(self) -> int:
        """Bytes of the non-fused update's fp32 scratch (one block; none before the first step)."""
        return 0 if self._scratch is None else self._scratch.numel() * self._scratch.element_size()

    def update_offloaded(self, g: torch.Tensor, lr: float, step: int, grad_coef: float, dest: torch.Tensor) -> None:
        """`update` with the state in the store, block by block: each block's grads go to the state, the same
        operations in the same order as `update` (so the result is the same, bit for bit), the state block is
        written back and the new weights go to `dest` (this rank's shard of the parameter values)."""
        bc1 = 1 - self.beta1**step
        bc2 = 1 - self.beta2**step
        store, n = self.store, g.numel()
        has_master = self._store_master
        block = getattr(store, "block_elems", self.BLOCK)
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            gg = g[lo:hi].to(self.host, torch.float32, copy=True)  # a copy on a CPU rank too: the GPU's transfer
            store.moved["to_store"] += hi - lo
            m, v = store.block("exp_avg", lo, hi), store.block("exp_avg_sq", lo, hi)
            w = store.block("master", lo, hi) if has_master else dest[lo:hi]
            if grad_coef != 1.0:
                gg.mul_(grad_coef)
            self._decay(w, lr, lo, hi, base=lo)
            m.lerp_(gg, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(gg, gg, value=1 - self.beta2)
            denom = torch.sqrt(v)
            denom.div_(bc2**0.5).add_(self.eps)
            w.addcdiv_(m, denom, value=-lr / bc1)
            store.commit("exp_avg", lo, hi)
            store.commit("exp_avg_sq", lo, hi)
            if has_master:
                store.commit("master", lo, hi)
                dest[lo:hi].copy_(w, non_blocking=True)
                store.moved["from_store"] += hi - lo

    def refresh_master(self, param_indices: list[int]) -> None:
        """Set the master copy of these parameters from their current values (a checkpoint without masters)."""
        if self.store is not None and param_indices:
            states = self.store.tensors()
            if "master" in states:
                wanted = set(param_indices)
                for s in self.layout.segments:
                    if s.param_index in wanted:
                        self.layout.read_segment(s, states["master"])
                self.store.store_all({"master": states["master"]})
            return
        if self.master is None:
            return
        wanted = set(param_indices)
        for s in self.layout.segments:
            if s.param_index in wanted:
                self.layout.read_segment(s, self.master)

    def nbytes(self) -> int:
        """Bytes of the state tensors on the device (offloaded: none; see host_bytes, file_bytes)."""
        if self.store is not None or self.offload != "none":
            return 0
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def host_bytes(self) -> int:
        """Bytes of offloaded state (or of its block buffers, nvme) in host memory."""
        return self.store.host_bytes() if self.store is not None else 0

    def file_bytes(self) -> int:
        """Bytes of optimizer state in files (offload=nvme)."""
        return self.store.file_bytes() if self.store is not None else 0
