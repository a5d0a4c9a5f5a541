"""The README is a newcomer's guide (at most 250 lines, `make run` and `make test`, no lab-notebook timestamps), its
planning commands run as printed, every relative link of README.md, CONTRIBUTING.md and docs/GUIDE.md leads to a
file (and a heading) that exists, and the guide's 13B table is what the planner computes."""

from __future__ import annotations

import os
import re
import shlex
from typing import List

import pytest

from helpers import ROOT
from helpers.cli import run_cli

README = os.path.join(ROOT, "README.md")
GUIDE = os.path.join(ROOT, "docs", "GUIDE.md")
CONTRIBUTING = os.path.join(ROOT, "CONTRIBUTING.md")


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _bash_commands(text: str) -> List[str]:
    """The command lines of the ```bash blocks, continuation lines joined and comments dropped."""
    cmds: List[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def test_readme_is_a_short_guide_with_the_two_commands():
    text = _text(README)
    assert len(text.splitlines()) <= 250
    cmds = _bash_commands(text)
    assert "make run" in cmds and "make test" in cmds  # CI (.ci/run) runs the README's test command
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\d\d:\d\d UTC", text), "timestamps belong in git, not the README"
    for heading in ("## Install", "## The two commands", "## A first job on a GPU cluster", "## A first sweep"):
        assert heading in text
    assert "| feature |" in text


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", [README, CONTRIBUTING, GUIDE])
def test_relative_links_lead_somewhere(doc):
    text = _text(doc)
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        assert os.path.exists(full), f"{doc}: link {target} leads nowhere"
        if anchor:
            slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", _text(full), flags=re.M)}
            assert anchor in slugs, f"{doc}: no heading for #{anchor} in {full}"


def _plan_commands() -> List[List[str]]:
    """The README's commands that only plan or print (cheap, nothing launched)."""
    out = []
    for cmd in _bash_commands(_text(README)):
        if not cmd.startswith("meshrun "):
            continue
        words = shlex.split(cmd)
        if "action=plan" in words or "action=keys" in words:
            out.append(words[1:])
    return out


def test_readme_plan_commands_run_as_printed(tmp_path):
    cmds = _plan_commands()
    assert len(cmds) >= 4  # the plans, the keys listing and the plan sweep
    assert any("-m" in c for c in cmds)
    for i, args in enumerate(cmds):
        where = os.path.join(str(tmp_path), str(i))
        os.makedirs(where)
        res = run_cli(*args, cwd=where)
        assert res.returncode == 0, f"meshrun {' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}"
        if "action=keys" in args:
            assert "parallel.tp" in res.stdout
        elif "-m" in args:
            assert "sweep.json" in " ".join(os.listdir(os.path.join(where, "multirun", "latest")))
        else:
            assert "fits" in res.stdout


def test_guide_13b_table_is_the_planners():
    """docs/GUIDE.md's ZeRO table (moved from the README) against make_plan of the same configuration."""
    from launcher.plan.estimate import make_plan
    from training.contract.config import Config

    def plan(zero: int):
        cfg = Config()
        m = cfg.model
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 40, 5120, 40, 2048, 50257
        cfg.cluster.device, cfg.cluster.gpus_per_node, cfg.cluster.gpu_memory_gb = "cuda", 8, 80
        cfg.train.precision = "fp16"
        p = cfg.parallel
        p.tp, p.pp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, 1, False, zero, 2, 64
        return make_plan(cfg)

    cells = [[c.strip() for c in line.split("|")] for line in _text(GUIDE).splitlines() if line.startswith("| zero=")]
    rows = {r[1]: r for r in cells}  # | setting | weights | grads | optimizer | activations | other | total | ...
    for zero in (1, 2, 3):
        total = round(plan(zero).memory_bytes["total"] / 2**30, 2)
        assert rows[f"zero={zero}"][7] == f"{total:.2f}"
