"""Where each parameter sits in a rank's flat buffers, and which part of them this rank's shard holds.

Parameter i occupies flat positions [offsets[i], offsets[i] + numel_i). With zero >= 1 the flat range is
padded to S x dp, S = ceil(N / dp), and data-parallel rank r owns the shard [r S, (r + 1) S); with
zero=0 every rank owns the whole range. Gradient buffer, Adam states and checkpoints all use this layout.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from training.optim.model_parallel import counts_in_norm


@dataclass
class Segment:
    """A parameter's elements inside this rank's shard."""

    param_index: int
    """Index into FlatLayout.params."""
    shard_start: int
    """Start in the shard (0-based)."""
    shard_end: int
    """End in the shard (exclusive)."""
    param_start: int
    """Start in the parameter's flattened elements."""
    counted: bool
    """Counted in the global grad norm on this rank (each element of the model exactly once)."""
    decay: bool
    """Weight decay applies."""


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (every 1-D tensor) are not decayed."""
    return param.dim() < 2 or name.endswith(".bias")


class FlatLayout:
    """This rank's trainable parameters in flat order, and its shard of that order."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], zero: int, dp: int, dp_rank: int, mesh):
        seen = set()
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, p in named_params:
            if id(p) in seen or not p.requires_grad:
                continue  # a parameter shared by two modules is stored once
            seen.add(id(p))
            self.names.append(name)
            self.params.append(p)
        if not self.params:
            raise ValueError("no trainable parameters on this rank")
        self.zero, self.dp, self.dp_rank = zero, dp, dp_rank
        self.offsets: list[int] = []
        n = 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        if zero >= 1:
            self.shard_size = -(-n // dp)
            self.total = self.shard_size * dp
            self.shard_lo = dp_rank * self.shard_size
        else:
            self.shard_size, self.total, self.shard_lo = n, n, 0
        self.shard_hi = self.shard_lo + self.shard_size
        self.segments = self._segments(mesh)
        self.shard_values: torch.Tensor | None = None
        """zero=3: this rank's shard of the parameter values (model dtype), the only copy between gathers."""
        self.param_buffer: torch.Tensor | None = None
        """The parameters' values in flat order (padding zero) once `flatten_params` ran; the parameters are views."""

    def flatten_params(self) -> None:
        """Move every parameter into one flat buffer of the layout's order and make it a view of it.

        The optimizer then updates fp32 weights in place (no per-step gather into a fresh buffer and
        scatter back) and writes 16-bit weights back with one copy. Skipped when the parameters differ
        in dtype or device (each stays its own tensor; the optimizer copies as before).
        """
        first = self.params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
            return
        buf = torch.zeros(self.total, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for o, p in zip(self.offsets, self.params):
                view = buf[o : o + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
        self.param_buffer = buf

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a flat (padded, layout-ordered) tensor, as a view."""
        return flat[self.shard_lo : self.shard_hi]

    def _segments(self, mesh) -> list[Segment]:
        segs = []
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            start, end = self.offsets[i], self.offsets[i] + p.numel()
            lo, hi = max(start, self.shard_lo), min(end, self.shard_hi)
            if lo < hi:
                segs.append(
                    Segment(
                        i,
                        lo - self.shard_lo,
                        hi - self.shard_lo,
                        lo - start,
                        counts_in_norm(name, p, mesh),
                        not no_weight_decay(name, p),
                    )
                )
        return segs

    def read_shard(self) -> torch.Tensor:
        """This rank's shard of the flat parameter values, in fp32 (padding zero)."""
        out = torch.zeros(self.shard_size, dtype=torch.float32, device=self.params[0].device)
        for s in self.segments:
            self.read_segment(s, out)
        return out

    def read_segment(self, s: Segment, out: torch.Tensor) -> None:
        """Copy segment `s` of the parameter values into the shard-shaped `out` (zero=3: from the shard of
        values, which is the weights; the parameters may be released)."""
        if self.shard_values is not None:
            out[s.shard_start : s.shard_end].copy_(self.shard_values[s.shard_start : s.shard_end])
            return
        p = self.params[s.param_index].detach().reshape(-1)
        out[s.shard_start : s.shard_end].copy_(p[s.param_start : s.param_start + s.shard_end - s.shard_start])

    def write(self, values: torch.Tensor, flat_start: int) -> None:
        """Copy `values` (global flat positions flat_start..) into the parameters they belong to."""
        end = flat_start + values.numel()
        i = max(0, bisect.bisect_right(self.offsets, flat_start) - 1)
        with torch.no_grad():
            while i < len(self.params) and self.offsets[i] < end:
                p = self.params[i]
                ps, pe = self.offsets[i], self.offsets[i] + p.numel()
                lo, hi = max(ps, flat_start), min(pe, end)
                if lo < hi:
                    p.data.view(-1)[lo - ps : hi - ps].copy_(values[lo - flat_start : hi - flat_start])
                i += 1
