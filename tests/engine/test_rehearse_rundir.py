"""What a rehearsal leaves in run.dir: rehearsal.json beside the files that were there, nothing else. The engine's
save and resume run in a scratch copy of the run directory (training/rehearse/runner.py scratch_run_dir), so
events.jsonl gains no checkpoint or resumed event and no checkpoints/ directory appears: a rehearsed run's record
shows neither a save nor a resume that never happened."""

from __future__ import annotations

import json
import os

from helpers.cli import compose_cfg

from training.contract.exit_codes import EXIT_OK
from training.contract.rundir.events import append_event
from training.rehearse.main import rehearse

TINY_PP2 = (
    "cluster.device=cuda",
    "data=synthetic",
    "train.precision=bf16",
    "parallel.micro_batch=1",
    "model=tiny",
    "parallel.pp=2",
    "parallel.dp=1",
    "parallel.global_batch=4",
    "cluster.gpus_per_node=2",
)


def test_the_rehearsal_leaves_only_rehearsal_json(tmp_path):
    cfg = compose_cfg(*TINY_PP2)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg.run.dir = run_dir
    with open(os.path.join(run_dir, "plan.json"), "w") as f:
        json.dump({"memory_bytes": {}}, f)
    append_event(run_dir, "planned")  # a record that was there before stays as it was
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        before = f.read()
    doc, code = rehearse(cfg, run_dir, workers=1, quiet=True)
    assert code == EXIT_OK, doc["defects"]
    # the save and the resume ran (their calls are recorded) ...
    phases = {phase for r in doc["ranks"] for per_kind in r["collectives"].values() for phase in per_kind}
    assert {"save", "resume"} <= phases, phases
    # ... but nothing of them is in run.dir
    assert sorted(os.listdir(run_dir)) == ["events.jsonl", "plan.json", "rehearsal.json"]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        assert f.read() == before
