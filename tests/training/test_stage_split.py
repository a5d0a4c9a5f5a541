"""training/contract/stage_split.py: Megatron's two ways of dividing the layers over pipeline stages, checked against
the layer offsets Megatron-Core's get_transformer_layer_offset / get_num_layers_to_build give (worked out by hand
below from their definitions), and the refusals with a fix a user can type."""

from __future__ import annotations

import pytest

from training.contract.stage_split import StageSplit, split_rules


def _megatron_counts(L, p, v, first=None, last=None, emb=False, loss=False):
    """Layers of every virtual stage (index c * p + r) from Megatron's definitions, independently of StageSplit."""
    out = {}
    for r in range(p):
        if first is not None or last is not None:
            rest, left = L, p
            if first is not None:
                rest, left = rest - first, left - 1
            if last is not None:
                rest, left = rest - last, left - 1
            per_rank = rest // left if left else 0
            if first is not None and r == 0:
                per_rank = first
            if last is not None and r == p - 1:
                per_rank = last
        else:
            per_rank = (L + emb + loss) // p
        for c in range(v):
            n = per_rank // v
            if not (first is not None or last is not None):
                if emb and r == 0 and c == 0:
                    n -= 1
                if loss and r == p - 1 and c == v - 1:
                    n -= 1
            out[c * p + r] = n
    return [out[k] for k in range(p * v)]


CASES = [
    (126, 16, 1, None, None, True, True),  # Llama 3 405B at pp16
    (126, 16, 1, 7, 7, False, False),
    (126, 16, 2, 6, 8, False, False),
    (126, 8, 2, None, None, True, True),  # 128 / 16 = 8 a chunk, 7 in the first and the last
    (11, 4, 1, None, None, True, False),
    (10, 4, 1, 1, 3, False, False),
    (10, 4, 1, 3, 3, False, False),  # the first and last ranks may also carry more
    (6, 2, 1, 2, None, False, False),
    (6, 2, 1, None, 4, False, False),
    (12, 2, 2, 4, 8, False, False),
    (8, 2, 2, None, None, False, False),
]


@pytest.mark.parametrize("L,p,v,first,last,emb,loss", CASES)
def test_counts_and_ids_follow_megatrons_definitions(L, p, v, first, last, emb, loss):
    s = StageSplit(L, p, v, first or 0, last or 0, emb, loss)
    assert not split_rules(s)
    counts = s.counts()
    assert counts == _megatron_counts(L, p, v, first, last, emb, loss)
    ids = [s.layer_ids(r) for r in range(p)]
    # every layer exactly once, consecutive along the virtual stages (chunk c of rank r is stage c * p + r)
    along = [ids[k % p][k // p] for k in range(p * v)]
    assert [i for chunk in along for i in chunk] == list(range(L))
    assert [len(chunk) for chunk in along] == counts
    assert s.max_chunk_layers() == max(counts)


def test_the_even_split_is_todays():
    assert [StageSplit(8, 2, 2).layer_ids(r) for r in (0, 1)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert StageSplit(8, 1, 1).layer_ids(0) == [list(range(8))]


def test_126_layers_at_pp16_are_refused_with_the_fixes_that_work():
    (v,) = split_rules(StageSplit(126, 16, 1))
    assert "num_layers=126 is not divisible by pp x vpp = 16 x 1 = 16" in v.message
    assert "parallel.embedding_in_split=true parallel.loss_in_split=true (makes 126 + 2 divisible by 16)" in v.fix
    assert "parallel.first_stage_layers=7 parallel.last_stage_layers=7" in v.fix
    # each suggested fix, applied, is a valid split
    assert not split_rules(StageSplit(126, 16, 1, embedding_in_split=True, loss_in_split=True))
    assert not split_rules(StageSplit(126, 16, 1, 7, 7))


@pytest.mark.parametrize(
    "split,words",
    [
        (StageSplit(11, 4, 1, 3, 3), "share 5 layers, which cannot be split evenly"),
        (StageSplit(12, 2, 2, 3, 0), "positive multiple of vpp=2"),
        (StageSplit(6, 2, 1, 3, 4), "first + last = 7 layers where the model has 6"),
        (StageSplit(8, 1, 1, 2, 0), "need pp > 1"),
        (StageSplit(8, 4, 1, 2, 2, embedding_in_split=True), "use one"),
        (StageSplit(3, 8, 1), "pp=8 is larger than num_layers=3"),
    ],
)
def test_refusals_name_the_problem_and_a_typeable_fix(split, words):
    (v,) = split_rules(split)
    assert words in v.message
    assert v.fix.startswith("parallel.")
    with pytest.raises(ValueError, match="fix: parallel."):
        split.layer_ids(0)
