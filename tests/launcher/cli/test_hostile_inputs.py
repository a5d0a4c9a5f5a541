"""Hostile inputs: another user's lock, sizes that hang the planner, bad
Arrow offsets, a linked report/, special files in a run directory, malformed events, a dataset naming files
outside itself, and malformed input that ended in a traceback. Each test runs the product's own entry points on
a crafted input and checks the outcome the audit expected (exit 2 with a message, nothing hung, nothing written
elsewhere). The warm agent's cases (D1, D10-D12) are in tests/slurm/test_warm_start.py."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import time

import pytest
from helpers import ROOT

from training.contract.rundir import lock


def _as_other_user(fn) -> int:
    """Run fn() in a child as `nobody` (the tests run as root in CI; as another user they could not switch)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture
def public_dir():
    """A directory other users can reach (pytest's tmp_path is under a 0700 directory of root's)."""
    import shutil
    import tempfile

    # dir given: tests/conftest.py points a bare mkdtemp() into pytest's basetemp, under root's 0700 directory
    path = tempfile.mkdtemp(prefix="meshrun-hostile-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with setuid: needs root (CI's user)")


@needs_root
def test_another_user_cannot_lock_a_run(public_dir):
    """D2: the lock file was 0644, so any user who could read run.dir could take a shared flock on a read-only
    descriptor and block every launch, with a message blaming a dead launcher. It is private now (an older
    run's is made private when next opened), and a flock of another user is named as such."""
    import pathlib

    run = pathlib.Path(public_dir) / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    lock.acquire(str(run)).release()
    assert stat.S_IMODE(os.stat(run / ".meshrun.lock").st_mode) == 0o600
    os.chmod(run / ".meshrun.lock", 0o644)  # as an older meshrun left it
    os.chmod(run, 0o755)
    lock.acquire(str(run)).release()
    assert stat.S_IMODE(os.stat(run / ".meshrun.lock").st_mode) == 0o600

    def try_open() -> int:
        try:
            os.open(str(run / ".meshrun.lock"), os.O_RDONLY)
            return 0
        except PermissionError:
            return 3

    assert _as_other_user(try_open) == 3

    # A descriptor another user opened while the file was still 0644: the message names them, not a dead launcher.
    os.chmod(run / ".meshrun.lock", 0o644)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest, whatever fails: it tells the parent and exits
        code = 1
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            fd = os.open(str(run / ".meshrun.lock"), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.write(w, b"x")
            time.sleep(30)
            code = 0
        except BaseException as exc:
            os.write(w, f"child failed: {exc!r}".encode()[:500])
        finally:
            os._exit(code)
    os.close(w)
    try:
        got = os.read(r, 500)
        assert got == b"x", got
        with pytest.raises(lock.RunLocked) as err:
            lock.acquire(str(run))
        assert "another user, uid 65534" in str(err.value) and "has died" not in str(err.value), str(err.value)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


BASE = ("model=tiny", "data=synthetic", "parallel=single", "cluster.gpus_per_node=1", "train.progress=false")


def _gpt2_dir(path, **fields) -> str:
    """A GPT-2 style model directory: config.json with `fields` over a small model, and an empty safetensors file."""
    import json
    import struct

    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2}
    config.update({"n_positions": 128, "vocab_size": 256}, **fields)
    config = {k: v for k, v in config.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    header = b"{}      "
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return str(path)


def test_a_huge_size_is_refused_at_once(tmp_path):
    """D3: model.num_layers=10^7 kept action=plan busy for minutes (a plan per candidate recompute count), and an
    HF config.json with n_layer 10^7 hung train.init_from (a shape per layer). Both exit 2 at once now."""
    from helpers.cli import run_cli

    t0 = time.monotonic()
    res = run_cli("action=plan", *BASE, "model.num_layers=10000000", f"run.dir={tmp_path / 'a'}")
    assert res.returncode == 2 and "model.num_layers" in res.stderr and "implausibly large" in res.stderr, res.stderr
    hf = _gpt2_dir(tmp_path / "hf", n_layer=10_000_000)
    res = run_cli(
        "action=plan", "data=synthetic", "parallel=single", "cluster.gpus_per_node=1", f"train.init_from={hf}"
    )
    assert res.returncode == 2 and "model.num_layers" in res.stderr and "implausibly large" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 20


def test_partial_recompute_finds_the_fewest_layers_by_bisection():
    """The no-fit fix `recompute_num_layers=N` names the fewest recomputed layers that fit, as the one-by-one
    search did (checked against it here), with a plan per bisection step instead of one per count."""
    from helpers.cli import compose_cfg

    from launcher.plan import validate as v
    from launcher.plan.estimate import make_plan
    from launcher.plan.model_size import chunk_layers

    cfg = compose_cfg("model=gpt2_125m", "data=synthetic", "parallel=single", "cluster.gpus_per_node=1")
    cfg.model.num_layers = 96
    cfg.parallel.micro_batch = 8
    calls = []
    real = v.make_plan

    def counted(c):
        calls.append(c.parallel.recompute_num_layers)
        return real(c)

    lo = 0
    for gb in range(1, 200):
        cfg.cluster.gpu_memory_gb = gb / 4
        need = [
            n
            for n in range(1, chunk_layers(cfg))
            if make_plan(v.with_parallel(cfg, recompute="full", recompute_num_layers=n)).fits
        ]
        if need and min(need) > 1 and not make_plan(cfg).fits:
            lo = min(need)
            break
    else:
        pytest.fail("no memory size needs a partial recompute")
    v.make_plan = counted
    try:
        fixes = v.fit_fixes(cfg, make_plan(cfg))
    finally:
        v.make_plan = real
    assert any(f"recompute_num_layers={lo}" in f for f in fixes), fixes
    assert len([n for n in calls if n]) <= 2 * chunk_layers(cfg).bit_length() + 4, calls


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"n_embd": "abc"}, "n_embd"),
        ({"n_embd": None}, "n_embd"),
        ({"n_layer": 4.5}, "n_layer"),
        ({"layer_norm_epsilon": "x"}, "layer_norm_epsilon"),
    ],
)
def test_hf_config_values_of_the_wrong_type_are_named(tmp_path, fields, key):
    """D13 (H2) and the unclear H4: a non-numeric or missing n_embd ended in a traceback (exit 1); n_layer 4.5
    became 4 silently. Each is exit 2 naming the key now (docs/USER_CONTRACTS.md: a whole number or refused)."""
    from helpers.cli import run_cli

    hf = _gpt2_dir(tmp_path / "hf", **fields)
    res = run_cli(
        "action=plan", "data=synthetic", "parallel=single", "cluster.gpus_per_node=1", f"train.init_from={hf}"
    )
    assert res.returncode == 2 and key in res.stderr and "Traceback" not in res.stderr, res.stderr


def _prepare(tmp_path, inputs, name="ds"):
    """`meshrun action=prepare` in a subprocess (a bad Arrow offset used to kill the process with SIGBUS)."""
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "launcher", "action=prepare", f"prepare.inputs=[{','.join(map(str, inputs))}]"]
        + [f"prepare.output={out / name}", "prepare.tokenizer=bytes", "prepare.workers=1", "prepare.progress=false"],
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res, (sorted(os.listdir(out)) if out.exists() else [])


def test_bad_arrow_offsets_and_bad_utf8_are_clear_errors_that_leave_nothing(tmp_path):
    """D4 (P8) and D13 (P3): string offsets past the data killed prepare with SIGBUS and left ds.tmp-* files;
    text that is not UTF-8 ended in a UnicodeDecodeError traceback. Both are exit 2 naming the file now."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    good = pa.array([f"document {i} of the stream" for i in range(16)])
    offsets = np.frombuffer(good.buffers()[1], dtype=np.int32).copy()
    offsets[2] = 2**31 - 1
    bad = pa.StringArray.from_buffers(16, pa.py_buffer(offsets.tobytes()), good.buffers()[2])
    table = pa.table({"text": bad})
    with pa.OSFile(str(tmp_path / "offsets.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    raw = pa.py_buffer(b"ok\xff\xfe text")
    utf = pa.StringArray.from_buffers(1, pa.py_buffer(np.array([0, len(raw)], dtype=np.int32).tobytes()), raw)
    pq.write_table(pa.table({"text": utf}), tmp_path / "utf8.parquet")
    for name in ("offsets.arrow", "utf8.parquet"):
        res, left = _prepare(tmp_path, [tmp_path / name])
        assert res.returncode == 2, (name, res.returncode, res.stderr[-2000:])
        assert name in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert left == [], left


def test_a_saved_dataset_cannot_name_files_outside_itself(tmp_path):
    """D9 (P5): state.json's `filename` ../../etc/hostname put a file outside the input into the dataset; D13
    (P4): splits ["."] recursed until RecursionError. Both are refused now, naming the entry."""
    import json

    import launcher.data.prepare.columnar as columnar
    from training.data.sources import DataError

    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    saved = tmp_path / "saved"
    saved.mkdir()
    for name in ("../outside.txt", str(outside), "../saved/../outside.txt", "data.txt"):
        (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
        with pytest.raises(DataError, match="not a .arrow name inside it"):
            columnar.saved_dataset_files(str(saved))
    (saved / "state.json").unlink()
    for splits in (["."], [".."], ["a/../.."]):
        (saved / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
        with pytest.raises(DataError, match="the split"):
            columnar.saved_dataset_files(str(saved))
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../outside.txt"}]}))
    (saved / "dataset_dict.json").unlink()
    res, left = _prepare(tmp_path, [saved])
    assert res.returncode == 2 and "not a .arrow name" in res.stderr and left == [], res.stderr[-2000:]


def _fake_run(path):
    """A finished local run's events.jsonl, metrics.jsonl and logs (what status, report, logs and cancel read),
    written as meshrun writes them; no training needed for these readers."""
    import json

    path.mkdir(parents=True)
    (path / "logs").mkdir()
    t = 1_700_000_000.0
    events = [
        {"attempt": 0, "event": "started", "job_id": "local", "time": t, "world_size": 1, "nodes": ["vm"]},
        {"attempt": 0, "event": "checkpoint", "job_id": "local", "step": 2, "blocked_s": 0.2, "time": t + 3},
        {"attempt": 0, "event": "completed", "job_id": "local", "time": t + 5, "world_size": 1},
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rows = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": 1.0, "time": t + s, "attempt": 0} for s in (1, 2, 3, 4)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "logs" / "rank_0.log").write_text("rank 0 says hello\n")
    return path


@pytest.mark.parametrize(
    "line",
    [
        '{"event": "checkpoint", "time": "abc", "attempt": 0, "blocked_s": "x"}',
        '{"event": "started", "time": 1.0, "attempt": "x"}',
        '{"event": "started", "time": NaN, "attempt": 0}',
        '{"event": "completed", "time": Infinity, "attempt": 0}',
    ],
)
def test_a_malformed_event_is_skipped_by_status_report_and_cancel(tmp_path, line):
    """D8 (S1-S3): one string `time` or `attempt` crashed status, report and cancel (cancel before it wrote
    cancel.json); the unclear S4/S6: NaN and Infinity made status print what no strict JSON parser reads. The
    line is skipped now (docs/USER_CONTRACTS.md), and status prints strict JSON."""
    import json

    from helpers.cli import run_cli

    run = _fake_run(tmp_path / "run")
    with open(run / "events.jsonl", "a") as f:
        f.write(line + "\n")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(line.replace('"event"', '"step": 5, "kind"') + "\n")
    res = run_cli("action=status", f"run.dir={run}")
    assert res.returncode == 0, res.stderr[-2000:]
    json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"status printed {c}"))
    assert run_cli("action=status", "status.format=table", f"run.dir={run}").returncode == 0
    res = run_cli("action=cancel", f"run.dir={run}")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_fifos_and_devices_in_a_run_directory_neither_hang_nor_exhaust_the_readers(tmp_path):
    """D7 (S8-S10): a FIFO as events.jsonl hung status, as .meshrun.lock hung plan's lock check, as a rank log hung
    logs; metrics.jsonl or a log linked to /dev/zero read until MemoryError. The readers open regular files only."""
    from helpers.cli import run_cli

    run = _fake_run(tmp_path / "run")
    for name in ("events.jsonl", ".meshrun.lock", "logs/rank_0.log"):
        if (run / name).exists():
            (run / name).unlink()
        os.mkfifo(run / name)
    (run / "metrics.jsonl").unlink()
    os.symlink("/dev/zero", run / "metrics.jsonl")
    code = (
        "import sys; sys.path[:0] = [sys.argv[2], sys.argv[2] + '/tests']\n"
        "from helpers.cli import run_cli\n"
        "for action in ('status', 'logs'):\n"
        "    r = run_cli('action=' + action, 'run.dir=' + sys.argv[1])\n"
        "    print(action, r.returncode, flush=True)\n"
        "from training.contract.rundir import lock\n"
        "print('holder', lock.read_holder(sys.argv[1]), flush=True)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(run), ROOT], capture_output=True, text=True, timeout=60, cwd=str(tmp_path)
    )  # a subprocess: before the fix these hung (a timeout here fails the test instead of blocking the suite)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "status 0" in res.stdout and "holder {}" in res.stdout, res.stdout
    assert "logs " in res.stdout, res.stdout
    del run_cli


def test_a_linked_report_directory_is_refused_before_anything_is_written(tmp_path):
    """D5 (S11): report/ linked elsewhere: seven PNGs were written into the link's target (a user's loss.png
    replaced) before report.html refused with a traceback. D13 (S14): a read-only run directory ended in an
    OSError traceback. Both are exit 2 with a message now, before any plot."""
    from helpers.cli import run_cli

    run = _fake_run(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "loss.png").write_bytes(b"the user's own picture")
    os.symlink(elsewhere, run / "report")
    res = run_cli("action=report", f"run.dir={run}")
    assert res.returncode == 2 and "symbolic link" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert os.listdir(elsewhere) == ["loss.png"] and (elsewhere / "loss.png").read_bytes() == b"the user's own picture"
    os.unlink(run / "report")
    # A read-only file system (a real read-only tmpfs, as test_run_dir_safety does; root ignores modes).
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        _fake_run(mnt / "run")
        assert os.system(f"mount -o remount,ro {mnt}") == 0
        res = run_cli("action=report", f"run.dir={mnt / 'run'}")
        assert res.returncode == 2 and "not writable" in res.stderr and "Traceback" not in res.stderr, res.stderr
    finally:
        os.system(f"umount {mnt}")
