"""DistributedOptimizer: the object the training loop steps; it joins the parts of this package.

A step:
1. model-parallel finalisation of the grads (model_parallel.py: sp over tp, tied embedding over the
   pipeline ends);
2. the dp reduction of the gradient buffer (grad_buffer.py): zero=0 all-reduce, zero=1 reduce-scatter;
3. the global grad norm over this rank's shard, counting each parameter exactly once, summed over dp
   (zero=1) and the model-parallel group; a non-finite norm or loss skips the step (loss_scaler.py backs off);
4. clipping, then AdamW on the fp32 shard (adamw.py);
5. write-back to the parameters: zero=0 copies, zero=1 all-gathers the updated shards (bucketed, param_gather.py); with
   `step(defer_param_gather=True)` (the training loop's) those all-gathers run asynchronously and each
   part of the model waits for its own parameters when its next forward starts (param_gather.py).
zero=2 keeps only the shard of the main grads (grad_shard.py: reduced per bucket during backward, the
model-parallel sums after), zero=3 only the shard of the weights too (zero3.py: units gathered for their
forward and backward), and parallel.offload moves the AdamW state to host memory or files (offload.py).
The memory it holds is exactly docs/CONTRACTS.md's accounting (see `memory_report`). Checkpoints go
through `state_dict` / `load_state_dict`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from training.contract.config import Config, resolve_fused_adamw
from training.contract.precision import check_precision, grad_dtype, param_gather_inflight_chunks
from training.model.moe import is_expert_param, set_aux_loss_grad_scale
from training.optim.adamw import ShardedAdamW
from training.optim.flat import FlatLayout, Segment
from training.optim.grad_buffer import GradBuffer
from training.optim.grad_shard import ShardedGradBuffer
from training.optim.loss_scaler import LossScaler
from training.optim.model_parallel import ModelParallelGradSync
from training.optim.param_gather import ParamGather
from training.optim.zero3 import Zero3Params
from training.parallel import collectives as comm
from training.parallel.collectives import all_gather_single

SCALARS = ("step_count", "loss_scale", "good_steps")
"""The scalar entries of the optimizer's state_dict (the checkpoint's JSON part)."""


@dataclass
class StepResult:
    """What one optimizer step did."""

    grad_norm: float
    """Global grad norm before clipping (unscaled; inf/nan when the grads overflowed)."""
    skipped: bool
    """True when the update was not applied."""
    reason: str = ""
    """Why it was skipped: "nonfinite_loss" | "nonfinite_grad" | "" when applied."""
    loss_scale: float | None = None
    """fp16: the loss scale after this step (None otherwise)."""


@dataclass
class ParamShard:
    """One parameter's part of this rank's optimizer state (an entry of state_dict()["params"])."""

    name: str
    """Parameter name (the same at any layout)."""
    param: torch.nn.Parameter
    """The local parameter (its tp metadata places the state in the global tensor)."""
    param_start: int
    """First element of the parameter's flattened local values that the tensors cover."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """State name (exp_avg, exp_avg_sq, master) -> 1-D tensor of the covered elements."""


class DistributedOptimizer:
    """AdamW over this rank's parameters, with the dp reduction and precision handling of the engine."""

    def __init__(
        self, named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: Config, mesh, _expert_part: bool = False
    ):
        t = cfg.train
        # Mixture of experts (training/model/moe.py): the expert parameters get an optimizer of their own over the
        # expert-data-parallel group (grads reduced and state sharded over the dp ranks holding the same experts);
        # this one steps both with one grad norm and one loss scale. None without experts.
        self.experts: DistributedOptimizer | None = None
        named_params = list(named_params)
        expert_params = [(n, p) for n, p in named_params if is_expert_param(p)]
        if expert_params and not _expert_part:
            named_params = [(n, p) for n, p in named_params if not is_expert_param(p)]
            self.experts = DistributedOptimizer(expert_params, cfg, _expert_mesh(mesh), _expert_part=True)
        self.ep, self._expert_part = int(mesh.ep), _expert_part
        # The expert part's norm also sums over the ep ranks: they hold different experts.
        self._norm_ep_group = mesh.ep_group if _expert_part and self.ep > 1 else None
        check_precision(t.precision)
        self.cfg, self.mesh, self.precision = cfg, mesh, t.precision
        # Grads are averaged and the optimizer sharded over dp x cp (cp ranks hold the same parameters and
        # each computes the grads of its own tokens), in the dp_cp group's order: index dp_rank x cp + cp_rank.
        cp, cp_rank = mesh.cp, mesh.cp_rank
        self.layout = FlatLayout(named_params, cfg.parallel.zero, mesh.dp * cp, mesh.dp_rank * cp + cp_rank, mesh)
        lay = self.layout
        # The names tests and the loop read: the flat order and this rank's shard of it.
        self.names, self.params, self.numel = lay.names, lay.params, lay.numel
        self.zero, self.dp, self.shard_lo, self.shard_size = lay.zero, lay.dp, lay.shard_lo, lay.shard_size
        self.segments: list[Segment] = lay.segments
        self.dp_group = mesh.dp_cp_group if lay.dp > 1 else None
        # The parameters become views of one flat buffer: fp32 weights are updated in place. zero=3: each keeps
        # a storage of its own, gathered per unit (zero3.py), and the rank holds only its shard of the values.
        self.zero3: Zero3Params | None = None
        if lay.zero >= 3:
            self.zero3 = Zero3Params(
                lay,
                self.dp_group,
                getattr(cfg.parallel, "zero3_reshard_after_forward", True),
                # the FP8 linears' weights gathered in float8 (zero3.py; fp8_rules.py allows it at tensorwise only)
                bool(getattr(cfg.parallel, "fp8_all_gather", False)) and str(t.precision) == "fp8",
            )
            lay.shard_values = self.zero3.shard
        else:
            lay.flatten_params()
        grads_cls = ShardedGradBuffer if lay.zero >= 2 else GradBuffer  # zero=2: only the shard of main grads
        self.grads = grads_cls(
            lay,
            grad_dtype(t.precision),
            self.dp_group,
            cfg.parallel.bucket_mb,
            overlap=getattr(cfg.parallel, "overlap_grad_reduce", True),
        )
        self.finalize_grads = ModelParallelGradSync(lay.names, lay.params, cfg, mesh)
        self.grads.defer(self.finalize_grads.param_indices())
        offload = str(getattr(cfg.parallel, "offload", "none"))
        if offload != "none" and lay.param_buffer is None and lay.shard_values is None:
            raise ValueError("parallel.offload needs parameters of one dtype and device (one flat buffer)")
        self.adamw = ShardedAdamW(
            lay,
            t.beta1,
            t.beta2,
            t.eps,
            t.weight_decay,
            resolve_fused_adamw(getattr(t, "fused_adamw", None), mesh.device.type),
            offload,
            getattr(cfg.parallel, "offload_dir", ""),
            mesh.rank,
        )
        self.scaler = LossScaler(t.precision == "fp16", t.loss_scale_init, t.min_loss_scale, t.loss_scale_window)
        self.step_count = 0
        self._runs = self._counted_runs()
        # zero=1 over dp > 1 with one flat parameter buffer: the updated shards' all-gather, bucketed like the
        # grads; with overlap on it may run into the next forward (set up by watch_modules).
        self.param_gather: ParamGather | None = None
        if self.zero >= 1 and self.dp > 1 and lay.param_buffer is not None:
            self.param_gather = ParamGather(
                lay,
                self.dp_group,
                max(1, self.grads.bucket_elems // self.dp),
                param_gather_inflight_chunks(t.precision, cfg.parallel.bucket_mb, self.dp),
            )
        self._overlap = getattr(cfg.parallel, "overlap_grad_reduce", True)

    def watch_modules(self, chunks: list[torch.nn.Module]) -> None:
        """Let each part of these model chunks wait for its own parameters before its forward, so that
        `step(defer_param_gather=True)` may return before the updated shards are all gathered (overlap on)."""
        if self.param_gather is not None and self._overlap:
            self.param_gather.watch(chunks)
        if self.zero3 is not None:
            self.zero3.watch(chunks)  # zero=3: the units gather before their forward and backward
        if self.experts is not None:
            self.experts.watch_modules(chunks)

    def finish_param_gather(self) -> None:
        """Every parameter holds its updated value (a no-op unless a deferred gather is still running;
        zero=3: every unit gathered, until the next step releases them). For readers of the whole model
        (tests, benchmarks); the checkpoint paths and the loop's end call `finish_deferred_gather`, which never
        materialises a zero=3 model (2 B x every tp/pp-local parameter on every rank)."""
        self.finish_deferred_gather()
        if self.zero3 is not None and self.zero3.watching:
            self.zero3.gather_all()

    def finish_deferred_gather(self) -> None:
        """The zero=1/2 all-gather of the updated shards, if still running, is complete (zero=3: nothing to do,
        its shard is the weights)."""
        if self.param_gather is not None:
            self.param_gather.finish()
        if self.experts is not None:
            self.experts.finish_deferred_gather()

    # ----- what tests and the checkpoint code read --------------------------------------------------
    @property
    def exp_avg(self) -> torch.Tensor:
        return self.adamw.exp_avg

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.adamw.exp_avg_sq

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    # ----- the loop's calls --------------------------------------------------------------------------
    def zero_grad(self, num_micro_batches: int | None = None) -> None:
        """Start a step. Given its number of micro-batches (the loop does), each bucket's dp reduction starts
        during backward as soon as its grads are final; without it, everything is reduced in `step`, and the
        main grads (optimizer.grads.views) hold this rank's own sums until then."""
        self.grads.zero()
        if num_micro_batches is not None:
            self.grads.expect(num_micro_batches)
            if not self._expert_part:  # the parent's loss scale is the one the loss gets
                set_aux_loss_grad_scale(self.scaler.scale / num_micro_batches)
        if self.experts is not None:
            self.experts.zero_grad(num_micro_batches)

    def scale_loss(self, loss: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
        """The tensor to call backward on: mean over micro-batches, times the fp16 loss scale."""
        set_aux_loss_grad_scale(self.scaler.scale / num_micro_batches)  # MoE balance losses get the same factor
        return loss * (self.scaler.scale / num_micro_batches)

    def step(self, lr: float, loss_finite: bool = True, defer_param_gather: bool = False) -> StepResult:
        """Reduce grads, clip and apply AdamW with learning rate `lr` (or skip on non-finite values).

        defer_param_gather (zero=1, after watch_modules): return with the updated shards' all-gathers still
        running; the next forward waits for each module's part, anything else for `finish_param_gather`
        (state_dict and the next step call it)."""
        if self.zero3 is not None:
            if not self.zero3.watching:
                raise RuntimeError(
                    "parallel.zero=3: call optimizer.watch_modules(model_chunks) before training "
                    "(the units gather their parameters through its hooks)"
                )
            self.zero3.release_all()  # backward is over: only the shards stay
        else:
            self.finish_deferred_gather()
        shard = self.reduce_grads()
        grads = shard.float().div_(self.scaler.scale) if self.scaler.enabled else shard
        sq = self._grad_norm_sq(grads)
        expert_grads = None
        if self.experts is not None:  # reduced (and scaled by 1/ep) in reduce_grads
            eshard = self.experts.grads.shard()
            expert_grads = eshard.float().div_(self.scaler.scale) if self.scaler.enabled else eshard
            sq = sq + self.experts._grad_norm_sq(expert_grads)
        norm = comm.value(sq.sqrt(), on_meta=1.0)
        if not loss_finite or not math.isfinite(norm):
            self.scaler.backoff()
            reason = "nonfinite_loss" if not loss_finite else "nonfinite_grad"
            return StepResult(norm, True, reason, self.scaler.reported())
        clip = self.cfg.train.grad_clip
        coef = clip / (norm + 1e-6) if clip > 0 else 1.0
        self.step_count += 1
        self._update(grads, lr, min(coef, 1.0), defer_param_gather)
        if self.experts is not None:
            self.experts.step_count = self.step_count
            self.experts._update(expert_grads, lr, min(coef, 1.0), defer_param_gather)
        self.scaler.grow()
        return StepResult(norm, False, "", self.scaler.reported())

    def _update(self, grads: torch.Tensor, lr: float, coef: float, defer_param_gather: bool) -> None:
        """AdamW (step self.step_count) on this rank's shard with the clipped grads, then the write-back."""
        if self.adamw.store is not None:  # offloaded state: the update runs where it lives, block by block
            dest = self._param_shard()
            self.adamw.update_offloaded(grads, lr, self.step_count, coef, dest)
            self._write_back(dest, defer_param_gather)
        else:
            weights = self.adamw.weights()
            # The clipping (coef < 1) is applied to the grads block by block inside the update: one pass less.
            # Elementwise only: the same bits at any intra-op thread count.
            self.adamw.update(weights, grads, lr, self.step_count, grad_coef=coef)
            self._write_back(weights, defer_param_gather)

    def reduce_grads(self) -> torch.Tensor:
        """Finish the step's gradient reductions (model-parallel and dp); returns this rank's shard of the
        dp-averaged main grads (zero=0: every grad)."""
        self.grads.settle()
        if isinstance(self.grads, ShardedGradBuffer):
            self.grads.reduce_dp()  # zero=2: the dp sums first, then the model-parallel ones on the shard
            self.grads.finalize(self.finalize_grads, self.mesh)
        else:
            self.finalize_grads(self.grads.views)
            self.grads.reduce_dp()
        if self.experts is not None:
            expert = self.experts.reduce_grads()
            if self.ep > 1:
                # An expert's grad already sums the tokens of the ep ranks' micro-batches; the expert-dp average
                # covers dp / ep ranks: 1 / ep more gives the mean over all dp ranks, as for dense parameters.
                expert.mul_(1.0 / self.ep)
        return self.grads.shard()

    def _param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameter values in the model dtype (a view of what the model reads)."""
        if self.zero3 is not None:
            return self.zero3.shard
        return self.layout.shard_of(self.layout.param_buffer)

    def _counted_runs(self) -> list[tuple[int, int]]:
        """Shard ranges of the counted segments, adjacent ones merged (tp = pp = 1: one range, the whole shard)."""
        runs: list[tuple[int, int]] = []
        for s in self.segments:
            if not s.counted:
                continue
            if runs and runs[-1][1] == s.shard_start:
                runs[-1] = (runs[-1][0], s.shard_end)
            else:
                runs.append((s.shard_start, s.shard_end))
        return runs

    def _grad_norm(self, grads: torch.Tensor) -> float:
        return comm.value(self._grad_norm_sq(grads).sqrt(), on_meta=1.0)

    def _grad_norm_sq(self, grads: torch.Tensor) -> torch.Tensor:
        """Squared global grad norm of this optimizer's parameters (fp64 scalar, the same on every rank)."""
        sq = torch.zeros((), dtype=torch.float64, device=grads.device)
        for lo, hi in self._runs:
            sq += torch.linalg.vector_norm(grads[lo:hi]).double() ** 2
        if self.zero >= 1 and self.dp > 1:
            comm.all_reduce_op(sq, group=self.dp_group)
        if self.mesh.tp * self.mesh.pp > 1:
            comm.all_reduce_op(sq, group=self.mesh.model_parallel_group)
        if self._norm_ep_group is not None:
            comm.all_reduce_op(sq, group=self._norm_ep_group)
        return sq

    def _write_back(self, values: torch.Tensor, defer: bool = False) -> None:
        """Updated shard values into the parameters: a copy, or (zero=1) an all-gather of every rank's shard."""
        lay = self.layout
        if self.zero3 is not None:  # the shard is the weights: the next gathers read it
            if self.zero3.shard.data_ptr() != values.data_ptr():
                self.zero3.shard.copy_(values)
            return
        buf = lay.param_buffer
        if buf is not None:
            own = lay.shard_of(buf)
            if own.data_ptr() != values.data_ptr():
                own.copy_(values)  # 16-bit weights from the fp32 masters (fp32: updated in place already)
            if self.param_gather is not None:
                self.param_gather.start()
                if not (defer and self.param_gather.watching):
                    self.param_gather.finish()
            return
        if self.zero == 0 or self.dp == 1:
            lay.write(values[: self.numel], self.shard_lo)
            return
        dtype = self.params[0].dtype
        src = values.to(dtype)
        width = max(1, self.grads.bucket_elems // self.dp)
        for start in range(0, self.shard_size, width):
            piece = src[start : start + width].contiguous()
            out = torch.empty(self.dp * piece.numel(), dtype=dtype, device=src.device)
            all_gather_single(out, piece, group=self.dp_group)
            for q, row in enumerate(out.view(self.dp, piece.numel())):
                flat_start = q * self.shard_size + start
                if flat_start < self.numel:
                    lay.write(row[: self.numel - flat_start], flat_start)

    # ----- accounting and checkpoints ----------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank really holds for weights, main grads and optimizer state (docs/CONTRACTS.md)."""
        weights = (
            self.zero3.nbytes() if self.zero3 is not None else sum(p.numel() * p.element_size() for p in self.params)
        )
        out = {"weights": weights, "grads": self.grads.nbytes(), "optimizer": self.adamw.nbytes()}
        if self.adamw.offload != "none":
            out.update(host_offload=self.adamw.host_bytes(), nvme_offload=self.adamw.file_bytes())
        if self.experts is not None:
            for k, v in self.experts.memory_report().items():
                out[k] = out.get(k, 0) + v
        return out

    def transient_report(self) -> dict[str, int]:
        """Bytes this rank holds for a while beside memory_report's (plan.json's `param_gather`): the zero=1/2
        all-gather of the updated shards, at most its in-flight chunks (training/optim/param_gather.py); with
        experts, plus the expert optimizer's own (the loop defers both: they are in flight at once)."""
        pg = self.param_gather
        total = 0
        if pg is not None:
            inflight = min(pg.max_inflight, len(pg.starts))
            total = inflight * (self.dp + 1) * pg.width * self.layout.param_buffer.element_size()
        if self.experts is not None:
            total += self.experts.transient_report()["param_gather"]
        return {"param_gather": total}

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state.

        {"step_count", "loss_scale", "good_steps": scalars,
         "replicated_over_dp": True when every dp rank holds the same state (zero=0),
         "params": [ParamShard per parameter with elements in this rank's shard],
         "model_shards": zero=3 only: [ParamShard per parameter with elements in this rank's shard, tensors
                         {"model": the shard's values in the model dtype}]: a checkpoint saves and loads the
                         model from them, never from gathered parameters,
         "sharded_params": zero=3 only: the names of every parameter the shards stand for (those outside this
                           rank's shard included: this rank saves nothing of them)}.
        The tensors are views of the optimizer's own buffers: a loader that fills tensors in place
        (torch.distributed.checkpoint does) loads straight into the optimizer, and load_state_dict then
        only takes the scalars and notices what is missing.
        """
        self.finish_deferred_gather()  # a checkpoint reads the parameters right after this (zero<3)
        params = self._shards(self.adamw.tensors())
        if self.experts is not None:  # expert entries: replicated over the expert-dp group at zero=0
            params += self.experts._shards(self.experts.adamw.tensors())
        out = {
            "step_count": self.step_count,
            **self.scaler.state_dict(),
            "replicated_over_dp": self.zero == 0,
            "params": params,
        }
        if self.zero3 is not None:
            out["model_shards"] = self._shards({"model": self.zero3.shard})
            out["sharded_params"] = list(self.names)
        return out

    def _shards(self, states: dict[str, torch.Tensor]) -> list[ParamShard]:
        lay = self.layout
        return [
            ParamShard(
                lay.names[s.param_index],
                lay.params[s.param_index],
                s.param_start,
                {k: t[s.shard_start : s.shard_end] for k, t in states.items()},
            )
            for s in self.segments
        ]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a state_dict() of this optimizer's layout (resharding is the checkpoint's job).

        A parameter whose entry lacks "master" (a checkpoint written in fp32) gets its master copy from
        the parameter's current (already loaded) values.
        """
        if self.experts is not None:
            mine = set(self.names)
            self.experts.load_state_dict(
                {**state, "params": [e for e in state.get("params", []) if e.name not in mine]}
            )
            state = {**state, "params": [e for e in state.get("params", []) if e.name in mine]}
        self.step_count = int(state["step_count"])
        self.scaler.load_state_dict(state)
        self.finish_deferred_gather()
        states = self.adamw.tensors()  # offload=nvme: a copy read from the files, written back below
        own = {s_.name: s_ for s_ in self._shards(states)}
        refresh = []
        for entry in state.get("params", []):
            mine = own[entry.name]
            for key, dst in mine.tensors.items():
                src = entry.tensors.get(key)
                if src is None:
                    if key == "master":
                        refresh.append(self.names.index(entry.name))
                    continue
                if src.data_ptr() != dst.data_ptr():  # loaded in place already: nothing to copy
                    dst.copy_(src)
        self.adamw.store_tensors(states)
        if self.zero3 is not None:
            # The checkpoint loaded the shard in place (state_dict's model_shards): units gathered before the
            # load hold old values, so release them; the hooks gather from the new shard.
            self.zero3.release_all()
        self.adamw.refresh_master(refresh)


def _expert_mesh(mesh):
    """The mesh as the expert optimizer sees it: its data-parallel group is the expert-data-parallel one."""
    view = copy.copy(mesh)
    view.dp, view.dp_rank = int(mesh.edp), int(mesh.edp_rank)
    group = mesh.edp_group if mesh.ep > 1 else mesh.dp_group
    view.dp_group = view.dp_cp_group = group
    view.cp, view.cp_rank = 1, 0
    return view
