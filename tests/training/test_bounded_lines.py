"""Issue 46, the hostile audit's leftovers: readers of events.jsonl and metrics.jsonl never hold a huge line
(training/contract/rundir/lines.py: a line beyond MAX_LINE_BYTES is skipped in bounded pieces, with one note on
stderr), and the counts the audit found unbounded (cluster.max_in_job_restarts at 10^9, cluster.max_retries,
model.moe_top_k, model.moe_ffn_hidden_size) are refused with exit 2 and the bound as the fix
(training/contract/limits.py)."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest

from training.contract.rundir.lines import MAX_LINE_BYTES, bounded_lines

HUGE = 4 * MAX_LINE_BYTES  # 64 MiB on one line


def test_a_line_over_the_cap_is_skipped_and_said_once(capsys):
    data = b'{"a": 1}\n' + b"x" * 100 + b"\n" + b'{"b": 2}\n' + b"y" * 50 + b"\n" + b'{"c": 3}'
    got = list(bounded_lines(io.BytesIO(data), max_bytes=40, name="events.jsonl"))
    assert got == [b'{"a": 1}\n', b'{"b": 2}\n', b'{"c": 3}']  # the last one without its newline (torn) too
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipped 2 line(s)" in err and "events.jsonl" in err, err
    # A line exactly at the cap is kept: the bound is on the line, not its newline.
    assert list(bounded_lines(io.BytesIO(b"z" * 40 + b"\nq"), max_bytes=40)) == [b"z" * 40 + b"\n", b"q"]
    assert capsys.readouterr().err == ""


def _huge_run(tmp_path, terminated: bool):
    run = tmp_path / "run"
    run.mkdir()
    event = {"event": "started", "time": 1.0, "attempt": 0, "job_id": "local"}
    row = {"step": 1, "loss": 5.0, "time": 1.0, "attempt": 0}
    for name, rec in (("events.jsonl", event), ("metrics.jsonl", row)):
        with open(run / name, "wb") as f:
            f.write(json.dumps(rec).encode() + b"\n")
            f.write(b'{"event": "x", "pad": "' + b"a" * HUGE)  # a damaged or hostile line
            if terminated:
                f.write(b'"}\n' + json.dumps({**rec, "step": 2, "event": rec.get("event")}).encode() + b"\n")
    return run


@pytest.mark.parametrize("terminated", [True, False], ids=["line_then_more", "file_ends_in_it"])
def test_readers_hold_no_huge_line(tmp_path, capsys, terminated):
    from launcher.manage.report import read_jsonl
    from training.contract.rundir.events import read_events
    from training.contract.rundir.metrics import read_rows

    run = _huge_run(tmp_path, terminated)
    tracemalloc.start()
    try:
        events = read_events(str(run))
        rows = read_rows(str(run))
        report_events = read_jsonl(str(run / "events.jsonl"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Read whole, the 64 MiB line alone would be the peak (twice over as text); bounded: about one cap's worth.
    assert peak < 2 * MAX_LINE_BYTES + (4 << 20), peak
    kept = 2 if terminated else 1
    assert len(events) == len(report_events) == kept and events[0]["event"] == "started"
    assert len(rows) == kept and rows[0]["step"] == 1
    err = capsys.readouterr().err
    assert "skipped 1 line(s) longer than 16 MiB in events.jsonl" in err and "metrics.jsonl" in err, err


def test_status_of_a_run_with_a_huge_line(tmp_path):
    from helpers.cli import run_cli

    run = _huge_run(tmp_path, True)
    res = run_cli("action=status", f"run.dir={run}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["last_step"] == 2 and "skipped 1 line(s)" in res.stderr


@pytest.mark.parametrize(
    "override, key, most",
    [
        ("cluster.max_in_job_restarts=1000000000", "cluster.max_in_job_restarts", 1024),
        ("cluster.max_retries=1000000000", "cluster.max_retries", 4096),
        ("model.moe_top_k=1000000000", "model.moe_top_k", 1 << 16),
        ("model.moe_ffn_hidden_size=1000000000", "model.moe_ffn_hidden_size", 1 << 22),
    ],
)
def test_restart_retry_and_moe_counts_are_bounded(tmp_path, override, key, most):
    from helpers.cli import run_cli

    res = run_cli(
        "action=plan", "model=tiny_moe", "data=synthetic", "cluster=slurm_dev", override, f"run.dir={tmp_path / 'r'}"
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"error: {key}: is implausibly large (1000000000; at most {most})" in res.stderr, res.stderr[-2000:]
    assert f"fix: {key}={most}" in res.stderr
    # The bound itself is accepted (no size error for the key).
    from helpers.cli import compose_cfg

    from launcher.plan.validate import validate

    cfg = compose_cfg("model=tiny_moe", "data=synthetic", "cluster=slurm_dev", f"{key}={most}")
    assert not [i for i in validate(cfg).issues if i.key == key and i.code == "size"]


def test_a_hf_mixtral_config_with_a_huge_top_k_is_refused(tmp_path):
    from training.hf.hf_config import HFError, model_fields_from_hf

    hf = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 10**9,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    with pytest.raises(HFError, match=r"model\.moe_top_k, which is implausibly large"):
        model_fields_from_hf(hf, str(tmp_path / "config.json"))
