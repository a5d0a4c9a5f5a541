"""The schema split by reader: the command line composes AppConfig (launcher/cli/options.py), the ranks read Config
(training/contract/config.py) from config.json, which holds no command-line option group; values the launcher
resolves sit under `resolved`; and a run whose config.json an earlier version wrote (the option groups inside,
train.checkpoint_every_min_resolved, the retired test knobs) still resumes."""

from __future__ import annotations

import dataclasses
import json

from helpers.cli import meshrun

from launcher.cli.options import OPTION_GROUPS, AppConfig, with_options
from training.contract.config import Config, checkpoint_minutes, config_from_dict, config_to_dict


def test_config_json_holds_the_ranks_config_only(tmp_path):
    run = tmp_path / "run"
    p = meshrun("action=plan", f"run.dir={run}", "logs.rank=1", "cancel.timeout_s=5", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    saved = json.loads((run / "config.json").read_text())
    assert set(saved) == {f.name for f in dataclasses.fields(Config)}
    assert not set(saved) & set(OPTION_GROUPS)
    assert "checkpoint_every_min_resolved" not in saved["train"] and "checkpoint_every_min" in saved["resolved"]
    assert set(OPTION_GROUPS) == {f.name for f in dataclasses.fields(AppConfig)} - set(saved)
    # Every rank rebuilds it as it is.
    assert config_to_dict(config_from_dict(saved)) == saved


def test_an_app_config_gives_its_config_part_and_takes_its_options_back():
    app = AppConfig()
    app.logs.rank = 3
    plain = config_to_dict(app)
    assert not set(plain) & set(OPTION_GROUPS)
    job = config_from_dict(plain)
    assert type(job) is Config
    again = with_options(job, app)
    assert isinstance(again, AppConfig) and again.logs.rank == 3 and config_to_dict(again) == plain


def _written_before(cfg: Config, minutes: float) -> dict:
    """config.json as launchers wrote it before the split: the option groups inside, the resolved minutes and the
    tests' knobs in train."""
    old = config_to_dict(cfg)
    del old["resolved"]
    old["train"].update(checkpoint_every_min_resolved=minutes, min_step_s=0.0, host_memory_keep=True)
    old.update(
        prepare={"inputs": [], "output": "data/stdlib"},
        keys={"group": ""},
        status={"format": "json"},
        runs={"dir": "runs"},
        logs={"rank": 0, "follow": False, "tail": 0},
        cancel={"timeout_s": 300.0},
    )
    return old


def test_a_config_json_written_before_still_loads_and_resumes(tmp_path):
    old = _written_before(Config(), 12.5)
    cfg = config_from_dict(old)
    assert cfg.resolved.checkpoint_every_min == 12.5 and checkpoint_minutes(cfg) == 12.5
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(old))
    (run / "events.jsonl").write_text("")
    p = meshrun("action=plan", f"run.dir={run}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "with its saved configuration (no changes)" in p.stderr
    status = meshrun("action=status", f"run.dir={run}", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
