"""One text for a parallel layout: every printer of a layout (the planning gate, validate's fixes, resume,
recommend and calibrate, the sweep table, an elastic resubmission, the plan table) formats it here.

Pure Python (no torch, no Hydra). A `Layout` holds the degrees and settings a layout is made of; `layout_of`
reads them from a Config; `layout_fields` gives the fields events and status record; `format_layout` writes them
in one of four forms:

- "short": compact words for tables and messages: `tp2 pp2 v2 cp2 dp2 ep2 mb1 gb8 sp rc=selective[4] z1
  first7 last7 offload=cpu` (vpp, cp, ep, the recompute layer count, zero, the pipeline split's keys
  (first<N> last<N> emb-in-split loss-in-split) and offload only where they are not the default);
- "overrides": Hydra overrides to paste after whatever the user gave: every key, cp and dp included (an explicit
  parallel.dp or cp left from before would otherwise make the pasted layout invalid), the four keys of an uneven
  pipeline split when the layout sets one;
- "column": the sweep table's column: `tp2·pp2·dp2 vpp1 sp` (cp only when > 1);
- "world": how the world size splits: `world 8 = tp 2 x pp 2 x cp 1 x dp 2, vpp 2, ep 2 (inside dp)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.contract.config import Config, derived_dp

FORMS = ("short", "overrides", "column", "world")
"""The forms `format_layout` writes."""


@dataclass(frozen=True)
class Layout:
    """The parts of a parallel layout that its texts show."""

    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B)."""
    cp: int = 1
    """Context-parallel degree."""
    dp: int = 1
    """Data-parallel degree (derived from the ranks when the config leaves it out)."""
    ep: int | None = None
    """Expert-parallel degree (inside dp); None for a dense model, which has none to show."""
    zero: int = 0
    """ZeRO stage."""
    sp: bool = False
    """Sequence parallelism."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    global_batch: int | None = None
    """Sequences per step; None where the printer does not know it."""
    schedule: str = "1f1b"
    """Pipeline schedule."""
    recompute: str = "none"
    """Activation recomputation: none | selective | full."""
    recompute_num_layers: int = 0
    """Layers per stage recomputed under full recompute (0: all)."""
    offload: str = "none"
    """Where optimizer state is offloaded (none: kept on the GPU)."""
    first_stage_layers: int = 0
    """Layers of the first pipeline rank (0: the even split; training/contract/stage_split.py)."""
    last_stage_layers: int = 0
    """Layers of the last pipeline rank (0: the even split)."""
    embedding_in_split: bool = False
    """The embedding counts as a layer of the even split."""
    loss_in_split: bool = False
    """The output layer and the loss count as a layer of the even split."""

    @property
    def split_set(self) -> bool:
        """Whether any key of the pipeline split is set (else the even split)."""
        return bool(self.first_stage_layers or self.last_stage_layers or self.embedding_in_split or self.loss_in_split)

    @property
    def world(self) -> int:
        """The ranks the layout spans (ep lies inside dp)."""
        return self.tp * self.pp * self.cp * self.dp


def layout_of(cfg: Config, dp: int | None = None) -> Layout:
    """The layout of a config; dp as given (a plan's), else the config's own or derived one."""
    p = cfg.parallel
    return Layout(
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        cp=p.cp,
        dp=derived_dp(cfg) if dp is None else dp,
        ep=p.ep if cfg.model.num_experts > 0 else None,
        zero=p.zero,
        sp=bool(p.sp),
        micro_batch=p.micro_batch,
        global_batch=p.global_batch,
        schedule=str(p.schedule),
        recompute=str(p.recompute),
        recompute_num_layers=p.recompute_num_layers,
        offload=str(p.offload),
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
        embedding_in_split=bool(p.embedding_in_split),
        loss_in_split=bool(p.loss_in_split),
    )


def layout_fields(cfg: Config) -> dict[str, Any]:
    """The layout of a config as events and status show it: nodes, ranks, tp, pp, cp, dp, zero, micro and global
    batch, and the gradient accumulation they make (None when global_batch is not a multiple of a step's)."""
    p, c = cfg.parallel, cfg.cluster
    dp = derived_dp(cfg)
    per_step = p.micro_batch * dp
    return {
        "nodes": c.nodes,
        "ranks_per_node": c.gpus_per_node,
        "ranks": c.nodes * c.gpus_per_node,
        "tp": p.tp,
        "pp": p.pp,
        "cp": p.cp,
        "dp": dp,
        "zero": p.zero,
        "micro_batch": p.micro_batch,
        "global_batch": p.global_batch,
        "grad_accum": p.global_batch // per_step if per_step and p.global_batch % per_step == 0 else None,
    }


def _override(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_layout(lay: Layout, form: str = "short") -> str:
    """The layout as text in one of FORMS (the module docstring shows each)."""
    if form == "short":
        text = f"tp{lay.tp} pp{lay.pp}" + (f" v{lay.vpp}" if lay.vpp > 1 else "")
        text += (f" cp{lay.cp}" if lay.cp > 1 else "") + f" dp{lay.dp}"
        text += f" ep{lay.ep}" if lay.ep is not None and lay.ep > 1 else ""
        text += f" mb{lay.micro_batch}" + (f" gb{lay.global_batch}" if lay.global_batch is not None else "")
        text += (" sp" if lay.sp else "") + f" rc={lay.recompute}"
        text += f"[{lay.recompute_num_layers}]" if lay.recompute_num_layers else ""
        text += f" z{lay.zero}" if lay.zero else ""
        text += f" first{lay.first_stage_layers}" if lay.first_stage_layers else ""
        text += f" last{lay.last_stage_layers}" if lay.last_stage_layers else ""
        text += " emb-in-split" if lay.embedding_in_split else ""
        text += " loss-in-split" if lay.loss_in_split else ""
        return text + (f" offload={lay.offload}" if lay.offload != "none" else "")
    if form == "overrides":
        keys = [
            "tp",
            "pp",
            "vpp",
            "cp",
            "dp",
            "sp",
            "zero",
            "micro_batch",
            "schedule",
            "recompute",
            "recompute_num_layers",
            "offload",
        ]
        keys += ["ep"] if lay.ep is not None else []
        # The split's keys (training/contract/stage_split.py) when the layout sets any: all four, so that the
        # pasted line replaces a split given before
        keys += (
            ["first_stage_layers", "last_stage_layers", "embedding_in_split", "loss_in_split"] if lay.split_set else []
        )
        return " ".join(f"parallel.{k}={_override(getattr(lay, k))}" for k in keys)
    if form == "column":
        cp = f"cp{lay.cp}·" if lay.cp > 1 else ""
        return f"tp{lay.tp}·pp{lay.pp}·{cp}dp{lay.dp} vpp{lay.vpp}" + (" sp" if lay.sp else "")
    if form == "world":
        return (
            f"world {lay.world} = tp {lay.tp} x pp {lay.pp} x cp {lay.cp} x dp {lay.dp}"
            + (f", vpp {lay.vpp}" if lay.vpp > 1 else "")
            + (f", ep {lay.ep} (inside dp)" if lay.ep is not None and lay.ep > 1 else "")
        )
    raise ValueError(f"unknown layout form {form!r}: one of {', '.join(FORMS)}")
