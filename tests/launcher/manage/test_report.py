"""`meshrun action=report`: PNG plots and a self-contained report.html of a real run (stopped and resumed, so
it has two attempts and checkpoints) and of a sweep, rendered in a real headless browser (Debian's chromium,
installed by tests/browser.sh, which `make test` runs): every image must decode (naturalWidth > 0).

The run trains once for the module (two CLI launches) and its report is made once by a real `meshrun` process
(the smoke test of the command's boundary: its JSON on stdout, the page on disk); the tests read that output.
The sweep and the refusal run the same command in this process (tests/helpers/cli.py)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess

import pytest
from helpers import ROOT
from helpers.cli import run_cli
from helpers.local_run import PYTHON, TINY_RUN

from launcher.manage.report import build_report, sweep_points
from training.contract.rundir.events import append_event

TINY = [
    *TINY_RUN,
    "train.steps=12",
    "train.checkpoint_every=4",
    "train.eval_every=4",
    "train.warmup_steps=2",
]
RUN_PLOTS = {
    "loss",
    "lr",
    "tokens_per_s",
    "mfu",
    "step_times",
    "memory",
    "goodput",
}  # goodput: launcher/records/goodput.py


def rows_of(path: str) -> list:
    """The JSON lines of a file as the test reads them itself (no helper of launcher/manage/report.py)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_per_step(rows: list) -> dict:
    """step -> the row written last for it (a resumed attempt rewrites steps newer than its checkpoint)."""
    out = {}
    for row in rows:
        if "step" in row:
            out[row["step"]] = row
    return out


def meshrun(*args: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [PYTHON, "-m", "launcher", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real local run: stopped after step 6 (train.exit_interval), resumed to 12; then a requeue event as the
    Slurm epilogue writes it (excluding n2), so every kind of marker has something to mark."""
    tmp = tmp_path_factory.mktemp("report")
    run = str(tmp / "run")
    first = meshrun(f"run.dir={run}", *TINY, "train.exit_interval=6", cwd=tmp)
    assert first.returncode == 3, first.stderr[-3000:]
    second = meshrun(f"run.dir={run}", "train.exit_interval=0", cwd=tmp)
    assert second.returncode == 0, second.stderr[-3000:]
    append_event(run, "requeued", cause="failure", reason="rank 1 on n2: exit 4", excluded_nodes=["n2"], last_step=12)
    return run


@pytest.fixture(scope="module")
def run_report(run_dir):
    """`meshrun action=report` of the run, once, in a process of its own: (its stdout's JSON, report.html's text
    as it wrote it)."""
    p = meshrun("action=report", f"run.dir={run_dir}", cwd=os.path.dirname(run_dir))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    with open(os.path.join(run_dir, "report", "report.html")) as f:
        return out, f.read()


@pytest.mark.slow  # run_dir trains (two CLI launches)
def test_report_of_a_run(run_dir, run_report, drawn):
    out, page = run_report
    assert out["report"] == os.path.join(run_dir, "report", "report.html")
    names = {os.path.basename(x)[:-4] for x in out["images"]}
    assert names == RUN_PLOTS, out  # no GPU sampler ran: the health plot is left out with a note
    assert any("health.jsonl" in n for n in out["notes"])
    for path in out["images"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(re.findall(r"<img [^>]*src='data:image/png;base64,", page)) == len(RUN_PLOTS)
    assert "src='http" not in page and "src='file" not in page  # self-contained
    # One row per step across the stop and the resume; the markers the plots carry. The reference is the run's
    # own files read here; the figures are what matplotlib was asked to draw (an in-process second report).
    metrics = last_per_step(rows_of(os.path.join(run_dir, "metrics.jsonl")))
    assert sorted(metrics) == list(range(1, 13))
    events = rows_of(os.path.join(run_dir, "events.jsonl"))
    build_report(run_dir)
    loss = drawn["Loss"]
    ((xs, ys),) = [(x, y) for label, x, y, _, _ in loss["lines"] if label == "train loss"]
    assert xs == list(range(1, 13)) and ys == pytest.approx([metrics[s]["loss"] for s in range(1, 13)])
    (lr_fig,) = [fig for title, fig in drawn.items() if title.startswith("Learning rate")]
    ((_, lr),) = [(x, y) for label, x, y, _, _ in lr_fig["lines"] if label == "lr"]
    assert lr == pytest.approx([metrics[s]["lr"] for s in range(1, 13)])
    vertical = [(x[0], style, color) for _, x, _, style, color in loss["lines"] if len(x) == 2 and x[0] == x[1]]
    ckpt_steps = sorted({e["step"] for e in events if e.get("event") == "checkpoint"})
    assert {4, 6, 12} <= set(ckpt_steps), ckpt_steps
    assert sorted(x for x, style, _ in vertical if style == ":") == ckpt_steps  # one dotted line per checkpoint
    texts = set(loss["texts"])
    assert {("resumed @ 6", 6.0), ("requeue (failure) excl. n2", 12.0)} <= texts, texts
    assert any(t.startswith("attempt") for t, _ in texts) and not any(t.startswith("ckpt") for t, _ in texts)
    assert not any("events without a step" in n for n in out["notes"])  # every event placed
    # The facts table of the page, read back from the HTML.
    facts = dict(re.findall(r"<tr><td><b>([^<]*)</b></td><td>([^<]*)</td></tr>", page))
    assert facts["steps logged"] == "12" and facts["requeues"] == "1" and facts["excluded nodes"] == "n2"
    assert facts["checkpoints"] == str(sum(e.get("event") == "checkpoint" for e in events)), facts
    # The summary comes first: what was trained and how it went.
    order = re.findall(r"<tr><td><b>([^<]*)</b>", page)
    assert order[:8] == ["model", "layout", "steps", "final loss", "eval loss", "tokens/s", "MFU", "state"], order
    assert (
        facts["model"] == "tiny" and facts["steps"] == "12 / 12" and facts["state"]
    )  # (the appended requeue has no job: its state)
    assert facts["final loss"] == f"{metrics[12]['loss']:.4f}" and facts["eval loss"] != "-"


def test_labels_of_nearby_markers_stand_side_by_side():
    """The README's hero image had "attempt 0 / resumed @ 4 / health / requeue" on top of each other: labels within
    3 % of the axis of one another take the next free column, same step or not; far apart, the first column."""
    from launcher.manage.report import label_columns

    assert label_columns([1, 4, 4, 5, 100], span=100) == [0, 1, 2, 0, 0]
    assert label_columns([0, 50, 100], span=100) == [0, 0, 0]
    assert label_columns([10, 12, 10.5], span=100) == [0, 1, 2]


@pytest.mark.slow  # run_dir trains
def test_report_of_a_sweep(run_dir, tmp_path, drawn):
    sweep = tmp_path / "sweep"
    p = run_cli(
        "-m",
        "action=plan",
        *TINY,
        "cluster.gpus_per_node=2",
        "parallel.dp=null",
        "parallel.tp=1,2",
        f"hydra.sweep.dir={sweep}",
        cwd=str(tmp_path),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    with open(sweep / "sweep.json") as f:
        feasible = json.load(f)["feasible"]
    assert len(feasible) == 2
    # The first point trained (the real run's files): measured beside predicted; the other only planned.
    for name in ("metrics.jsonl", "summary.json"):
        shutil.copy(os.path.join(run_dir, name), os.path.join(feasible[0]["run_dir"], name))
    points = sweep_points(str(sweep))
    metrics = last_per_step(rows_of(os.path.join(run_dir, "metrics.jsonl")))
    rates = [metrics[s]["tokens_per_s"] for s in sorted(metrics)[1:]]  # every logged step after the first
    assert points[0]["measured_tokens_per_s"] == pytest.approx(sum(rates) / len(rates))
    with open(os.path.join(feasible[0]["run_dir"], "plan.json")) as f:
        plan = json.load(f)
    assert points[0]["plan_tokens_per_s"] == pytest.approx(plan["tokens_per_step"] / plan["predicted_step_s"])
    assert points[0]["plan_memory_gib"] == pytest.approx(plan["memory_bytes"]["total"] / 2**30)
    assert points[0]["measured_memory_gib"] > 0 and math.isnan(points[1]["measured_tokens_per_s"])
    p = run_cli("action=report", f"run.dir={sweep}", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert {os.path.basename(x) for x in json.loads(p.stdout)["images"]} == {
        "sweep_tokens_per_s.png",
        "sweep_memory.png",
    }
    # The bars that command drew: point 0's measured bar is that mean, its plan bar tokens_per_step over
    # predicted_step_s; point 1 has no measured bar (height 0).
    bars = sorted(drawn["Tokens/s per point: measured vs plan"]["bars"])  # measured at x-0.2, plan at x+0.2
    assert [h for _, h in bars] == pytest.approx(
        [sum(rates) / len(rates), plan["tokens_per_step"] / plan["predicted_step_s"], 0, bars[3][1]]
    ) and bars[3][1] > 0


def test_report_of_a_directory_that_is_no_run(tmp_path):
    p = run_cli("action=report", f"run.dir={tmp_path}", cwd=str(tmp_path))
    assert p.returncode == 2 and "neither a run directory" in p.stderr and not (tmp_path / "report").exists()


# ---- the browser ---------------------------------------------------------------------------------
def chromium() -> str:
    """chromium's path; tests/browser.sh installs it where it can (root + apt-get), else the test skips with why."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    p = subprocess.run(["bash", os.path.join(ROOT, "tests", "browser.sh")], capture_output=True, text=True, timeout=900)
    if p.returncode == 0 and p.stdout.strip():
        return p.stdout.strip().splitlines()[-1]
    pytest.skip("headless browser unavailable: " + (p.stderr.strip().splitlines() or ["tests/browser.sh failed"])[-1])


# Marks each image once the page has loaded: data-decoded=1 when the browser decoded it (naturalWidth > 0).
_PROBE = """<script>window.addEventListener('load', () => {
  for (const img of document.images) img.setAttribute('data-decoded', img.naturalWidth > 0 ? '1' : '0');
  document.body.setAttribute('data-probed', String(document.images.length));
});</script>"""


@pytest.mark.slow  # run_dir trains
def test_report_renders_every_image_in_a_headless_browser(run_report, tmp_path):
    browser = chromium()
    _, page = run_report  # the page the meshrun process wrote
    probed = tmp_path / "probed.html"  # the same page plus the probe, outside the run directory
    probed.write_text(page.replace("</body>", _PROBE + "</body>"))
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            probed.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    imgs = re.findall(r"<img [^>]*>", dom.stdout)
    assert len(imgs) == len(RUN_PLOTS) and f'data-probed="{len(RUN_PLOTS)}"' in dom.stdout, dom.stdout[:2000]
    assert all('data-decoded="1"' in img for img in imgs), [img[:120] for img in imgs]
