"""Mixture-of-experts MLP (model.num_experts > 0) with expert parallelism over parallel.ep.

The MLP of every layer becomes: a linear router (replicated), top-k selection, gates = softmax over all
experts then renormalised over the k chosen ones (as Mixtral does), and num_experts expert MLPs (gelu or
swiglu, hidden size model.moe_ffn_hidden_size) each applied to the tokens routed to it; a token's output is
the gate-weighted sum of its k experts' outputs.

Parameter names (layout-independent, docs/CONTRACTS.md): `layers.{i}.mlp.router.weight` [E, h] and, for each
GLOBAL expert index e, `layers.{i}.mlp.experts.{e}.fc1.weight` ([2f, h] under swiglu with gate/up rows
interleaved as in the dense MLP, else [f, h]), `...experts.{e}.fc2.weight` [h, f] (and `.bias` of both with
model.bias). A rank builds only the experts of its ep rank: e in [ep_rank x E/ep, (ep_rank + 1) x E/ep).
Expert parameters carry `expert_parallel = True`: their grads are reduced over the expert-data-parallel group
(training/optim/optimizer.py) and a checkpoint stores each expert under its global name, so any ep / dp reads it.

Tensor parallelism: the router and everything outside the experts run replicated on the tp ranks (the same
tokens, the same routing); each expert is split over tp like the dense MLP (fc1 column-parallel, fc2
row-parallel, one all-reduce of the experts' outputs). Under sequence parallelism the MoE block first gathers
the sequence (its grad is replicated, so backward keeps this rank's rows) and hands back this rank's rows
(backward all-gathers the grad): every tp rank routes the whole micro-batch, as without SP.

Expert parallelism: tokens are sorted by expert, their counts exchanged, and the tokens sent to their
experts' ranks with one all-to-all of variable split sizes per layer; the experts' outputs come back by
the reverse all-to-all (backward: the same exchanges in reverse). Capacity (model.moe_capacity_factor > 0):
an expert takes at most ceil(cf x T x k / E) of a micro-batch's T tokens from each source rank, in token
order; the others are dropped (their gate contributes nothing; the residual carries the token) and counted.

Load-balancing loss (Switch Transformer form, normalised to 1 at perfect balance): per layer
E / k x sum_e f_e P_e, f_e the fraction of the T x k assignments that chose expert e, P_e the mean router
probability of e; model.moe_aux_loss_coeff x its sum over layers joins the training loss. Its gradient is
injected in backward (the loss itself is computed on the last pipeline stage): `_AttachAux` hands the aux
term the same factor the training loss gets (loss scale / micro-batches, `set_aux_loss_grad_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.contract.config import ModelConfig
from training.parallel import collectives as comm
from training.parallel.collectives import all_gather_dim0, copy_to_tp, group_rank, group_size, reduce_from_tp
from training.parallel.layers import set_tp_meta

_AUX_GRAD_SCALE = [1.0]


def set_aux_loss_grad_scale(value: float) -> None:
    """The factor the training loss is multiplied by before backward (loss scale / micro-batches of the step):
    the aux losses' grads get the same (DistributedOptimizer.zero_grad and scale_loss set it)."""
    _AUX_GRAD_SCALE[0] = float(value)


def moe_ffn(mc: ModelConfig) -> int:
    """Hidden size of one expert."""
    return mc.moe_ffn_hidden_size or mc.ffn


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether a parameter belongs to an expert (sharded over ep, reduced over the expert-dp group)."""
    return bool(getattr(p, "expert_parallel", False))


def _bincount(x: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens per expert. Meta tensors (a rehearsal) have no values: the shape only (see _host_counts)."""
    if x.device.type == "meta":
        return torch.empty(n, dtype=torch.int64, device=x.device)
    return torch.bincount(x, minlength=n)


def _host_counts(counts: torch.Tensor, rows: int) -> list[int]:
    """counts on the host (the split sizes of the dispatch). On meta (a rehearsal) the balanced routing stands in:
    the `rows` assignments spread evenly over the experts, the first ones taking the remainder."""
    if counts.device.type != "meta":
        return counts.tolist()
    n = counts.numel()
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


class _AttachAux(torch.autograd.Function):
    """Identity on x; backward also gives the aux loss its gradient (the training loss's factor)."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full(ctx.aux_shape, _AUX_GRAD_SCALE[0], dtype=torch.float32, device=g.device)


class _AllToAll(torch.autograd.Function):
    """Rows of x sent to the ranks of `group` in in_splits-sized blocks; out_splits rows received from each."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        g = g.contiguous()
        back = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        comm.all_to_all_single(back, g, in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _GatherReplicated(torch.autograd.Function):
    """SP: the whole sequence from the shards; the grad is replicated over tp, so backward keeps own rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        n = group_size(ctx.group)
        return g.chunk(n, dim=0)[group_rank(ctx.group)].contiguous(), None


class _SplitReplicated(torch.autograd.Function):
    """SP: this rank's rows of a tensor every tp rank computed alike; backward gathers the grads of all rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = group_size(group)
        return x.chunk(n, dim=0)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g.contiguous(), ctx.group), None


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a recomputed forward under activation checkpointing): its
    routing is the original forward's, so the statistics must not count it twice. torch has no public flag."""
    return torch._C._current_graph_task_id() != -1


class Expert(nn.Module):
    """One expert: fc1 (column-parallel over tp) -> gelu or swiglu -> fc2 (row-parallel, reduced by the caller)."""

    def __init__(self, mc: ModelConfig, tp: int, dtype, device):
        super().__init__()
        f, h = moe_ffn(mc), mc.hidden_size
        if f % tp:
            raise ValueError(f"model.moe_ffn_hidden_size={f} is not divisible by tp={tp}; choose a tp that divides it")
        out1 = 2 * f if mc.activation == "swiglu" else f
        self.fc1 = nn.Module()
        self.fc1.weight = _expert_param(
            set_tp_meta(nn.Parameter(torch.empty(out1 // tp, h, dtype=dtype, device=device)), 0, (out1, h))
        )
        self.fc1.bias = (
            _expert_param(set_tp_meta(nn.Parameter(torch.empty(out1 // tp, dtype=dtype, device=device)), 0, (out1,)))
            if mc.bias
            else None
        )
        self.fc2 = nn.Module()
        self.fc2.weight = _expert_param(
            set_tp_meta(nn.Parameter(torch.empty(h, f // tp, dtype=dtype, device=device)), 1, (h, f))
        )
        self.fc2.bias = (
            _expert_param(set_tp_meta(nn.Parameter(torch.empty(h, dtype=dtype, device=device)), None, (h,)))
            if mc.bias
            else None
        )
        self.matmul = F.linear  # an FP8 matmul when train.precision=fp8 (training/model/fp8_apply.py)

    def partial(self, x: torch.Tensor, swiglu: bool, gelu_approximate: str) -> torch.Tensor:
        """This tp rank's partial sum of the expert's output (no fc2 bias): [n, h]."""
        y = self.matmul(x, self.fc1.weight, self.fc1.bias)
        if swiglu:
            gate, up = y.view(*y.shape[:-1], y.shape[-1] // 2, 2).unbind(-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=gelu_approximate)
        return self.matmul(y, self.fc2.weight, None)


def _expert_param(p: nn.Parameter) -> nn.Parameter:
    p.expert_parallel = True
    return p


class MoEStats:
    """What the layer routed in the current step (training forwards only; counted on this rank's tokens)."""

    def __init__(self, num_experts: int):
        self.tokens = torch.zeros(num_experts, dtype=torch.float64)
        """Assignments (token, slot) routed to each expert, before capacity drops."""
        self.aux = 0.0
        """Sum over micro-batches of coeff x this layer's balance loss."""
        self.dropped = 0
        """Assignments dropped by the capacity limit."""
        self.micro_batches = 0

    def reset(self) -> None:
        self.tokens.zero_()
        self.aux, self.dropped, self.micro_batches = 0.0, 0, 0


class MoEMLP(nn.Module):
    """Router + this rank's experts; forward(x) has the dense MLP's input and output layout."""

    def __init__(self, mc: ModelConfig, mesh, sp: bool, dtype, device):
        super().__init__()
        E, k = mc.num_experts, mc.moe_top_k
        ep = mesh.ep
        if E % ep:
            raise ValueError(
                f"model.num_experts={E} is not divisible by parallel.ep={ep}; choose an ep that divides it"
            )
        if not 1 <= k <= E:
            raise ValueError(f"model.moe_top_k={k} must be between 1 and model.num_experts={E}")
        self.num_experts, self.top_k, self.ep = E, k, ep
        self.ep_group = mesh.ep_group
        self.local_experts = E // ep
        self.first_expert = mesh.ep_rank * self.local_experts
        self.tp_group, self.sp = mesh.tp_group, sp and mesh.tp > 1
        self.swiglu = mc.activation == "swiglu"
        self.gelu_approximate = "tanh" if mc.gelu_tanh else "none"
        self.coeff = float(mc.moe_aux_loss_coeff)
        self.capacity_factor = float(mc.moe_capacity_factor)
        self.router = nn.Module()
        self.router.weight = set_tp_meta(
            nn.Parameter(torch.empty(E, mc.hidden_size, dtype=dtype, device=device)), None, (E, mc.hidden_size)
        )
        self.experts = nn.ModuleDict(
            {
                str(e): Expert(mc, mesh.tp, dtype, device)
                for e in range(self.first_expert, self.first_expert + self.local_experts)
            }
        )
        self.stats = MoEStats(E)

    # ----- routing -------------------------------------------------------------------------------------
    def _route(self, tokens: torch.Tensor):
        """gates [T, k] (renormalised over the k), experts [T, k], and the balance loss (fp32 scalar)."""
        logits = F.linear(tokens, self.router.weight).float()
        probs = logits.softmax(dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        gates = top / top.sum(dim=-1, keepdim=True)
        T = tokens.shape[0]
        counts = _bincount(chosen.reshape(-1), self.num_experts)
        f = counts.to(probs.dtype) / (T * self.top_k)
        balance = self.num_experts * (f * probs.mean(dim=0)).sum()
        return gates, chosen, balance, counts

    def _capacity_keep(self, chosen: torch.Tensor) -> torch.Tensor | None:
        """Which assignments (flat, token-major) fit their expert's capacity; None when dropless."""
        if self.capacity_factor <= 0 or chosen.device.type == "meta":  # meta: routing is balanced, nothing drops
            return None
        T = chosen.shape[0]
        cap = math.ceil(self.capacity_factor * T * self.top_k / self.num_experts)
        onehot = F.one_hot(chosen.reshape(-1), self.num_experts)
        position = onehot.cumsum(dim=0).gather(1, chosen.reshape(-1, 1)).squeeze(1) - 1
        return position < cap

    # ----- the experts -------------------------------------------------------------------------------
    def _run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows grouped by local expert (counts[j] rows for expert j) -> the experts' full outputs."""
        x = copy_to_tp(x, self.tp_group)
        outs = []
        for part, expert in zip(torch.split(x, counts, dim=0), self.experts.values()):
            outs.append(expert.partial(part, self.swiglu, self.gelu_approximate))
        y = reduce_from_tp(torch.cat(outs, dim=0), self.tp_group)
        experts = list(self.experts.values())
        if experts[0].fc2.bias is not None:
            bias = torch.stack([e.fc2.bias for e in experts])
            ids = torch.repeat_interleave(
                torch.arange(len(counts), device=x.device),
                torch.tensor(counts, device=x.device),
                output_size=sum(counts),  # known on the host: no device sync (and meta tensors can run it)
            )
            y = y + bias[ids]
        return y

    def _dispatch_compute_combine(self, send: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """send: rows sorted by global expert, counts [E] per expert -> the rows' expert outputs, same order."""
        E_loc = self.local_experts
        if self.ep == 1:
            return self._run_experts(send, _host_counts(counts, send.shape[0]))
        recv_counts = torch.empty_like(counts)
        comm.all_to_all_single(recv_counts, counts.contiguous(), group=self.ep_group)  # [ep, E_loc] from each source
        mine = _host_counts(counts, send.shape[0])
        send_splits = [sum(mine[i * E_loc : (i + 1) * E_loc]) for i in range(self.ep)]
        if send.device.type != "meta":
            recv_table = recv_counts.view(self.ep, E_loc)
        else:  # every source's balanced counts for this rank's experts (every rank routes as many tokens)
            block = mine[self.first_expert : self.first_expert + E_loc]
            recv_table = torch.tensor([block] * self.ep, dtype=torch.int64)
        recv_splits = recv_table.sum(dim=1).tolist()
        recv = _AllToAll.apply(send, recv_splits, send_splits, self.ep_group)
        # Received rows are grouped by source rank, then expert: regroup by expert (stable: source order kept).
        expert_of_row = torch.repeat_interleave(
            torch.arange(E_loc, device=recv_table.device).repeat(self.ep), recv_table.reshape(-1)
        ).to(send.device)
        order = torch.argsort(expert_of_row, stable=True)
        y = self._run_experts(recv[order], recv_table.sum(dim=0).tolist())
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(y[back], send_splits, recv_splits, self.ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, h] (batch-first) or under SP this rank's [s/tp, b, h]; the output has x's layout."""
        if self.sp:
            x = _GatherReplicated.apply(x, self.tp_group).transpose(0, 1)  # [b, s, h]: tokens in batch order
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        T = tokens.shape[0]
        gates, chosen, balance, counts = self._route(tokens)
        flat_expert = chosen.reshape(-1)
        flat_gate = gates.reshape(-1)
        flat_token = torch.arange(T, device=x.device).repeat_interleave(self.top_k)
        keep = self._capacity_keep(chosen)
        dropped = 0
        if keep is not None:
            dropped = int((~keep).sum())
            flat_expert, flat_gate, flat_token = flat_expert[keep], flat_gate[keep], flat_token[keep]
        order = torch.argsort(flat_expert, stable=True)
        kept_counts = _bincount(flat_expert, self.num_experts)
        y = self._dispatch_compute_combine(tokens[flat_token[order]], kept_counts)
        weighted = y * flat_gate[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros_like(tokens).index_add(0, flat_token[order], weighted).view(shape)
        if self.training and torch.is_grad_enabled() and self.coeff > 0:
            out = _AttachAux.apply(out, balance * self.coeff)
        if self.training and not _in_backward():
            st = self.stats
            if counts.device.type != "meta":  # a rehearsal's routing has no figures
                st.tokens += counts.to(torch.float64).cpu()
            st.aux += comm.value(balance.detach(), on_meta=0.0) * self.coeff
            st.dropped += dropped
            st.micro_batches += 1
        if self.sp:
            out = _SplitReplicated.apply(out.transpose(0, 1), self.tp_group)
        return out


def moe_layers(chunks) -> list[MoEMLP]:
    """The MoE MLPs of these model chunks, in layer order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, MoEMLP)]


def reset_moe_stats(chunks) -> None:
    """Start a step's statistics."""
    for m in moe_layers(chunks):
        m.stats.reset()


def moe_metrics(chunks, mesh, num_layers: int, num_experts: int) -> dict[str, Any]:
    """The step's MoE figures over the whole job (a collective over dp and pp; every rank calls it):
    moe_aux_loss (coeff x balance loss summed over layers, mean over micro-batches and dp), moe_max_load (the
    largest over layers of max tokens per expert / mean), moe_dropped_tokens (assignments dropped, whole step),
    and per layer `tokens_per_expert` [L][E] and `max_load` [L] for the moe_load event."""
    table = torch.zeros(num_layers, num_experts + 3, dtype=torch.float64)
    layer_ids = [i for c in chunks for i in getattr(c, "layer_ids", [])]
    for i, m in zip(layer_ids, moe_layers(chunks)):
        st = m.stats
        table[i, :num_experts] = st.tokens
        table[i, num_experts] = st.aux / max(1, st.micro_batches)
        table[i, num_experts + 1] = st.dropped
    # Reduced on the run's device: an NCCL group has no CPU backend ("No backend type associated with device
    # type cpu"); gloo's took the CPU table, which is why only a GPU run would have failed here.
    on_device = table.to(mesh.device)
    for group, size in ((mesh.dp_group, mesh.dp), (mesh.pp_group, mesh.pp)):
        if group is not None and size > 1:
            comm.all_reduce_op(on_device, group=group)
    if on_device.device.type != "meta":  # a rehearsal moves no data: its table stays this rank's own
        table = on_device.cpu()
    tokens = table[:, :num_experts]
    load = tokens.max(dim=1).values / tokens.mean(dim=1).clamp_min(1e-12)
    return {
        "moe_aux_loss": float(table[:, num_experts].sum()) / mesh.dp,
        "moe_max_load": float(load.max()),
        "moe_dropped_tokens": int(table[:, num_experts + 1].sum()),
        "tokens_per_expert": tokens.long().tolist(),
        "max_load": [round(float(v), 4) for v in load],
    }
