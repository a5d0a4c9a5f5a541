"""The command line as a new user meets it: --help, action=keys, choice fields rejected by the schema,
precision=auto, nothing left behind by a rejected plan or a mistyped status query, and resuming a run
with no overrides (its saved configuration, the new overrides on top, a changed layout reported)."""

from __future__ import annotations

import dataclasses
import json
import typing

from helpers.cli import meshrun

from launcher.cli.actions import action_doc
from launcher.cli.keys import field_docstrings, iter_keys
from launcher.cli.options import SCHEMA_MODULES, AppConfig
from training.contract.config import CHOICE_FIELDS, Action


def _leaf_keys(cls=AppConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _leaf_owners(cls=AppConfig, prefix=""):
    """key -> (dataclass name, field name), walking the dataclasses (not launcher/cli/keys.py)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_leaf_owners(hints[f.name], f"{prefix}{f.name}."))
        else:
            # The class that declares it: AppConfig inherits Config's fields.
            owner = next(c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
            out[f"{prefix}{f.name}"] = (owner.__name__, f.name)
    return out


def _docstrings_from_source():
    """(class, field) -> the triple-quoted string right under the field's line in the schema's modules
    (training/contract/config.py, launcher/cli/options.py, ...), read as text line by line (an independent reading:
    launcher/cli/keys.py uses the ast)."""
    import importlib
    import re

    files = [importlib.import_module(name).__file__ for name in SCHEMA_MODULES]
    lines = [line for path in files for line in open(path, encoding="utf-8").read().splitlines()]
    docs, cls = {}, None
    for i, line in enumerate(lines):
        m = re.match(r"class (\w+)", line)
        if m:
            cls = m.group(1)
            continue
        m = re.match(r"    (\w+): [^=]+(=.*)?$", line)
        if not (m and cls and i + 1 < len(lines) and lines[i + 1].startswith('    """')):
            continue
        text, j = lines[i + 1].strip()[3:], i + 1
        while '"""' not in text:
            j += 1
            text += " " + lines[j].strip()
        docs[(cls, m.group(1))] = " ".join(text.split('"""')[0].split())
    # The action key's list of actions and their summaries is the action table's (launcher/cli/actions.py).
    docs[("Config", "action")] += " " + " ".join(action_doc().split())
    return docs


def test_help_names_actions_groups_and_where_keys_are_documented(tmp_path):
    p = meshrun("--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for action in (m.value for m in Action):  # every action the schema accepts is explained
        assert f"\n  {action} " in p.stdout, action
    # The groups with their presets, as Hydra finds them in the installed config tree.
    assert "model: " in p.stdout and "llama3_8b" in p.stdout and "parallel: " in p.stdout
    cluster_line = next(line for line in p.stdout.splitlines() if line.startswith("cluster: "))
    assert {"dgx_h100", "local", "slurm_dev"} <= set(cluster_line[len("cluster: ") :].split(", "))
    assert "action=keys" in p.stdout and "training/contract/config.py" in p.stdout
    assert list(tmp_path.iterdir()) == []  # --help writes nothing


def test_keys_prints_every_key_with_type_default_and_docstring(tmp_path):
    p = meshrun("action=keys", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    printed = [line.split(":", 1)[0] for line in p.stdout.splitlines() if line and not line.startswith((" ", "=="))]
    assert printed == _leaf_keys()  # every key, in declaration order, once
    docs = field_docstrings()
    # Every field of every config dataclass has a docstring (the user's documentation of that key).
    missing = [key for key, _, _, doc in iter_keys() if not doc]
    assert missing == [], missing
    # Each key's printed text is its docstring as written in training/contract/config.py (whitespace aside).
    blocks, key = {}, None
    for line in p.stdout.splitlines():
        if line.startswith("    ") and key:
            blocks[key] += " " + line.strip()
        elif line and not line.startswith("=="):
            key = line.split(":", 1)[0]
            blocks[key] = ""
    written, owners = _docstrings_from_source(), _leaf_owners()
    for key in printed:
        assert owners[key] in written, key
        assert " ".join(blocks[key].split()) == written[owners[key]] == " ".join(docs[owners[key]].split()), key
    assert "parallel.schedule: gpipe|1f1b|interleaved_1f1b|zb_h1 = 1f1b" in p.stdout
    assert "train.precision: auto|fp32|bf16|fp16|fp8 = auto" in p.stdout
    assert "model.num_query_groups: int or null = null" in p.stdout
    one = meshrun("action=keys", "keys.group=parallel", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    keys = [line.split(":", 1)[0] for line in one.stdout.splitlines() if line and not line.startswith((" ", "=="))]
    assert keys and all(k.startswith("parallel.") for k in keys)
    assert "presets: auto, default" in one.stdout  # sorted: parallel=auto (the cuda presets' default) first
    bad = meshrun("action=keys", "keys.group=paralel", cwd=tmp_path)
    assert bad.returncode == 2 and "not a config group" in bad.stderr


def test_choice_fields_are_rejected_by_the_schema(tmp_path):
    for key in (
        "model.norm",
        "parallel.schedule",
        "parallel.recompute",
        "train.precision",
        "cluster.kind",
        "data.kind",
    ):
        assert key in CHOICE_FIELDS
        p = meshrun("action=plan", f"{key}=nonsense", f"run.dir={tmp_path / 'r'}", cwd=tmp_path)
        assert p.returncode == 2, (key, p.stderr)
        allowed = ", ".join(m.value for m in CHOICE_FIELDS[key])
        assert f"expected one of [{allowed}]" in p.stderr, (key, p.stderr)
    assert not (tmp_path / "r").exists()


def test_precision_auto_is_bf16_on_gpus_and_fp32_on_cpu(tmp_path):
    gpu = meshrun(
        "action=plan",
        "model=llama3_8b",
        "cluster=dgx_h100",
        "parallel=tp8",
        "cluster.nodes=1",
        f"run.dir={tmp_path / 'gpu'}",
        cwd=tmp_path,
    )
    assert gpu.returncode == 0, gpu.stderr
    assert json.loads((tmp_path / "gpu" / "config.json").read_text())["train"]["precision"] == "bf16"
    plan = json.loads((tmp_path / "gpu" / "plan.json").read_text())
    # bf16 weights: 2 bytes per parameter held by the GPU.
    assert plan["memory_bytes"]["weights"] == 2 * plan["params_per_gpu"]
    cpu = meshrun("action=plan", f"run.dir={tmp_path / 'cpu'}", cwd=tmp_path)
    assert cpu.returncode == 0, cpu.stderr
    assert json.loads((tmp_path / "cpu" / "config.json").read_text())["train"]["precision"] == "fp32"
    explicit = meshrun(
        "action=plan",
        "model=llama3_8b",
        "cluster=dgx_h100",
        "train.precision=fp16",
        "parallel=tp8",
        "cluster.nodes=1",
        f"run.dir={tmp_path / 'fp16'}",
        cwd=tmp_path,
    )
    assert explicit.returncode == 0, explicit.stderr
    assert json.loads((tmp_path / "fp16" / "config.json").read_text())["train"]["precision"] == "fp16"


def test_rejected_plan_and_mistyped_status_leave_no_directory(tmp_path):
    p = meshrun("action=plan", f"run.dir={tmp_path / 'bad'}", "parallel.tp=3", cwd=tmp_path)
    assert p.returncode == 2
    s = meshrun("action=status", f"run.dir={tmp_path / 'typo'}", cwd=tmp_path)
    assert s.returncode == 2 and "not a meshrun run directory" in s.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == []  # not even Hydra's log


def test_starting_again_reuses_the_saved_configuration(tmp_path):
    run = tmp_path / "run"
    first = meshrun(
        "action=plan", f"run.dir={run}", "parallel=tp2", "train.steps=7", "model.num_layers=2", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    saved = json.loads((run / "config.json").read_text())
    again = meshrun("action=plan", f"run.dir={run}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "with its saved configuration (no changes)" in again.stderr
    assert json.loads((run / "config.json").read_text()) == saved
    # An override applies on top of the saved run; a changed layout is reported as a reshard.
    moved = meshrun(
        "action=plan", f"run.dir={run}", "parallel.tp=1", "parallel.sp=false", "cluster.gpus_per_node=2", cwd=tmp_path
    )
    assert moved.returncode == 0, moved.stderr
    assert "changed now: cluster.gpus_per_node, parallel.sp, parallel.tp" in moved.stderr
    assert "the checkpoint is resharded on load" in moved.stderr
    # action=plan on an existing run shows the merged plan and writes nothing (issue 22: a plan never changes a
    # run's config.json); the merge is what the plan reports: tp1 dp2, steps and layers kept from the first launch.
    assert json.loads((run / "config.json").read_text()) == saved
    assert "world 2 = tp 1 x pp 1 x cp 1 x dp 2" in moved.stdout, moved.stdout
    # A preset choice replaces its whole group.
    preset = meshrun("action=plan", f"run.dir={run}", "model=gpt2_125m", "cluster.gpu_memory_gb=64", cwd=tmp_path)
    assert preset.returncode == 0, preset.stderr
    changed = preset.stderr.split("changed now: ")[1].split("\n")[0].split(", ")
    assert "model.name" in changed and "model.num_layers" in changed and "train.steps" not in changed, changed
    assert "(gpt2_125m," in preset.stdout
    assert json.loads((run / "config.json").read_text()) == saved
