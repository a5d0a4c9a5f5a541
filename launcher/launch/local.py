"""Run a job on this machine: exactly tp x pp x cp x dp rank processes of `python -m training.main RUN_DIR`.

No torch import here (the launcher must stay light). Each rank gets the standard env and
OMP_NUM_THREADS = max(1, cores // world) (launcher/ranks/processes.py) so the ranks do not oversubscribe the
cores. Rank 0's output is streamed to this terminal; every rank's output also goes to run_dir/logs/rank_<r>.log
(appended: every attempt, each under a header line).
The launcher holds run_dir's lock (training/contract/rundir/lock.py) and every rank inherits it.
If any rank exits non-zero the others are stopped within seconds (SIGTERM, then SIGKILL) and the
launcher exits with that rank's code (1 for a rank killed by a signal); events started / completed / failed /
stopped go to events.jsonl. SIGINT, SIGTERM or SIGHUP to the launcher stops the ranks as action=cancel does
(a checkpoint first, `cancelled`, exit 130); a launcher that dies takes its ranks with it
(training/run/launcher_watch.py).
With cluster.warm_start and two ranks or more, one warm agent per launch forks the ranks instead (torch imported
once; launcher/ranks/warm/local.py): the same ranks, as far as this launcher and the ranks can tell.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from launcher.ranks import warm
from launcher.ranks.exits import catches, failure_of, last_error_line, root_cause
from launcher.ranks.nsys import nsys_prefix
from launcher.ranks.numa import rank_prefix
from launcher.ranks.processes import (
    POLL_S,
    PlainLines,
    engine_env,
    rank_process_env,
    start_pump,
    stop_processes,
    threads_per_rank,
)
from launcher.ranks.warm.local import LocalAgent
from launcher.records.goodput import write_goodput_quietly
from launcher.slurm.queries import job_alive
from training.contract.config import Config, derived_dp
from training.contract.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED
from training.contract.rundir.config_files import write_config
from training.contract.rundir.events import append_event, read_events
from training.contract.rundir.files import open_append
from training.contract.rundir.lock import TOKEN_ENV, RunLock, acquire, held
from training.contract.rundir.paths import RunPaths
from training.contract.rundir.resume_request import write_request
from training.contract.slurm_env import dist_env
from training.observe.progress import TTY_ENV

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port nobody listens on right now (the rendezvous of this job)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def attempt_header(attempt: int) -> str:
    """The line that opens each attempt in a local rank log (launcher/manage/logs.py finds attempts by it)."""
    return f"===== meshrun attempt {attempt} ({time.strftime('%Y-%m-%d %H:%M:%S')}) =====\n"


def run_ranks(cfg: Config, run_dir: str) -> int:
    """Spawn the ranks, wait, and return the job's exit code (the first failing rank's code, else EXIT_OK or
    EXIT_STOPPED)."""
    p = cfg.parallel
    world = p.tp * p.pp * p.cp * derived_dp(cfg)
    port = cfg.cluster.master_port or free_port()
    threads = threads_per_rank(world)
    lock = held(run_dir)
    own_lock = lock is None
    if own_lock:  # called without the app, which takes it before anything is written
        lock = acquire(run_dir, what="meshrun local launcher", job_alive=job_alive)
    try:
        return _run_ranks(cfg, run_dir, world, port, threads, lock)
    finally:
        write_goodput_quietly(run_dir)  # run_dir/goodput.json (launcher/records/goodput.py)
        if own_lock:
            lock.release()


def _run_ranks(cfg: Config, run_dir: str, world: int, port: int, threads: int, lock: RunLock) -> int:
    attempt, binding = _begin_attempt(cfg, run_dir, world, threads)
    ranks = _Ranks(run_dir, attempt)
    try:
        ranks.start(cfg, world, port, threads, lock, binding)
        stop = _StopRequest(ranks.procs, cfg.cancel.timeout_s, cfg.train.checkpointing)
        failed = _watch(run_dir, attempt, ranks.procs, stop)
        if stop.name:
            return _interrupted(run_dir, stop, ranks.procs, attempt, cfg.train.checkpointing)
        if failed is not None:
            return _failed(run_dir, attempt, ranks.procs, failed)
        return _ended(cfg, run_dir, world, attempt, ranks.procs)
    except KeyboardInterrupt:
        stop_processes(ranks.procs)
        append_event(
            run_dir,
            "failed",
            node=socket.gethostname(),
            rank=-1,
            exit_code=EXIT_INTERRUPTED,
            reason="interrupted",
            attempt=attempt,
        )
        return EXIT_INTERRUPTED
    finally:
        ranks.close()


def _begin_attempt(cfg: Config, run_dir: str, world: int, threads: int) -> tuple[int, list]:
    """(this launch's attempt number, each rank's (NUMA prefix, node)), after the `started` event. Launches of one
    run.dir are its attempts (0, 1, ...), as a Slurm job's requeues are: events and metrics rows carry the number
    (MESHRUN_ATTEMPT, training/contract/rundir/events.py)."""
    paths = RunPaths(run_dir)
    os.makedirs(paths.logs, exist_ok=True)
    if not os.path.exists(paths.config):
        write_config(cfg, run_dir)
    attempt = sum(1 for ev in read_events(run_dir) if ev.get("event") == "started")
    binding = [rank_prefix(cfg, r, world) for r in range(world)]  # NUMA, as on Slurm (launcher/ranks/numa.py)
    # launcher_pid lets `action=status` tell a running job from one whose launcher was killed (no end event).
    append_event(
        run_dir,
        "started",
        nodes=[socket.gethostname()],
        world_size=world,
        threads_per_rank=threads,
        launcher_pid=os.getpid(),
        attempt=attempt,
        numa_nodes=[node for _, node in binding],
    )
    return attempt, binding


class _Ranks:
    """One attempt's rank processes and what the launcher holds for them: their output pumps, their logs and the
    launch's warm agent (released by close)."""

    def __init__(self, run_dir: str, attempt: int) -> None:
        self.run_dir, self.attempt, self.paths = run_dir, attempt, RunPaths(run_dir)
        self.procs: list[Any] = []  # subprocess.Popen, or a warm rank's WarmChild (launcher/ranks/warm/fork.py)
        self.pumps: list[threading.Thread] = []
        self.logs: list[Any] = []
        self.agent: LocalAgent | None = None

    def _log(self, path: str):
        # Appended: every attempt of the run stays in the log, each under its own header (action=logs).
        log = open_append(path, binary=True)  # never via a link
        log.write(attempt_header(self.attempt).encode())
        log.flush()
        self.logs.append(log)
        return log

    def start(self, cfg: Config, world: int, port: int, threads: int, lock: RunLock, binding: list) -> None:
        """Start every rank: forked by the launch's warm agent where warm starts are on, else cold."""
        run_dir = self.run_dir
        prefixes = [binding[r][0] + nsys_prefix(cfg, r, run_dir) for r in range(world)]
        if warm.enabled(cfg, world) and not all(prefixes):
            # A rank under numactl or nsys must run their command: it starts cold.
            agent_env = rank_process_env({}, engine_env(cfg, run_dir), threads)
            self.agent = LocalAgent(run_dir, agent_env, self._log(self.paths.warm_agent_log))
        tty = sys.stderr.isatty()
        warm_ranks: list[int] = []
        for r in range(world):
            log = self._log(self.paths.rank_log(r))
            env = rank_process_env(dist_env(r, world, r, world, LOOPBACK, port), engine_env(cfg, run_dir), threads)
            env[TOKEN_ENV] = lock.token
            env["MESHRUN_ATTEMPT"] = str(self.attempt)
            if r == 0 and tty:
                env[TTY_ENV] = "1"
            if binding[r][1] is not None:
                env["MESHRUN_NUMA_NODE"] = str(binding[r][1])
            env[LAUNCHER_PID_ENV] = str(os.getpid())  # the rank stops (after a checkpoint) if this launcher dies
            # Each rank inherits the locked file: the run directory stays locked while any rank lives, even
            # if this launcher is killed (training/contract/rundir/lock.py). A session of its own: Ctrl-C at the terminal
            # reaches this launcher only, which stops the ranks through their own stop path (a checkpoint
            # first) instead of a KeyboardInterrupt in each.
            argv = prefixes[r] + [sys.executable, "-m", "training.main", run_dir]
            proc: Any = self.agent.start_rank(r, env, lock.fd) if self.agent is not None and not prefixes[r] else None
            if proc is not None:
                warm_ranks.append(r)
            else:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=(lock.fd,),
                    start_new_session=True,
                )
            self.procs.append(proc)
            # Rank 0 also goes to this terminal (stderr: stdout stays for results); its progress bar redraws in
            # place there (TTY_ENV) and reaches the log as plain lines.
            sinks: list[Any] = [PlainLines(log) if tty else log, sys.stderr.buffer] if r == 0 else [log]
            self.pumps.append(start_pump(proc.stdout, sinks))
        if self.agent is not None:
            # Which ranks the agent forked (the others started cold, each with its `warm_start_missed`).
            append_event(
                run_dir, "ranks_started", warm_ranks=warm_ranks, agent_pid=self.agent.pid, attempt=self.attempt
            )

    def close(self) -> None:
        if self.agent is not None:
            self.agent.stop()  # its ranks have ended: it leaves (SIGTERM), as it does when this launcher dies
        for t in self.pumps:
            t.join(timeout=2)
        for log in self.logs:
            log.close()


def _watch(run_dir: str, attempt: int, procs: list[Any], stop: _StopRequest) -> tuple | None:
    """Wait for the ranks, forwarding a stop request; the failure (_blame's) once a rank has failed, else None
    (all ended, or a stop was asked: stop.name)."""
    ended: dict[int, tuple] = {}  # a failed rank -> (its exit code, when it was seen)
    with stop.installed():
        while True:
            stop.forward()
            codes = [proc.poll() for proc in procs]
            now = time.time()
            for r, c in enumerate(codes):
                if c is not None and c not in (EXIT_OK, EXIT_STOPPED):
                    ended.setdefault(r, (c, now))
            if ended and not stop.name:
                # A rank's death ends its peers soon after (a collective with it fails), and a warm rank's end
                # comes back later than a cold peer's: FAILURE_GRACE_S lets the cause be told from them.
                if all(c is not None for c in codes) or now - min(t for _, t in ended.values()) >= FAILURE_GRACE_S:
                    return _blame(run_dir, attempt, ended)
            if all(c is not None for c in codes):
                return None
            time.sleep(POLL_S)


def _failed(run_dir: str, attempt: int, procs: list[Any], failed: tuple) -> int:
    """Stop the other ranks, record the failure (`failed`) and say which rank caused it; its exit code."""
    stop_processes(procs)
    rank, code, told, consequences = failed
    why = f"exited with code {code}"
    if code < 0:  # killed by a signal: Popen's -N, which would leave meshrun as 256 - N (outside the table)
        why = f"was killed by {_signal_name(-code)}" + (" (out of memory? see dmesg)" if -code == 9 else "")
        code = EXIT_FAILED
    append_event(
        run_dir,
        "failed",
        node=socket.gethostname(),
        rank=rank,
        exit_code=code,
        reason=f"rank {rank}: {told}; see {run_dir}/logs/rank_{rank}.log",
        consequences=consequences,
        attempt=attempt,
    )
    print(
        f"meshrun: rank {rank} {why}; stopped the other ranks (log: {run_dir}/logs/rank_{rank}.log)",
        file=sys.stderr,
    )
    return code


def _ended(cfg: Config, run_dir: str, world: int, attempt: int, procs: list[Any]) -> int:
    """Every rank ended without failing: `stopped` (early, on purpose) or `completed`."""
    codes = [proc.returncode for proc in procs]
    if any(c == EXIT_STOPPED for c in codes):
        # Stopped early on purpose after a checkpoint; nothing requeues a local run, the user does.
        # train.checkpointing=false: stopped at a signal with no checkpoint, so there is nothing to resume.
        reason = (
            "stopped early after a complete checkpoint (signal, "
            f"exit_interval or exit_after_min): run again with run.dir={run_dir} to resume"
            if cfg.train.checkpointing
            else "stopped early at a signal; no checkpoint was written (train.checkpointing=false): nothing to resume"
        )
        append_event(run_dir, "stopped", reason=reason, attempt=attempt)
        return EXIT_STOPPED
    append_event(run_dir, "completed", world_size=world, attempt=attempt)
    return EXIT_OK


FAILURE_GRACE_S = 2.0
"""After a rank fails, how long the launcher waits for the others to end before it decides which one caused it."""


def _blame(run_dir: str, attempt: int, ended: dict[int, tuple]) -> tuple:
    """(rank, exit code, reason, consequences): of the failed ranks (rank -> (code, when seen)), the cause by the
    Slurm epilogue's rule (launcher/ranks/exits.py root_cause: the first killed by a signal, else the first with
    an error of its own, not a peer's collective error); reason is its log's error line (this attempt's), never
    empty; consequences the other failed ranks."""
    records = []
    for rank, (code, when) in sorted(ended.items()):
        records.append(
            {"rank": rank, "exit_code": code, "error": _attempt_error(run_dir, attempt, rank), "ended": when}
        )
    cause = root_cause(records)
    told = failure_of({**cause, "node": socket.gethostname()}).reason
    return cause["rank"], cause["exit_code"], told, sorted(r for r in ended if r != cause["rank"])


def _attempt_error(run_dir: str, attempt: int, rank: int) -> str:
    """The last error line rank `rank` printed in this attempt (its log's part after the attempt's header)."""
    path = RunPaths(run_dir).rank_log(rank)
    deadline = time.time() + 1.0
    text = ""
    while True:  # the pump thread may still be writing the rank's last lines
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 65536))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        text = text.rsplit(f"===== meshrun attempt {attempt} (", 1)[-1]
        if last_error_line(text) or time.time() > deadline:
            return last_error_line(text)
        time.sleep(0.1)


LAUNCHER_PID_ENV = "MESHRUN_LAUNCHER_PID"
"""Set in every rank a local launcher starts: its pid (a rank whose launcher dies stops, training/run/launcher_watch.py)."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class _StopRequest:
    """SIGINT (Ctrl-C), SIGTERM or SIGHUP to the launcher: stop the ranks as action=cancel does (SIGUSR2, once
    each rank has its handler: they agree on a step, save it and exit 3). A second signal, or ranks still
    running after cancel.timeout_s, ends them at once (the last complete checkpoint stays)."""

    def __init__(self, procs: list[subprocess.Popen], timeout_s: float, checkpointing: bool = True):
        self.procs, self.timeout_s = procs, timeout_s
        self.when = "after a checkpoint" if checkpointing else "at the next step boundary (no checkpoint)"
        self.name: str | None = None
        self.count = 0
        self.since = 0.0
        self.signalled: set = set()
        self.forced = False

    def _handler(self, signum, _frame) -> None:
        self.count += 1
        if self.name is None:
            self.name, self.since = _signal_name(signum), time.time()
            print(f"meshrun: {self.name}: stopping the ranks {self.when} (again to stop at once)", file=sys.stderr)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only (a test harness, a sweep's worker)
            return
        previous = {sig: signal.signal(sig, self._handler) for sig in _STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def forward(self) -> None:
        if self.name is None:
            return
        if self.count > 1 or time.time() - self.since > self.timeout_s:
            if not self.forced:
                self.forced = True
                stop_processes(self.procs)
            return
        for proc in self.procs:
            if proc.pid not in self.signalled and proc.poll() is None and catches(proc.pid, signal.SIGUSR2):
                try:
                    os.kill(proc.pid, signal.SIGUSR2)
                    self.signalled.add(proc.pid)
                except OSError:
                    pass


def _interrupted(
    run_dir: str, stop: _StopRequest, procs: list[subprocess.Popen], attempt: int, checkpointing: bool = True
) -> int:
    """Record and say how an interrupted run ended (`cancelled`, as action=cancel) and how to resume it (with
    train.checkpointing=false: that no checkpoint was written, and no resume hint)."""
    from launcher.records.readers import record_cancelled

    stop_processes(procs)  # already ended: reaps them
    stopped = all(p.returncode == EXIT_STOPPED for p in procs) and not stop.forced
    if not checkpointing:
        how = (
            "stopped at a step boundary" if stopped else "stopped at once"
        ) + "; no checkpoint was written (train.checkpointing=false): nothing to resume"
    elif stopped:
        how = "saved a checkpoint and stopped"
    else:
        how = "stopped at once: the last complete checkpoint is kept, the steps after it are lost"
    event = record_cancelled(
        run_dir, f"interrupted by {stop.name} to the local launcher: {how}", forced=not stopped, attempt=attempt
    )
    step = event.get("checkpoint_step")
    resume = ""
    if checkpointing:
        resume = f"{f' (checkpoint step_{step})' if step is not None else ''}. Resume with: meshrun run.dir={run_dir}"
    print(f"meshrun: interrupted ({stop.name}): {how}{resume}", file=sys.stderr)
    return EXIT_INTERRUPTED


def launch_local(cfg: Config, run_dir: str) -> dict[str, Any]:
    """Launch the job on this machine; exits with the job's code when it is not 0."""
    write_request(run_dir, cfg.train.resume)  # an explicit train.resume applies to this launch only
    code = run_ranks(cfg, run_dir)
    if code != EXIT_OK:
        raise SystemExit(code)
    return {"status": "completed", "run_dir": run_dir}
