"""The one layout text (training/contract/layout_text.py): its forms say the same layout, and the overrides
form composes back to that layout."""

import pytest
from helpers.cli import compose_cfg

from launcher.plan.estimate import make_plan
from training.contract.layout_text import FORMS, format_layout, layout_of


def test_every_form_names_the_degrees_and_the_overrides_compose_back():
    cfg = compose_cfg(
        "action=plan",
        "cluster.gpus_per_node=8",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.zero=1",
        "parallel.micro_batch=1",
        "parallel.global_batch=8",
        "parallel.recompute=selective",
    )
    lay = layout_of(cfg)
    assert lay.world == 8 and lay.dp == 2
    assert format_layout(lay, "short") == "tp2 pp2 dp2 mb1 gb8 sp rc=selective z1"
    assert format_layout(lay, "column") == "tp2·pp2·dp2 vpp1 sp"
    plan = make_plan(cfg)
    assert format_layout(lay, "world") == f"world {plan.world_size} = tp 2 x pp 2 x cp 1 x dp 2"
    again = compose_cfg(
        "action=plan", "cluster.gpus_per_node=8", "parallel.global_batch=8", *format_layout(lay, "overrides").split()
    )
    assert layout_of(again) == lay
    with pytest.raises(ValueError, match="one of short"):
        format_layout(lay, "yaml")
    assert len(FORMS) == 4
