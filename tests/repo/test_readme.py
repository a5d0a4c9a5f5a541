"""The README is a newcomer's guide (at most 250 lines, `make run` and `make test`, no lab-notebook timestamps), its
planning commands run as printed, every relative link of README.md, CONTRIBUTING.md and docs/GUIDE.md leads to a
file (and a heading) that exists, and the guide's 13B table is what the planner computes."""

from __future__ import annotations

import os
import re
import shlex

import pytest
from helpers import ROOT
from helpers.cli import run_cli

README = os.path.join(ROOT, "README.md")
GUIDE = os.path.join(ROOT, "docs", "GUIDE.md")
CONTRIBUTING = os.path.join(ROOT, "CONTRIBUTING.md")


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _bash_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks, continuation lines joined and comments dropped."""
    cmds: list[str] = []
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


CHEAP_ACTIONS = ("action=plan", "action=keys", "action=recommend")
"""Commands that only validate, plan or print: the docs' copies run as printed (in this process)."""
NOT_RUN = (
    # (a word of the command, why it is not run here, where it is tested)
    ("action=prepare", "reads a corpus of the reader's own; tests/launcher/data/test_prepare.py runs prepare"),
    ("action=export", "needs a trained run; tests/launcher/hf/test_hf_interop.py exports"),
    ("action=generate", "needs a trained run; tests/launcher/hf/test_hf_interop.py generates"),
    ("action=status", "needs the reader's run; tests/launcher/cli/test_cli_first_use.py and the status tests"),
    ("action=logs", "needs the reader's run; the logs tests"),
    ("action=cancel", "needs a running run; tests/launcher/manage/test_cancel_forced.py"),
    ("action=report", "needs a trained run; tests/launcher/manage/test_report.py"),
    ("action=preflight", "probes this machine's hardware; tests/launcher/launch/test_preflight_local.py"),
    ("cluster=slurm_dev", "submits to the dev Slurm cluster; tests/slurm/"),
    ("wait=true", "submits to a cluster"),
    ("cluster.job_name=llama8b-first", "submits to a cluster (its dry run is run here)"),
    ("...", "a sketch with the reader's own keys"),
    ("--help", "Hydra's help; tests/launcher/cli/test_cli_fast.py"),
)
"""Training, submitting and run-reading commands are not run by this test: training even the tiny model costs
seconds of two shared cores per command and starts rank processes (tests/engine/ and tests/launcher/cli/test_cli.py run
the same launches); each kind names the test that covers it."""


def _doc_commands(path: str, home: str) -> list[tuple[list[str], list[str]]]:
    """The meshrun commands of a doc's ```bash blocks as argv lists (a `J="..."` variable expanded, `~` and the
    guide's /home/me as `home`), each with the `#   ` output lines printed under it. Files the block writes with
    `cat > FILE <<'YAML'` are written under `home`."""
    text = _text(path)
    out: list[tuple[list[str], list[str]]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for name, body in re.findall(r"cat > (\S+) <<'YAML'\n(.*?)\nYAML\n", block, flags=re.S):
            target = name.replace("~", home)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w", encoding="utf-8") as f:
                f.write(body + "\n")
        block = re.sub(r"cat > \S+ <<'YAML'\n.*?\nYAML\n", "", block, flags=re.S)
        variables = {k: " ".join(v.split()) for k, v in re.findall(r'^(\w+)="(.*?)"', block, flags=re.S | re.M)}
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if line.startswith("#   ") and out:
                out[-1][1].append(line)
                continue
            line = line.split(" #")[0].strip()
            if not line.startswith("meshrun"):
                continue
            for k, v in variables.items():
                line = line.replace(f"${k}", v)
            line = line.replace("~", home).replace("/home/me", home)
            out.append((shlex.split(line)[1:], []))
    return out


def _why_not_run(args: list[str]) -> str | None:
    """None for a command this test runs; otherwise why not (and where it is tested)."""
    if args == ["--version"] or args == ["action=runs"] or "dry_run=true" in args and "cluster=slurm_dev" not in args:
        return None
    if any(a in CHEAP_ACTIONS for a in args):
        return None
    for word, why in NOT_RUN:
        if word in args:
            return why
    if "action=train" in args or not any(a.startswith("action=") for a in args):
        return "trains (rank processes): tests/engine/ and tests/launcher/cli/test_cli.py run training launches"
    return "unclassified"


def test_docs_commands_run_as_printed(tmp_path):
    """Every plan, keys, recommend, dry-run, --version and action=runs command of README.md and docs/GUIDE.md runs
    as printed and exits 0; the sizes a guide prints under a command (`#   ... 49.94 GiB ...`) are the ones it
    prints now. Every other meshrun command of the docs is of a kind named in NOT_RUN (with the test that covers
    it), so a new kind of command in the docs fails here until it is run or classified."""
    home = str(tmp_path / "home")
    cmds = _doc_commands(README, home) + _doc_commands(GUIDE, home)
    seen = set()
    ran = []
    for args, printed in cmds:
        why = _why_not_run(args)
        assert why != "unclassified", f"meshrun {' '.join(args)}: run it in this test or add its kind to NOT_RUN"
        if why is not None or tuple(args) in seen:
            continue
        seen.add(tuple(args))
        where = os.path.join(str(tmp_path), str(len(ran)))
        os.makedirs(where)
        res = run_cli(*args, cwd=where)
        ran.append(args)
        assert res.returncode == 0, f"meshrun {' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}"
        if "action=keys" in args:
            assert "parallel.tp" in res.stdout
        elif "-m" in args:
            assert "sweep.json" in " ".join(os.listdir(os.path.join(where, "multirun", "latest")))
        elif "action=plan" in args:
            assert "fits" in res.stdout
        elif args == ["--version"]:
            assert res.stdout.startswith("meshrun ")
        for line in printed:  # the guide's excerpt of the output: its sizes are today's
            for figure in re.findall(r"\d+\.\d+ G?i?B\b", line):
                assert figure in res.stdout, f"meshrun {' '.join(args)}: the doc prints {figure}, meshrun does not"
    assert len(ran) >= 10
    assert any("-m" in c for c in ran) and any("action=recommend" in c for c in ran)
    assert any("model=mixtral_8x7b" in c and "parallel.dp=null" in c for c in ran)  # a null pin is no pin


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
