"""The hostile audit of 2026-12-03 (defects D2-D9, D13): another user's lock, sizes that hang the planner, bad
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

    path = tempfile.mkdtemp(prefix="meshrun-hostile-")
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
    if pid == 0:
        os.close(r)
        os.setgid(65534)
        os.setuid(65534)
        fd = os.open(str(run / ".meshrun.lock"), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
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
    from launcher.plan import validate as v
    from launcher.plan.estimate import make_plan
    from launcher.plan.model_size import chunk_layers
    from helpers.cli import compose_cfg

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
