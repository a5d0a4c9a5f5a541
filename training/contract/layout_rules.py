"""The rules a parallel layout must satisfy, stated once for the launcher's validation and the engine.

Pure Python (no torch, no Hydra): launcher/plan/validate.py reports every violation before a launch,
and the engine checks the same rules at start-up (training/run/loop.py, training/model/gpt.py,
training/schedules/pipeline.py), so both say the same thing. Each rule returns `Violation`s that name their fix.

The rules: the hidden size splits into heads and the heads into query groups; tp divides the heads, the
query groups and the MLP width; pp x vpp divides the layers; vpp > 1 needs the interleaved schedule, which
needs pp > 1 and a number of micro-batches that is a multiple of pp; micro_batch x dp divides the global
batch; sequence parallelism needs tp > 1 (with tp = 1 it is off, with a warning, as in Megatron-LM) and a
sequence length divisible by tp; context parallelism needs the sequence length divisible by 2 x cp (times tp
under sp) and no dropout. The vocabulary is padded to a multiple of tp.
"""

from __future__ import annotations

from training.contract.config import Config, ModelConfig
from training.contract.stage_split import StageSplit, split_rules, stage_split
from training.contract.violation import Violation

# Codes of the violations after which no plan can be computed (the launcher stops before planning).
BLOCKS_PLAN = frozenset({"tp_heads", "tp_ffn", "layers", "batch", "interleaved_batch"})


class LayoutError(ValueError):
    """The engine was started on a layout that breaks the rules (the launcher's validation would refuse it)."""


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp: the embedding and output rows (docs/CONTRACTS.md)."""
    return -(-vocab_size // tp) * tp


def sequence_parallel_on(sp: bool, tp: int) -> bool:
    """Whether sequence parallelism really runs: asked for and tp > 1 (with tp = 1 there is nothing to shard)."""
    return bool(sp) and tp > 1


def divisors(n: int, limit: int) -> list[int]:
    """Divisors of n up to limit."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _closest(options: list[int], value: int) -> int:
    return min(options, key=lambda o: (abs(o - value), o))


def _error(key: str, message: str, fix: str, code: str = "") -> Violation:
    return Violation("error", key, message, fix, code)


# ---- model shape ----------------------------------------------------------------------------------
def model_rules(m: ModelConfig) -> list[Violation]:
    """Heads split the hidden size, query groups split the heads, rope needs an even head dimension."""
    out = []
    h, a, g = m.hidden_size, m.num_attention_heads, m.query_groups
    if h % a:
        out.append(
            _error(
                "model.hidden_size",
                f"hidden_size {h} is not divisible by num_attention_heads {a}",
                f"model.num_attention_heads={_closest([d for d in divisors(h, h) if d > 1] or [1], a)}",
            )
        )
    if a % g:
        out.append(
            _error(
                "model.num_query_groups",
                f"num_attention_heads {a} is not divisible by num_query_groups {g}",
                f"model.num_query_groups=<one of {divisors(a, a)}>",
            )
        )
    elif m.position == "rope" and (h // a) % 2:
        out.append(
            _error(
                "model.position",
                f"rope needs an even head dimension (hidden_size / heads = {h // a})",
                "model.position=learned, or hidden_size and num_attention_heads with an even ratio",
            )
        )
    return out


# ---- tensor parallelism ---------------------------------------------------------------------------
def valid_tp(cfg: Config) -> list[int]:
    """The tp values this model allows (within one node unless parallel.allow_tp_across_nodes)."""
    m, c = cfg.model, cfg.cluster
    limit = m.num_attention_heads if cfg.parallel.allow_tp_across_nodes else c.gpus_per_node
    return [d for d in divisors(m.num_attention_heads, limit) if m.query_groups % d == 0 and m.ffn % d == 0]


def tp_rules(m: ModelConfig, tp: int, fix_tp: list[int] | None = None) -> list[Violation]:
    """tp divides the attention heads, the query groups (key/value heads) and the MLP width."""
    out = []
    a, g = m.num_attention_heads, m.query_groups
    fix = f"parallel.tp=<one of {fix_tp}>" if fix_tp is not None else "parallel.tp=<a divisor of them>"
    if a % tp or g % tp:
        what = f"num_attention_heads {a}" + (f" and num_query_groups {g}" if g != a else "")
        out.append(_error("parallel.tp", f"{what} must be divisible by tp={tp}", fix, "tp_heads"))
    if m.ffn % tp:
        out.append(_error("parallel.tp", f"ffn_hidden_size {m.ffn} is not divisible by tp={tp}", fix, "tp_ffn"))
    return out


def sp_rules(sp: bool, tp: int, seq_length: int) -> list[Violation]:
    """Sequence parallelism shards the sequence over tp: off (a warning) at tp = 1, seq divisible by tp."""
    if not sp:
        return []
    if tp == 1:
        return [
            Violation(
                "warning",
                "parallel.sp",
                "sequence parallelism needs tp > 1: with tp=1 it is off",
                "parallel.sp=false (or parallel.tp=2 to use it)",
                "sp_off",
            )
        ]
    if seq_length % tp:
        return [
            _error(
                "parallel.sp",
                f"seq_length {seq_length} is not divisible by tp={tp} (sp shards the sequence)",
                f"model.seq_length={(seq_length // tp + 1) * tp} or parallel.sp=false",
                "sp_seq",
            )
        ]
    return []


# ---- pipeline parallelism -------------------------------------------------------------------------
def layer_rules(
    num_layers: int,
    pp: int,
    vpp: int,
    first_stage_layers: int = 0,
    last_stage_layers: int = 0,
    embedding_in_split: bool = False,
    loss_in_split: bool = False,
) -> list[Violation]:
    """The layers can be divided over the pp x vpp model chunks (training/contract/stage_split.py: evenly, with the
    embedding and the loss counted as layers, or with the first and last pipeline ranks' layers fixed)."""
    return split_rules(
        StageSplit(num_layers, pp, vpp, first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split)
    )


def split_layer_rules(cfg: Config) -> list[Violation]:
    """layer_rules for a config's layout (its split keys included)."""
    return split_rules(stage_split(cfg))


def schedule_rules(schedule: str, pp: int, vpp: int) -> list[Violation]:
    """vpp > 1 needs the interleaved schedule, and the interleaved schedule needs vpp > 1 and pp > 1."""
    out = []
    if schedule == "interleaved_1f1b":
        if vpp < 2:
            out.append(
                _error(
                    "parallel.vpp",
                    "schedule=interleaved_1f1b needs vpp > 1",
                    "parallel.vpp=2 or parallel.schedule=1f1b",
                    "schedule",
                )
            )
        if pp < 2:
            out.append(
                _error(
                    "parallel.pp",
                    "schedule=interleaved_1f1b needs pp > 1",
                    "parallel.pp=2 or parallel.schedule=1f1b",
                    "schedule",
                )
            )
    elif vpp > 1:
        out.append(
            _error(
                "parallel.vpp",
                f"vpp={vpp} needs schedule=interleaved_1f1b (got {schedule})",
                "parallel.schedule=interleaved_1f1b or parallel.vpp=1",
                "schedule",
            )
        )
    return out


def interleaved_batch_rules(
    schedule: str, pp: int, micro_batches: int, unit: int | None = None, group: int = 0
) -> list[Violation]:
    """The interleaved schedule sends micro-batches through the chunks in groups of g = microbatch_group_size
    (0: pp): Megatron-Core's rules, pp <= g <= micro-batches, and the last group (micro-batches mod g) empty or
    at least pp (a shorter one stalls the pipeline). A group size with another schedule is an error."""
    if schedule != "interleaved_1f1b":
        if group:
            return [
                _error(
                    "parallel.microbatch_group_size",
                    f"microbatch_group_size={group} applies to schedule=interleaved_1f1b only (got {schedule})",
                    "parallel.microbatch_group_size=0",
                    "microbatch_group",
                )
            ]
        return []
    if pp < 2:
        return []
    if group:
        if group < pp or group > micro_batches:
            return [
                _error(
                    "parallel.microbatch_group_size",
                    f"microbatch_group_size={group} must lie in [pp, micro-batches per step] = [{pp}, {micro_batches}]",
                    f"parallel.microbatch_group_size={min(max(group, pp), max(pp, micro_batches))}"
                    + ("" if micro_batches >= pp else f" and parallel.global_batch={pp * (unit or 1)}"),
                    "microbatch_group",
                )
            ]
        rest = micro_batches % group
        if 0 < rest < pp:
            return [
                _error(
                    "parallel.microbatch_group_size",
                    f"the last micro-batch group holds {rest} (micro-batches {micro_batches} mod group {group}): "
                    f"it must be 0 or at least pp={pp}",
                    f"parallel.microbatch_group_size={pp} or micro-batches per step a multiple of {group}",
                    "microbatch_group",
                )
            ]
        return []
    if micro_batches % pp == 0:
        return []
    fix = (
        f"parallel.global_batch={-(-micro_batches // pp) * pp * unit}"
        if unit
        else "parallel.global_batch = micro_batch x dp x a multiple of pp"
    )
    return [
        _error(
            "parallel.global_batch",
            f"interleaved_1f1b needs the micro-batches per step ({micro_batches}) to be a multiple of pp={pp}",
            fix,
            "interleaved_batch",
        )
    ]


def zero_bubble_rules(schedule: str, zero: int) -> list[Violation]:
    """zb_h1 runs each weight-grad pass (W) after its input-grad pass (B) has returned: zero=3 releases a unit's
    gathered parameters at the end of its backward, before W could use them."""
    if schedule != "zb_h1" or zero < 3:
        return []
    return [
        _error(
            "parallel.schedule",
            "schedule=zb_h1 does not run with zero=3 (the weight-grad pass needs the gathered parameters)",
            "parallel.zero=2 or parallel.schedule=1f1b",
            "schedule",
        )
    ]


# ---- data parallelism -----------------------------------------------------------------------------
def batch_rules(global_batch: int, micro_batch: int, dp: int) -> list[Violation]:
    """The global batch is micro_batch x dp x (gradient accumulation steps)."""
    unit = micro_batch * dp
    if global_batch % unit == 0:
        return []
    lo = max(unit, global_batch // unit * unit)
    return [
        _error(
            "parallel.global_batch",
            f"global_batch {global_batch} is not divisible by micro_batch x dp = {micro_batch} x {dp} = {unit}",
            f"parallel.global_batch={lo} or {lo + unit if lo < global_batch else lo * 2}"
            " (accumulation = global / (micro x dp))",
            "batch",
        )
    ]


# ---- context parallelism -------------------------------------------------------------------------
CP_COMMS = ("ring", "all_gather")


def cp_rules(cp: int, seq_length: int, tp: int, sp: bool, dropout: float, cp_comm: str = "ring") -> list[Violation]:
    """cp splits each sequence in 2 x cp chunks (causal load balancing), whose tokens sp splits again over tp;
    the cp attention has no dropout on the probabilities; cp_comm is ring or all_gather."""
    out = []
    if cp_comm not in CP_COMMS:
        out.append(
            _error(
                "parallel.cp_comm",
                f"cp_comm={cp_comm!r} is not one of {list(CP_COMMS)}",
                "parallel.cp_comm=ring",
                "cp_comm",
            )
        )
    if cp <= 1:
        return out
    unit = 2 * cp * (tp if sequence_parallel_on(sp, tp) else 1)
    if seq_length % unit:
        what = (
            f"2 x cp = {2 * cp}"
            if unit == 2 * cp
            else f"2 x cp x tp = {unit} (sp splits each cp rank's tokens over tp)"
        )
        out.append(
            _error(
                "parallel.cp",
                f"seq_length {seq_length} is not divisible by {what}: each sample is cut into 2 x cp chunks",
                f"model.seq_length={(seq_length // unit + 1) * unit} or "
                f"parallel.cp=<one with seq_length divisible by 2 x cp>",
                "cp_seq",
            )
        )
    if dropout > 0.0:
        out.append(
            _error(
                "model.dropout",
                f"dropout {dropout} with cp={cp}: context-parallel attention has no "
                "dropout on the attention probabilities",
                "model.dropout=0 or parallel.cp=1",
                "cp_dropout",
            )
        )
    return out


# ---- everything -----------------------------------------------------------------------------------
# ---- memory levers --------------------------------------------------------------------------------
ZERO_STAGES = (0, 1, 2, 3)
"""The ZeRO stages the engine runs."""


def memory_lever_rules(
    zero: int,
    recompute: str,
    recompute_num_layers: int,
    chunk_layers: int,
    offload: str = "none",
    offload_dir: str = "",
) -> list[Violation]:
    """zero is a stage the engine runs; recompute_num_layers is >= 0 and only means something under
    recompute=full (a warning otherwise, and when it covers the whole chunk anyway); offload=nvme names its
    directory."""
    out = []
    if str(offload) == "nvme" and not offload_dir:
        out.append(
            _error(
                "parallel.offload_dir",
                "offload=nvme needs a node-local directory for the state files",
                "parallel.offload_dir=/local/nvme/meshrun (or parallel.offload=cpu)",
                "offload",
            )
        )
    if zero not in ZERO_STAGES:
        out.append(
            _error(
                "parallel.zero",
                f"must be one of {list(ZERO_STAGES)}, got {zero}",
                "parallel.zero=1 (optimizer sharded), 2 (grads too), 3 (parameters too) or 0",
                "zero",
            )
        )
    n = recompute_num_layers
    if n < 0:
        out.append(
            _error(
                "parallel.recompute_num_layers",
                f"must be >= 0 (0 = every layer), got {n}",
                "parallel.recompute_num_layers=0",
                "recompute_num_layers",
            )
        )
    elif n > 0 and str(recompute) != "full":
        out.append(
            Violation(
                "warning",
                "parallel.recompute_num_layers",
                f"recompute_num_layers={n} only applies to recompute=full (got {recompute}): ignored",
                "parallel.recompute=full, or parallel.recompute_num_layers=0",
                "recompute_num_layers",
            )
        )
    elif n >= chunk_layers > 0 and n > 0:
        out.append(
            Violation(
                "warning",
                "parallel.recompute_num_layers",
                f"recompute_num_layers={n} covers every one of the chunk's {chunk_layers} layers",
                "parallel.recompute_num_layers=0 (all) or fewer",
                "recompute_num_layers",
            )
        )
    return out


def chunk_layer_count(cfg: Config) -> int:
    """Layers of the largest pipeline chunk (0 when the layers cannot be divided over the chunks)."""
    return stage_split(cfg).max_chunk_layers()


def moe_rules(m: ModelConfig, ep: int, dp: int, tp: int, cp: int, zero: int) -> list[Violation]:
    """Mixture of experts (training/model/moe.py): top_k within the experts, ep inside dp splitting the experts evenly,
    the expert width split by tp; what the engine does not run with experts yet (cp > 1, zero=3)."""
    out: list[Violation] = []
    E = m.num_experts
    if E < 0:
        return [_error("model.num_experts", f"num_experts={E} is negative", "model.num_experts=0 (dense) or > 0")]
    if E == 0:
        if ep > 1:
            out.append(
                _error(
                    "parallel.ep",
                    f"ep={ep} but the model has no experts (model.num_experts=0)",
                    "parallel.ep=1, or model.num_experts=<experts, a multiple of ep>",
                    "ep_dense",
                )
            )
        return out
    if not 1 <= m.moe_top_k <= E:
        out.append(
            _error(
                "model.moe_top_k",
                f"moe_top_k={m.moe_top_k} is outside 1..num_experts={E}",
                f"model.moe_top_k={min(max(1, m.moe_top_k), E)}",
                "moe_top_k",
            )
        )
    if m.moe_capacity_factor < 0:
        out.append(
            _error(
                "model.moe_capacity_factor",
                f"moe_capacity_factor={m.moe_capacity_factor} is negative",
                "model.moe_capacity_factor=0 (dropless) or a positive factor such as 1.25",
                "moe_capacity",
            )
        )
    good = [d for d in divisors(E, E) if dp < 1 or dp % d == 0]
    if ep < 1 or E % ep:
        out.append(
            _error(
                "parallel.ep",
                f"num_experts={E} is not divisible by ep={ep}",
                f"parallel.ep={_closest(good, ep)}",
                "ep_experts",
            )
        )
    elif dp >= 1 and dp % ep:
        out.append(
            _error(
                "parallel.ep",
                f"ep={ep} does not divide the data-parallel ranks dp={dp} (expert-parallel "
                "groups are carved out of dp)",
                f"parallel.ep={_closest(good, ep)}, or a dp that ep divides",
                "ep_dp",
            )
        )
    f = m.moe_ffn_hidden_size or m.ffn
    if tp > 1 and f % tp:
        out.append(
            _error(
                "model.moe_ffn_hidden_size",
                f"expert hidden size {f} is not divisible by tp={tp}",
                f"parallel.tp={max(divisors(f, tp))}, or an expert width tp divides",
                "tp_moe_ffn",
            )
        )
    if cp > 1:
        out.append(
            _error(
                "parallel.cp",
                f"cp={cp} with experts: the engine routes whole sequences (the balance loss "
                "and capacity are per micro-batch) and does not split them over cp yet",
                "parallel.cp=1 with model.num_experts > 0",
                "moe_cp",
            )
        )
    if zero >= 3:
        out.append(
            _error(
                "parallel.zero",
                "zero=3 with experts: expert weights are not gathered per unit yet",
                "parallel.zero=2 (grads and optimizer state sharded; expert state over the expert-dp group)",
                "moe_zero3",
            )
        )
    return out


def layout_violations(cfg: Config, dp: int) -> list[Violation]:
    """Every rule above for cfg's layout with `dp` data-parallel ranks (launcher and engine alike)."""
    m, par = cfg.model, cfg.parallel
    tp = tp_rules(m, par.tp)
    if tp:  # the fix lists the valid tp values: worked out only then (action=recommend checks thousands of layouts)
        tp = tp_rules(m, par.tp, valid_tp(cfg))
    out = model_rules(m) + tp + split_layer_rules(cfg)
    out += schedule_rules(par.schedule, par.pp, par.vpp)
    out += zero_bubble_rules(par.schedule, par.zero)
    out += sp_rules(par.sp, par.tp, m.seq_length)
    out += cp_rules(par.cp, m.seq_length, par.tp, par.sp, m.dropout, getattr(par, "cp_comm", "ring"))
    out += memory_lever_rules(
        par.zero,
        par.recompute,
        getattr(par, "recompute_num_layers", 0),
        chunk_layer_count(cfg),
        str(getattr(par, "offload", "none")),
        getattr(par, "offload_dir", ""),
    )
    out += moe_rules(m, getattr(par, "ep", 1), dp, par.tp, par.cp, par.zero)
    if dp >= 1:
        out += batch_rules(par.global_batch, par.micro_batch, dp)
        if not any(v.code == "batch" for v in out):
            unit = par.micro_batch * dp
            out += interleaved_batch_rules(
                par.schedule, par.pp, par.global_batch // unit, unit, getattr(par, "microbatch_group_size", 0)
            )
    return out


def raise_errors(violations: list[Violation]) -> list[Violation]:
    """Raise LayoutError listing every error (one per line); return the warnings."""
    errors = [v for v in violations if v.level == "error"]
    if errors:
        raise LayoutError(
            str(errors[0])
            if len(errors) == 1
            else "\n".join(["the parallel layout breaks these rules:"] + [f"  {v}" for v in errors])
        )
    return [v for v in violations if v.level != "error"]
