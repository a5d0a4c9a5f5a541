"""Data-parallel gradient sync and AdamW with fp32 main grads/masters, ZeRO-1, loss scaling and clipping.

One flat gradient buffer per rank holds every local parameter's main grad (fp32 for fp32/bf16, fp16
for fp16), filled by post-accumulate-grad hooks that add each micro-batch's grad and free it. A step:
1. under sp, all-reduce the grads of `sequence_parallel` params over tp (each tp rank saw one
   sequence shard); with pp > 1 and tied embeddings, all-reduce the embedding grad over the
   embedding group (first and last stage);
2. dp reduction, bucketed: zero=0 all-reduce; zero=1 reduce-scatter, so this rank holds the reduced
   grads of its shard [r S, (r + 1) S) of the flat buffer padded to S x dp, S = ceil(N / dp);
3. global grad norm over this rank's shard, counting each parameter exactly once (tp-sharded params on
   every tp rank, tp-replicated ones on tp rank 0, the last stage's tied embedding copy never),
   summed over dp (zero=1) and the model-parallel group; non-finite norm or loss: skip the step;
4. clip, AdamW on the fp32 shard (masters for bf16/fp16, the params' values for fp32);
5. write back: zero=0 copies, zero=1 all-gathers (bucketed) the updated params.
The memory it holds is exactly docs/CONTRACTS.md's accounting (see `memory_report`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from training.config import Config

TIED_EMBEDDING = "embedding.word.weight"
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    """What one optimizer step did."""

    grad_norm: float
    """Global grad norm before clipping (unscaled; inf/nan when the grads overflowed)."""
    skipped: bool
    """True when the update was not applied."""
    reason: str = ""
    """Why it was skipped: "nonfinite_loss" | "nonfinite_grad" | "" when applied."""
    loss_scale: Optional[float] = None
    """fp16: the loss scale after this step (None otherwise)."""


@dataclass
class _Segment:
    """A parameter's elements inside this rank's shard of the flat buffer."""

    param_index: int
    shard_start: int
    """Start in the shard (0-based)."""
    shard_end: int
    param_start: int
    """Start in the parameter's flattened elements."""
    counted: bool
    """Counted in the grad norm on this rank."""
    decay: bool
    """Weight decay applies."""


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (every 1-D tensor) are not decayed."""
    return param.dim() < 2 or name.endswith(".bias")


def counts_in_norm(name: str, param: torch.Tensor, mesh) -> bool:
    """Whether this rank's copy of `param` enters the global grad norm (each element exactly once)."""
    if getattr(param, "tp_shard_dim", None) is None and mesh.tp_rank != 0:
        return False  # replicated over tp: tp rank 0 speaks for the group
    if name == TIED_EMBEDDING and mesh.pp > 1 and not mesh.is_first_stage:
        return False  # the last stage's copy of the tied embedding: the first stage counts it
    return True


class DistributedOptimizer:
    """AdamW over this rank's parameters, with the dp reduction and precision handling of the engine."""

    def __init__(self, named_params: Iterable[Tuple[str, torch.nn.Parameter]], cfg: Config, mesh):
        self.cfg, self.mesh = cfg, mesh
        t = cfg.train
        if t.precision not in PRECISIONS:
            raise ValueError(f"train.precision={t.precision!r}; use fp32, bf16 or fp16")
        self.precision = t.precision
        seen = set()
        self.names: List[str] = []
        self.params: List[torch.nn.Parameter] = []
        for name, p in named_params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            self.names.append(name)
            self.params.append(p)
        if not self.params:
            raise ValueError("no trainable parameters on this rank")
        device = self.params[0].device
        self.zero = cfg.parallel.zero
        self.dp = mesh.dp
        self.dp_rank = mesh.dp_rank
        self.dp_group = mesh.dp_cp_group if self.dp > 1 else None

        # Flat layout: parameter i occupies [offsets[i], offsets[i] + numel).
        self.offsets: List[int] = []
        n = 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        if self.zero == 1:
            self.shard_size = -(-n // self.dp)
            total = self.shard_size * self.dp
            self.shard_lo = self.dp_rank * self.shard_size
        else:
            self.shard_size, total, self.shard_lo = n, n, 0
        self.shard_hi = self.shard_lo + self.shard_size

        grad_dtype = torch.float16 if self.precision == "fp16" else torch.float32
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self._grad_views = [
            self.grad_buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)
        ]
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

        self.segments = self._build_segments()
        # fp32 masters only when the params are not fp32 themselves.
        self.master: Optional[torch.Tensor] = None
        if any(p.dtype != torch.float32 for p in self.params):
            self.master = self._gather_shard_values()
        self.exp_avg = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        self.step_count = 0
        self.loss_scale = float(t.loss_scale_init) if self.precision == "fp16" else 1.0
        self.good_steps = 0
        self.bucket_elems = max(1, int(cfg.parallel.bucket_mb * 2**20) // self.grad_buffer.element_size())
        self.sp_params = [
            i for i, p in enumerate(self.params)
            if getattr(p, "sequence_parallel", False) and cfg.parallel.sp and mesh.tp > 1
        ]
        self.tied_index = None
        if mesh.pp > 1 and cfg.model.tie_embeddings and TIED_EMBEDDING in self.names:
            self.tied_index = self.names.index(TIED_EMBEDDING)

    # ----- gradient accumulation -------------------------------------------------------------------
    def _make_hook(self, i: int):
        view = self._grad_views[i]

        def hook(param: torch.Tensor) -> None:
            # Accumulate into the main grad (fp32 under bf16) and free the model-dtype grad at once.
            view.add_(param.grad)
            param.grad = None

        return hook

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None

    def scale_loss(self, loss: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
        """The tensor to call backward on: mean over micro-batches, times the fp16 loss scale."""
        return loss * (self.loss_scale / num_micro_batches)

    # ----- layout helpers --------------------------------------------------------------------------
    def _build_segments(self) -> List[_Segment]:
        segs = []
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            start, end = self.offsets[i], self.offsets[i] + p.numel()
            lo, hi = max(start, self.shard_lo), min(end, self.shard_hi)
            if lo >= hi:
                continue
            segs.append(_Segment(i, lo - self.shard_lo, hi - self.shard_lo, lo - start,
                                 counts_in_norm(name, p, self.mesh), not no_weight_decay(name, p)))
        return segs

    def _gather_shard_values(self) -> torch.Tensor:
        """This rank's shard of the flat parameter values, in fp32 (padding zero)."""
        out = torch.zeros(self.shard_size, dtype=torch.float32, device=self.params[0].device)
        for s in self.segments:
            p = self.params[s.param_index].detach().reshape(-1)
            out[s.shard_start : s.shard_end].copy_(p[s.param_start : s.param_start + s.shard_end - s.shard_start])
        return out

    def _write_flat(self, values: torch.Tensor, flat_start: int) -> None:
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

    # ----- the step --------------------------------------------------------------------------------
    def _sync_model_parallel_grads(self) -> None:
        if self.sp_params:
            views = [self._grad_views[i] for i in self.sp_params]
            flat = torch.cat([v.reshape(-1) for v in views])
            dist.all_reduce(flat, group=self.mesh.tp_group)
            pos = 0
            for v in views:
                v.copy_(flat[pos : pos + v.numel()].view_as(v))
                pos += v.numel()
        if self.tied_index is not None and (self.mesh.is_first_stage or self.mesh.is_last_stage):
            dist.all_reduce(self._grad_views[self.tied_index], group=self.mesh.embedding_group)

    def _reduce_dp(self) -> None:
        if self.dp == 1:
            return
        inv = 1.0 / self.dp
        if self.zero == 0:
            for start in range(0, self.numel, self.bucket_elems):
                bucket = self.grad_buffer[start : start + self.bucket_elems]
                dist.all_reduce(bucket, group=self.dp_group)
                bucket.mul_(inv)
            return
        rows = self.grad_buffer.view(self.dp, self.shard_size)
        width = max(1, self.bucket_elems // self.dp)
        for start in range(0, self.shard_size, width):
            send = rows[:, start : start + width].contiguous().view(-1)
            out = rows[self.dp_rank, start : start + width]
            dist.reduce_scatter_single(out, send, group=self.dp_group)
            out.mul_(inv)

    def _all_gather_params(self, values: torch.Tensor) -> None:
        if self.zero == 0 or self.dp == 1:
            self._write_flat(values[: self.numel], self.shard_lo)
            return
        dtype = self.params[0].dtype
        src = values.to(dtype)
        width = max(1, self.bucket_elems // self.dp)
        for start in range(0, self.shard_size, width):
            piece = src[start : start + width].contiguous()
            out = torch.empty(self.dp * piece.numel(), dtype=dtype, device=src.device)
            dist.all_gather_single(out, piece, group=self.dp_group)
            for q, row in enumerate(out.view(self.dp, piece.numel())):
                flat_start = q * self.shard_size + start
                if flat_start < self.numel:
                    self._write_flat(row[: self.numel - flat_start], flat_start)

    def _grad_norm(self, grads: torch.Tensor) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=grads.device)
        for s in self.segments:
            if s.counted:
                sq += torch.linalg.vector_norm(grads[s.shard_start : s.shard_end]).double() ** 2
        if self.zero == 1 and self.dp > 1:
            dist.all_reduce(sq, group=self.dp_group)
        mp_group = getattr(self.mesh, "model_parallel_group", None)
        if self.mesh.tp * self.mesh.pp > 1:
            dist.all_reduce(sq, group=mp_group)
        return float(sq.sqrt())

    def _backoff(self) -> None:
        if self.precision == "fp16":
            self.loss_scale = max(self.cfg.train.min_loss_scale, self.loss_scale / 2)
            self.good_steps = 0

    def step(self, lr: float, loss_finite: bool = True) -> StepResult:
        """Reduce grads, clip and apply AdamW with learning rate `lr` (or skip on non-finite values)."""
        t = self.cfg.train
        self._sync_model_parallel_grads()
        self._reduce_dp()
        shard = self.grad_buffer[: self.shard_size] if self.zero == 0 else \
            self.grad_buffer[self.shard_lo : self.shard_hi]
        grads = shard.float().div_(self.loss_scale) if self.precision == "fp16" else shard
        norm = self._grad_norm(grads)
        scale = self.loss_scale if self.precision == "fp16" else None
        if not loss_finite or not math.isfinite(norm):
            self._backoff()
            reason = "nonfinite_loss" if not loss_finite else "nonfinite_grad"
            return StepResult(norm, True, reason, self.loss_scale if scale is not None else None)
        if t.grad_clip > 0:
            coef = t.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                grads.mul_(coef)
        weights = self.master if self.master is not None else self._gather_shard_values()
        self._adamw(weights, grads, lr)
        self._all_gather_params(weights)
        if self.precision == "fp16":
            self.good_steps += 1
            if self.good_steps >= t.loss_scale_window:
                self.loss_scale *= 2.0
                self.good_steps = 0
        return StepResult(norm, False, "", self.loss_scale if scale is not None else None)

    def _adamw(self, w: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        """torch.optim.AdamW's single-tensor update, elementwise on the flat shard (same op order)."""
        t = self.cfg.train
        self.step_count += 1
        if t.weight_decay:
            for s in self.segments:
                if s.decay:
                    w[s.shard_start : s.shard_end].mul_(1 - lr * t.weight_decay)
        self.exp_avg.lerp_(g, 1 - t.beta1)
        self.exp_avg_sq.mul_(t.beta2).addcmul_(g, g, value=1 - t.beta2)
        bc1 = 1 - t.beta1 ** self.step_count
        bc2 = 1 - t.beta2 ** self.step_count
        denom = (self.exp_avg_sq.sqrt() / (bc2 ** 0.5)).add_(t.eps)
        w.addcdiv_(self.exp_avg, denom, value=-lr / bc1)

    # ----- accounting and checkpoint hooks ---------------------------------------------------------
    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank really holds for weights, main grads and optimizer state (docs/CONTRACTS.md)."""
        weights = sum(p.numel() * p.element_size() for p in self.params)
        grads = self.grad_buffer.numel() * self.grad_buffer.element_size()
        opt = [self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else [])
        return {"weights": weights, "grads": grads, "optimizer": sum(x.numel() * x.element_size() for x in opt)}

    def state_dict(self) -> Dict[str, object]:
        """Optimizer state of this rank; flat tensors cover global flat positions [shard_lo, shard_lo + shard_size)."""
        return {
            "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "master": self.master,
            "step_count": self.step_count, "loss_scale": self.loss_scale, "good_steps": self.good_steps,
            "numel": self.numel, "shard_lo": self.shard_lo, "shard_size": self.shard_size,
            "names": list(self.names), "offsets": list(self.offsets),
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Inverse of state_dict for the same layout (resharding is the checkpoint module's job)."""
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        if self.master is not None:
            if state.get("master") is not None:
                self.master.copy_(state["master"])
            else:
                self.master.copy_(self._gather_shard_values())
        self.step_count = int(state["step_count"])
        self.loss_scale = float(state["loss_scale"])
        self.good_steps = int(state["good_steps"])

    def reload_master_from_params(self) -> None:
        """After the params were loaded from a checkpoint: refresh the fp32 masters from them."""
        if self.master is not None:
            self.master.copy_(self._gather_shard_values())
