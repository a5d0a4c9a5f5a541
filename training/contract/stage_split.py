"""How the transformer layers are divided over pipeline stages (pure Python: the engine and the planner both read it).

Megatron-LM's two forms, with its semantics:
- even (default): every virtual stage gets (num_layers + e + l) / (pp x vpp) layers, where e = 1 with
  parallel.embedding_in_split and l = 1 with parallel.loss_in_split (Megatron's
  account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split): the embedding and the output
  layer with the loss each count as one layer, so the first virtual stage builds one transformer layer fewer, and
  the last one too;
- uneven: parallel.first_stage_layers / parallel.last_stage_layers (Megatron's decoder_first_pipeline_num_layers /
  decoder_last_pipeline_num_layers) fix the first and the last pipeline rank's layers; the others share the rest
  evenly. With vpp > 1 every pipeline rank's layers are split evenly over its vpp chunks.

Virtual stage k = chunk c of pipeline rank r with k = c x pp + r (the interleaved order of training/model/gpt.py);
layer ids are consecutive along k, so a layer's global id (and so its checkpoint key) does not depend on the split:
checkpoints move between splits and pp degrees as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.contract.config import Config
from training.contract.violation import Violation

SPLIT_KEYS = ("first_stage_layers", "last_stage_layers", "embedding_in_split", "loss_in_split")
"""The parallel.* keys that shape the split (besides pp and vpp)."""
NO_SPLIT = {"first_stage_layers": 0, "last_stage_layers": 0, "embedding_in_split": False, "loss_in_split": False}
"""The split keys of the even split."""


@dataclass(frozen=True)
class StageSplit:
    """The layers of every virtual stage of one layout (build with `stage_split` or `StageSplit.of`)."""

    num_layers: int
    """Transformer layers of the model."""
    pp: int
    """Pipeline ranks."""
    vpp: int
    """Model chunks per pipeline rank (1 without the interleaved schedule)."""
    first_stage_layers: int = 0
    """Layers of pipeline rank 0 (0: not fixed)."""
    last_stage_layers: int = 0
    """Layers of the last pipeline rank (0: not fixed)."""
    embedding_in_split: bool = False
    """The embedding counts as one layer of the even division."""
    loss_in_split: bool = False
    """The output layer with the loss counts as one layer of the even division."""

    @property
    def uneven(self) -> bool:
        """Whether the first or the last pipeline rank's layers are fixed by the user."""
        return bool(self.first_stage_layers or self.last_stage_layers)

    def rank_layers(self) -> list[int] | None:
        """Layers per pipeline rank, or None when the split cannot be made (`split_rules` says why)."""
        L, p, v = self.num_layers, self.pp, self.vpp
        if p < 1 or v < 1 or L < 1:
            return None
        if self.uneven:
            if p < 2 or self.embedding_in_split or self.loss_in_split:
                return None
            first, last = self.first_stage_layers, self.last_stage_layers
            if first < 0 or last < 0:
                return None
            middle = p - bool(first) - bool(last)
            rest = L - first - last
            if rest < 0 or (middle == 0 and rest) or (middle and (rest == 0 or rest % middle)):
                return None
            per = rest // middle if middle else 0
            out = [per] * p
            if first:
                out[0] = first
            if last:
                out[-1] = last
            if any(n % v or n < v for n in out):
                return None
            return out
        n = L + int(self.embedding_in_split) + int(self.loss_in_split)
        if n % (p * v):
            return None
        counts = self.counts()
        if counts is None:
            return None
        return [sum(counts[c * p + r] for c in range(v)) for r in range(p)]

    def counts(self) -> list[int] | None:
        """Layers per virtual stage (index c x pp + r), or None when the split cannot be made."""
        L, p, v = self.num_layers, self.pp, self.vpp
        if self.uneven:
            ranks = self.rank_layers()
            if ranks is None:
                return None
            return [ranks[k % p] // v for k in range(p * v)]
        e, lo = int(self.embedding_in_split), int(self.loss_in_split)
        n = L + e + lo
        if p < 1 or v < 1 or L < 1 or n % (p * v):
            return None
        per = n // (p * v)
        out = [per] * (p * v)
        out[0] -= e
        out[-1] -= lo
        if min(out) < 0 or (p * v > 1 and per == 0):
            return None
        return out

    def layer_ids(self, pp_rank: int) -> list[list[int]]:
        """Global layer ids of pipeline rank `pp_rank`'s chunks, chunk 0 first (raises when no split exists)."""
        counts = self.counts()
        if counts is None:
            raise ValueError("; ".join(f"{x.key}: {x.message} (fix: {x.fix})" for x in split_rules(self)))
        starts = [sum(counts[:k]) for k in range(len(counts))]
        return [
            list(range(starts[c * self.pp + pp_rank], starts[c * self.pp + pp_rank] + counts[c * self.pp + pp_rank]))
            for c in range(self.vpp)
        ]

    def max_chunk_layers(self) -> int:
        """The most layers any virtual stage holds (0 when no split exists)."""
        counts = self.counts()
        return max(counts) if counts else 0

    @classmethod
    def of(cls, cfg: Config) -> StageSplit:
        """The split of a config (vpp counts only with the interleaved schedule and pp > 1)."""
        par = cfg.parallel
        v = par.vpp if str(par.schedule) == "interleaved_1f1b" and par.pp > 1 else 1
        return cls(
            cfg.model.num_layers,
            par.pp,
            v,
            int(getattr(par, "first_stage_layers", 0) or 0),
            int(getattr(par, "last_stage_layers", 0) or 0),
            bool(getattr(par, "embedding_in_split", False)),
            bool(getattr(par, "loss_in_split", False)),
        )


def stage_split(cfg: Config) -> StageSplit:
    """The layout's split of the layers over its virtual stages."""
    return StageSplit.of(cfg)


def _error(key: str, message: str, fix: str) -> Violation:
    return Violation("error", key, message, fix, "layers")


def _even_fixes(s: StageSplit) -> list[str]:
    """Commands that make an even split of s's layers possible without changing pp."""
    L, p, v = s.num_layers, s.pp, s.vpp
    out = []
    pv = p * v
    # first/last exclude embedding/loss_in_split: a suggestion of them turns those off
    off = (
        "parallel.embedding_in_split=false parallel.loss_in_split=false "
        if s.embedding_in_split or s.loss_in_split
        else ""
    )
    if not (s.embedding_in_split or s.loss_in_split):
        if (L + 1) % pv == 0 and (L + 1) // pv >= 1:
            out.append(f"parallel.embedding_in_split=true (makes {L} + 1 divisible by {pv})")
        if (L + 2) % pv == 0 and (L + 2) // pv >= 1:
            out.append(
                f"parallel.embedding_in_split=true parallel.loss_in_split=true (makes {L} + 2 divisible by {pv})"
            )
    if p > 2:
        # first = last = k: the middle ranks share L - 2k, each a multiple of vpp; k the closest to the even share
        target = L / p
        cands = [
            k
            for k in range(v, L, v)
            if L - 2 * k > 0 and (L - 2 * k) % ((p - 2) * v) == 0 and (L - 2 * k) // (p - 2) >= v
        ]
        if cands:
            k = min(cands, key=lambda c: (abs(c - target), -c))
            out.append(f"{off}parallel.first_stage_layers={k} parallel.last_stage_layers={k}")
    elif p == 2 and L >= 2 * v:
        k = (L // 2) // v * v
        if k >= v and (L - k) % v == 0 and L - k >= v:
            out.append(f"{off}parallel.first_stage_layers={k}")
    return out


def split_rules(s: StageSplit) -> list[Violation]:
    """Why s's layers cannot be divided over its virtual stages, each with a fix a user can type (empty: they can)."""
    L, p, v = s.num_layers, s.pp, s.vpp
    if L < 1 or p < 1 or v < 1:
        return []  # model_rules and the degree rules report these
    if s.uneven:
        if s.embedding_in_split or s.loss_in_split:
            return [
                _error(
                    "parallel.first_stage_layers",
                    "first_stage_layers/last_stage_layers and embedding_in_split/loss_in_split are two ways to split"
                    " the layers; use one",
                    "parallel.embedding_in_split=false parallel.loss_in_split=false",
                )
            ]
        if s.first_stage_layers < 0 or s.last_stage_layers < 0:
            return [
                _error(
                    "parallel.first_stage_layers",
                    "first_stage_layers and last_stage_layers count layers (>= 0; 0 = even)",
                    "parallel.first_stage_layers=0 parallel.last_stage_layers=0",
                )
            ]
        if p < 2:
            return [
                _error(
                    "parallel.first_stage_layers",
                    f"first_stage_layers/last_stage_layers need pp > 1 (pp={p})",
                    "parallel.first_stage_layers=0 parallel.last_stage_layers=0",
                )
            ]
        if s.rank_layers() is None:
            first, last = s.first_stage_layers, s.last_stage_layers
            middle = p - bool(first) - bool(last)
            rest = L - first - last
            what = (
                f"the other {middle} pipeline ranks share {rest} layers"
                if middle
                else f"first + last = {first + last} layers where the model has {L}"
            )
            need = f"; each rank's layers must be a positive multiple of vpp={v}" if v > 1 else ""
            fixes = _even_fixes(StageSplit(L, p, v))
            return [
                _error(
                    "parallel.first_stage_layers",
                    f"num_layers={L} at pp={p} with first_stage_layers={first}, last_stage_layers={last}: {what},"
                    f" which cannot be split evenly{need}",
                    " or ".join(fixes) if fixes else "parallel.first_stage_layers=0 parallel.last_stage_layers=0",
                )
            ]
        return []
    e, lo = int(s.embedding_in_split), int(s.loss_in_split)
    n = L + e + lo
    if p > n:
        return [
            _error(
                "parallel.pp",
                f"pp={p} is larger than num_layers={L}"
                + (f" (+{e + lo} counted for embedding/loss)" if e + lo else ""),
                f"parallel.pp=<one of {[d for d in range(1, n + 1) if n % d == 0]}>",
            )
        ]
    if s.counts() is None:
        counted = f"{L} + {e + lo} = {n}" if e + lo else f"{L}"
        pp_fixes = [d for d in range(1, n + 1) if n % d == 0 and (n // d) % v == 0]
        fixes = _even_fixes(s) + [f"parallel.pp=<one of {pp_fixes}>"]
        vs = [d // p for d in range(p, n + 1, p) if n % d == 0]
        if v > 1 and vs:
            fixes.append(f"parallel.vpp=<one of {vs}>")
        return [
            _error(
                "parallel.pp",
                f"num_layers={counted} is not divisible by pp x vpp = {p} x {v} = {p * v}",
                " or ".join(fixes),
            )
        ]
    return []


def split_options(num_layers: int, pp: int, vpp: int, limit: int = 2) -> list[dict]:
    """The split keys a layout search tries at pp x vpp (action=recommend, parallel=auto): [{}] when the even split
    works; else up to `limit` distinct splits that do, lightest first and last ranks preferred (they also hold the
    embedding and the output layer): embedding_in_split (+ loss_in_split), then first = last = k (pp > 2) or
    first = k (pp = 2), k the largest multiple of vpp at most the other ranks' share. [] when none works."""
    L, p, v = num_layers, pp, vpp
    if StageSplit(L, p, v).counts() is not None:
        return [{}]
    tries: list[dict] = [
        {"embedding_in_split": True, "loss_in_split": True},
        {"embedding_in_split": True},
    ]
    if p > 2:
        ks = [k for k in range(v, L // p + 1, v) if (L - 2 * k) % ((p - 2) * v) == 0 and (L - 2 * k) // (p - 2) >= k]
        if ks:
            tries.append({"first_stage_layers": max(ks), "last_stage_layers": max(ks)})
    elif p == 2:
        ks = [k for k in range(v, L // 2 + 1, v) if (L - k) % v == 0]
        if ks:
            tries.append({"first_stage_layers": max(ks)})
    out: list[dict] = []
    seen = set()
    for keys in tries:
        counts = StageSplit(L, p, v, **keys).counts()
        if counts is None or (p * v > 1 and min(counts) < 1) or tuple(counts) in seen:
            continue
        seen.add(tuple(counts))
        out.append(keys)
    return out[:limit]
