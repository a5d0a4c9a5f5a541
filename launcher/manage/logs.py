"""`meshrun action=logs run.dir=D [logs.rank=N] [logs.follow=true]`: one rank's log, every attempt, newest last.

Local runs: run.dir/logs/rank_N.log (the launcher appends each attempt under a header line, launcher/launch/local.py).
Slurm runs: submitit's log of task N in every job of the run: the `submitted` event names the job and its
`log_dir` (a sweep's job array shares the sweep's folder), each resubmission's `requeued` event names the new job
(its logs are in run.dir/submitit); a requeue of the same job appends to the same file (--open-mode=append).
Which files those are is the run's backend's (launcher/launch/backend.py log_files, by config.json's cluster.kind).
With follow, what is appended is printed as it comes, and a later job's log when the run moves on to it, until
the run has ended.
"""

from __future__ import annotations

import json
import os
import sys
import time

from launcher.launch.backend import backend_of_run
from training.contract.exit_codes import EXIT_INVALID
from training.contract.rundir.events import read_events
from training.contract.rundir.files import open_regular
from training.contract.rundir.paths import RunPaths


def _print_from(path: str, offset: int) -> int:
    """Print path from byte offset on; returns the new offset (the same when it cannot be read)."""
    try:
        with open_regular(path, binary=True) as f:  # a FIFO or a device planted as a log would hang or never end
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    if chunk:
        sys.stdout.write(chunk.decode("utf-8", "replace"))
        sys.stdout.flush()
    return offset + len(chunk)


def _tail_offsets(paths: list[str], lines: int) -> dict[str, int]:
    """Where to start printing each file so that only the last `lines` lines of them all (in order) show:
    files wholly before those lines start at their end, read backwards in blocks (a log may be large)."""
    offsets: dict[str, int] = {}
    need = lines
    for path in reversed(paths):
        size = os.path.getsize(path)
        if need <= 0:
            offsets[path] = size
            continue
        pos, tail = size, b""
        with open_regular(path, binary=True) as f:
            while pos > 0 and tail.count(b"\n") <= need:
                step = min(1 << 16, pos)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
        # A final line without its newline counts as a line too.
        body = tail[:-1] if tail.endswith(b"\n") else tail
        found = body.count(b"\n") + (1 if body else 0)
        if found <= need:
            offsets[path] = pos
            need -= found
        else:
            cut = len(body)
            for _ in range(need):
                cut = body.rfind(b"\n", 0, cut)
            offsets[path] = pos + cut + 1
            need = 0
    return offsets


def _ended(run_dir: str) -> bool:
    from launcher.manage.status import run_status
    from launcher.slurm.queries import FINAL_STATES

    return run_status(run_dir)["state"] in FINAL_STATES


def show_logs(
    run_dir: str,
    rank: int = 0,
    follow: bool = False,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    tail: int = 0,
) -> list[str]:
    """Print the logs (a `==> FILE <==` line before each file, as tail does); returns the files printed.
    tail > 0: only the last `tail` lines of the files that exist now (files before them are skipped)."""
    events = read_events(run_dir)
    if not events and not os.path.isdir(RunPaths(run_dir).logs):
        print(
            f"error: run.dir={run_dir} holds no meshrun run (no events.jsonl, no logs/): give the run directory "
            "printed at launch or submission (a sweep point's is <sweep dir>/<num>)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    backend = backend_of_run(run_dir, events)  # the one that launched the run knows where its output goes

    def log_files() -> list[str]:
        return backend.log_files(run_dir, rank, read_events(run_dir))  # a resubmission adds a job's file

    offsets: dict[str, int] = {}
    shown: list[str] = []
    start = time.time()
    if tail > 0:
        existing = [p for p in backend.log_files(run_dir, rank, events) if os.path.isfile(p)]  # regular files only
        skip = _tail_offsets(existing, tail)
        offsets.update({p: off for p, off in skip.items() if off >= os.path.getsize(p) and p != existing[-1]})
        starts = {p: off for p, off in skip.items() if p not in offsets}
    else:
        starts = {}
    while True:
        for path in log_files():
            if path not in offsets:
                if not os.path.isfile(path):
                    continue  # not written yet (a pending job): printed once it appears; never a FIFO or device
                print(f"==> {path} <==", flush=True)
                offsets[path] = starts.get(path, 0)
                shown.append(path)
            offsets[path] = _print_from(path, offsets[path])
        if not follow:
            break
        if _ended(run_dir):
            time.sleep(poll_s)  # the epilogue's last lines
            for path in list(offsets):
                offsets[path] = _print_from(path, offsets[path])
            break
        if timeout_s is not None and time.time() - start > timeout_s:
            break
        time.sleep(poll_s)
    if not shown:
        print(f"no log of rank {rank} yet in {run_dir} (expected: {', '.join(log_files())})", file=sys.stderr)
    return shown


def _world_size(run_dir: str) -> int:
    """The newest attempt's rank count (its `started` event), else config.json's; 0 when neither says."""
    for ev in reversed(read_events(run_dir)):
        if ev.get("event") == "started" and isinstance(ev.get("world_size"), int):
            return ev["world_size"]
    try:
        with open(RunPaths(run_dir).config) as f:
            cluster = json.load(f)["cluster"]
        return int(cluster["nodes"]) * int(cluster["gpus_per_node"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def run_logs(cfg, run_dir: str) -> list[str]:
    """The app's action=logs."""
    if cfg.logs.rank < 0:
        print(f"error: logs.rank={cfg.logs.rank} must be a global rank (0, 1, ...)", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    world = _world_size(run_dir)
    if world and cfg.logs.rank >= world:
        print(
            f"error: logs.rank={cfg.logs.rank}: the run in {run_dir} has {world} ranks; give one of 0..{world - 1}",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    if cfg.logs.tail < 0:
        print(f"error: logs.tail={cfg.logs.tail} must be >= 0 (the last N lines; 0: the whole log)", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    try:
        return show_logs(run_dir, cfg.logs.rank, cfg.logs.follow, tail=cfg.logs.tail)
    except KeyboardInterrupt:  # ctrl-c ends following; nothing is wrong with the run
        return []
