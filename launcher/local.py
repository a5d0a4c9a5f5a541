"""Run a job on this machine: exactly tp x pp x cp x dp rank processes of `python -m training.main RUN_DIR`.

No torch import here (the launcher must stay light). Each rank gets the standard env and
OMP_NUM_THREADS = max(1, cores // world) so the ranks do not oversubscribe the cores. Rank 0's
output is streamed to this terminal; every rank's output also goes to run_dir/logs/rank_<r>.log.
If any rank exits non-zero the others are stopped within seconds (SIGTERM, then SIGKILL) and the
launcher exits with that rank's code; events started / completed / failed / stopped go to events.jsonl.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from launcher.rundir import write_config
from training.config import Config, derived_dp
from training.events import append_event
from training.exit_codes import EXIT_OK

KILL_GRACE_S = 3.0
POLL_S = 0.1


def free_port() -> int:
    """A TCP port nobody listens on right now (the rendezvous of this job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_env(rank: int, world: int, port: int, threads: int, cfg: Config) -> Dict[str, str]:
    """Environment of one local rank."""
    env = dict(os.environ)
    env.update(cfg.cluster.env)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
    )
    # The engine must import from this checkout whatever the current directory is.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _pump(stream, log, echo: bool) -> None:
    """Copy a rank's output into its log file and, for rank 0, to this terminal."""
    for chunk in iter(lambda: stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096), b""):
        log.write(chunk)
        log.flush()
        if echo:
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()


def _stop(procs: List[subprocess.Popen]) -> None:
    """SIGTERM every live rank, SIGKILL what is still alive after KILL_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + KILL_GRACE_S
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_ranks(cfg: Config, run_dir: str) -> int:
    """Spawn the ranks, wait, and return the job's exit code (first failing rank's code, else 0 / 3)."""
    p = cfg.parallel
    world = p.tp * p.pp * p.cp * derived_dp(cfg)
    port = cfg.cluster.master_port or free_port()
    threads = max(1, usable_cores() // world)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    if not os.path.exists(os.path.join(run_dir, "config.json")):
        write_config(cfg, run_dir)
    # launcher_pid lets `action=status` tell a running job from one whose launcher was killed (no end event).
    append_event(run_dir, "started", nodes=[socket.gethostname()], world_size=world, threads_per_rank=threads,
                 launcher_pid=os.getpid())
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    logs = []
    try:
        for r in range(world):
            log = open(os.path.join(run_dir, "logs", f"rank_{r}.log"), "wb")
            logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "training.main", run_dir],
                                    env=rank_env(r, world, port, threads, cfg),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs.append(proc)
            t = threading.Thread(target=_pump, args=(proc.stdout, log, r == 0), daemon=True)
            t.start()
            pumps.append(t)
        failed: Optional[tuple] = None
        while True:
            codes = [proc.poll() for proc in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c is not None and c not in (0, 3)]
            if bad:
                failed = bad[0]
                break
            if all(c is not None for c in codes):
                break
            time.sleep(POLL_S)
        if failed is not None:
            _stop(procs)
            rank, code = failed
            append_event(run_dir, "failed", node=socket.gethostname(), rank=rank, exit_code=code,
                         reason=f"rank {rank} exited with {code}; see {run_dir}/logs/rank_{rank}.log")
            print(f"meshrun: rank {rank} exited with code {code}; stopped the other ranks "
                  f"(log: {run_dir}/logs/rank_{rank}.log)", file=sys.stderr)
            return code
        codes = [proc.returncode for proc in procs]
        if any(c == 3 for c in codes):
            # Stopped early on purpose after a checkpoint; nothing requeues a local run, the user does.
            append_event(run_dir, "stopped", reason="stopped early after a complete checkpoint (signal, "
                         f"exit_interval or exit_after_min): run again with run.dir={run_dir} to resume")
            return 3
        append_event(run_dir, "completed", world_size=world)
        return EXIT_OK
    except KeyboardInterrupt:
        _stop(procs)
        append_event(run_dir, "failed", node=socket.gethostname(), rank=-1, exit_code=130, reason="interrupted")
        return 130
    finally:
        for t in pumps:
            t.join(timeout=2)
        for log in logs:
            log.close()


def launch_local(cfg: Config, run_dir: str, plan_result: Any = None) -> Dict[str, Any]:
    """Launch the job on this machine; exits with the job's code when it is not 0."""
    code = run_ranks(cfg, run_dir)
    if code != EXIT_OK:
        raise SystemExit(code)
    return {"status": "completed", "run_dir": run_dir}
