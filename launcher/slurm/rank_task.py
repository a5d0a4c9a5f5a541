"""One Slurm task = one rank: the callable submitit runs on every task of the job.

It maps SLURM_* to torch's variables, binds the rank to its NUMA node with numactl, runs
`python -m training.main RUN_DIR` as a child, and records how the rank ended in
run_dir/slurm/attempt_<A>/rank_<R>.json for the epilogue (launcher/slurm/driver.py). A failed rank
raises, so the task exits non-zero and `srun --kill-on-bad-exit=1` ends the step at once.
No torch import: the child imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from launcher.ranks.exits import catches, last_error_line
from launcher.ranks.nsys import nsys_prefix
from launcher.ranks.numa import choose_node, numactl_prefix
from launcher.ranks.processes import engine_env, rank_process_env, start_pump, threads_per_rank
from launcher.ranks.warm import slurm as warm_slurm
from launcher.slurm import in_job
from training.contract.config import Config, load_config
from training.contract.exit_codes import EXIT_OK, EXIT_STOPPED
from training.contract.rundir.events import append_event
from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths
from training.contract.slurm_env import torch_env_from_slurm
from training.contract.warm_start import WARM_ENV, WRAPPER_PID_ENV
from training.observe.startup import TASK_START_ENV, process_start_time


class RankFailed(RuntimeError):
    """A rank ended with a failure exit code (the task must fail so srun stops the step)."""


def attempt_dir(run_dir: str, attempt: int) -> str:
    return RunPaths(run_dir).attempt(attempt)


FORWARD_POLL_S = 0.2


def _ignore_stop_signals() -> None:
    """In the child before exec: USR2/TERM ignored until the engine installs its handler (SIG_IGN
    survives exec; signal.signal in the engine replaces it)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Forwarder:
    """A stop signal that reached the child while it still ignored it (importing torch) is lost:
    re-send it exactly once, as soon as the child has installed its handler. A child that already
    caught it directly gets nothing more (a late copy could arrive after Python restored the default
    handlers at exit and kill a rank that had saved cleanly)."""

    def __init__(self) -> None:
        self.pid = 0
        self.signum = 0
        self.done = threading.Event()
        self.thread = None
        self.clock = None
        self.relay = False  # a warm rank (launcher/ranks/warm/slurm.py): only this wrapper delivers srun's signals
        self.relayed: dict[int, threading.Thread] = {}

    def attach(self, pid: int) -> None:
        self.pid = pid
        if self.signum:
            if self.relay:  # a signal that came while the warm agent forked the rank
                self._relay(self.signum)
            else:
                self._start()

    def _relay(self, signum: int) -> None:
        if signum not in self.relayed:
            self.relayed[signum] = threading.Thread(target=self._deliver, args=(signum,), daemon=True)
            self.relayed[signum].start()

    def on_signal(self, signum, frame) -> None:
        if self.relay:
            # A warm rank is not one of the step's processes: a signal srun sends the step (its end on a failed
            # rank) reaches only this wrapper, so each stop signal is delivered once the rank catches it. A
            # signal sent to the whole job also reaches the rank directly; the engine's handler only sets a flag,
            # so the second copy changes nothing.
            self._relay(signum)
            return
        if self.signum:
            return
        self.signum = signum
        if self.pid:
            self._start()

    def _start(self) -> None:
        if self.thread is None and not catches(self.pid, self.signum):
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if catches(self.pid, self.signum):
                try:
                    os.kill(self.pid, self.signum)
                except OSError:
                    pass
                return
            self.done.wait(FORWARD_POLL_S)

    def on_clock(self, signum: int) -> None:
        """This wrapper's own time-limit stop. Unlike Slurm's signal, nobody else sends it to the child,
        so the child always gets it: at once when its handler is installed, else as soon as it is."""
        if self.clock is not None:
            return
        self.clock = threading.Thread(target=self._deliver, args=(signum,), daemon=True)
        self.clock.start()

    def _deliver(self, signum: int) -> None:
        while not self.done.is_set():
            if self.pid and catches(self.pid, signum):
                try:
                    os.kill(self.pid, signum)
                except OSError:
                    pass
                return
            self.done.wait(FORWARD_POLL_S)


STEP_END_GRACE_S = 2.0
"""In-job restarts only: how long a rank wrapper that got SIGTERM waits for every rank of its step to have
written a record before it concludes that a peer is gone (docs/PERFORMANCE.md: the in-job restart)."""

_ENDED_OK = (EXIT_OK, EXIT_STOPPED, -int(signal.SIGTERM))


def peers_gone(adir: str, world: int) -> list[int]:
    """Ranks of this step that never wrote a record (their node or wrapper is gone) or whose final record
    says they failed."""
    gone = []
    for rank in range(world):
        rec = _read_cause(os.path.join(adir, f"rank_{rank}.json"))
        if not rec or (not rec.get("provisional") and rec.get("exit_code") not in _ENDED_OK):
            gone.append(rank)
    return gone


class _StepEnder:
    """With in-job restarts: after srun's end of a failed step (--kill-on-bad-exit: SIGTERM to the survivors,
    SIGKILL after Slurm's KillWait) a rank blocked in a collective with a peer that is gone can neither save
    nor exit. The restart resumes from the latest complete checkpoint anyway, so this wrapper SIGKILLs its
    rank STEP_END_GRACE_S after the SIGTERM when a peer never wrote a record or failed, instead of waiting
    for KillWait; its record stays the SIGTERM's (what Slurm's SIGKILL would have left). A SIGTERM to the
    whole job (preemption, scancel, the time limit) reaches every rank's wrapper and each writes its
    provisional record at once: then nothing changes and the ranks save as they do without in-job restarts."""

    def __init__(self, adir: str, world: int, pid: int) -> None:
        self.adir, self.world, self.pid = adir, world, pid
        self.gone: list[int] = []
        self.done = threading.Event()  # set once the rank has exited (its pid may be reused)
        self.thread: threading.Thread | None = None

    def on_sigterm(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        deadline = time.time() + STEP_END_GRACE_S
        while not self.done.wait(0.1):
            gone = peers_gone(self.adir, self.world)
            if not gone:
                return  # every rank reported the SIGTERM: the whole job is stopping
            if time.time() >= deadline:
                self.gone = gone
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except OSError:
                    pass
                return


def _read_cause(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_record(path: str, record: dict) -> None:
    write_atomic(path, json.dumps(record))


class _Provisional:
    """The rank's record while it runs: srun (--kill-on-bad-exit) ends the step with TERM, then KILL after Slurm's
    KillWait, and a rank stuck in a collective with a lost peer may not exit in time; a rank that never reported
    would be blamed with the lost node. So a SIGTERM that arrives while the rank runs is recorded at once; the
    rank's own end overwrites it."""

    def __init__(self) -> None:
        self.path = ""
        self.record: dict = {}
        self.ender: _StepEnder | None = None  # with in-job restarts (set once the child runs)

    def on_sigterm(self) -> None:
        if not self.path:
            return
        _write_record(
            self.path,
            {
                **self.record,
                "exit_code": -int(signal.SIGTERM),
                "signal": int(signal.SIGTERM),
                "ended": time.time(),
                "error": "terminated (SIGTERM) while its rank still ran",
            },
        )
        if self.ender is not None:
            self.ender.on_sigterm()


def _numa_binding(cfg: Config, env: dict, rank: int, local_rank: int, node: str) -> tuple[list[str], int | None]:
    """(numactl prefix, NUMA node) of this rank (launcher/ranks/numa.py); the prefix is empty, with a warning, where
    numactl is missing. A bound rank's node goes into its environment (MESHRUN_NUMA_NODE)."""
    numa_node = choose_node(
        cfg.cluster.numa,
        cfg.cluster.numa_map,
        cfg.cluster.device,
        local_rank,
        int(env.get("LOCAL_WORLD_SIZE", "1")),
        env.get("CUDA_VISIBLE_DEVICES"),
        step_gpus=env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"),
    )
    if numa_node is None:
        return [], None
    if not shutil.which("numactl"):
        print(
            f"warning: numactl not found on {node}: rank {rank} is not NUMA-bound "
            f"(install numactl or set cluster.numa=off)",
            file=sys.stderr,
        )
        return [], numa_node
    env["MESHRUN_NUMA_NODE"] = str(numa_node)
    return numactl_prefix(numa_node), numa_node


def _ended_by_the_step(ender: _StepEnder | None, code: int, cause: dict) -> tuple[int, dict]:
    """A rank this wrapper killed after srun's SIGTERM because its step's peers had failed is recorded as that
    SIGTERM (launcher/slurm/requeue.py blames no node for it); any other end as it is."""
    if ender is None or not ender.gone or code != -int(signal.SIGKILL):
        return code, cause
    return -int(signal.SIGTERM), {
        "error": "terminated (SIGTERM) while its rank still ran; ended at once because rank(s) "
        + ", ".join(map(str, ender.gone))
        + " of the step had failed or were gone (no save "
        "possible; the in-job restart resumes from the latest complete checkpoint)"
    }


@dataclass
class RankTask:
    """The pickled callable of a meshrun Slurm job (the same object for every attempt)."""

    run_dir: str
    """The run directory (config.json, checkpoints, events)."""

    def __call__(self) -> int:
        forwarder, provisional = _Forwarder(), _Provisional()
        self._note_stop_signals(forwarder, provisional)
        paths = RunPaths(self.run_dir)
        cfg = load_config(paths.config)
        env = self._rank_env(cfg)
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        prefix, numa_node = _numa_binding(cfg, env, rank, local_rank, node)
        started = time.time()
        attempt = int(env.get("MESHRUN_ATTEMPT", "0"))
        out = paths.attempt(attempt)
        os.makedirs(out, exist_ok=True)
        cause_file = paths.rank_cause(attempt, rank)
        env["MESHRUN_CAUSE_FILE"] = cause_file  # the engine writes its failure's cause there (training/main.py)
        # Where the engine's start-up timeline begins (training/observe/startup.py): srun started this task.
        env[TASK_START_ENV] = f"{process_start_time() or started:.3f}"
        child, start = self._start_rank(cfg, env, rank, node, prefix, numa_node)
        forwarder.relay = start == "warm"
        forwarder.attach(child.pid)
        if in_job.enabled(cfg.cluster):
            provisional.ender = _StepEnder(out, int(env.get("WORLD_SIZE", "1")), child.pid)
        ids = {"rank": rank, "local_rank": local_rank, "node": node}
        provisional.record = {
            **ids,
            "numa_node": numa_node,
            "cause": "",
            "started": started,
            "provisional": True,
            "start": start,
            "pid": child.pid,
            "agent_pid": getattr(child, "agent_pid", None),
        }
        provisional.path = paths.rank_record(attempt, rank)  # after its record: a SIGTERM may come any time
        self._start_clock(env, forwarder, rank)
        code, cause, tail = self._wait(child, forwarder, provisional.ender, cause_file)
        record = {
            **ids,
            "exit_code": code,
            "signal": -code if code < 0 else None,
            "numa_node": numa_node,
            # The engine's own account, uncut, when it wrote one; else the log's last error line.
            "error": (
                ""
                if code in (EXIT_OK, EXIT_STOPPED)
                else cause.get("error") or last_error_line(b"".join(tail).decode("utf-8", "replace"))
            ),
            "cause": cause.get("cause", ""),
            "started": started,
            "ended": time.time(),
            "start": start,  # warm: forked by the node's warm agent (launcher/ranks/warm/slurm.py); cold: started here
            "pid": child.pid,
            "agent_pid": getattr(child, "agent_pid", None),
        }
        provisional.path = ""
        _write_record(paths.rank_record(attempt, rank), record)
        if code in (EXIT_OK, EXIT_STOPPED):
            return code
        raise RankFailed(f"rank {rank} on {node} exited with {code}: {record['error']}")

    def _note_stop_signals(self, forwarder: _Forwarder, provisional: _Provisional) -> None:
        """The preemption signal (USR2) and SIGTERM reach every process of the step. This wrapper must stay alive
        to record how the rank ends, so it only notes them (this also replaces submitit's own handler, which would
        requeue before the save) and forwards them to the child until it exits: the child starts with both
        ignored, so a signal that arrives while it still imports torch is not fatal, and the forwarded copy
        reaches the engine once its handler is installed."""

        def on_signal(signum, frame) -> None:
            forwarder.on_signal(signum, frame)
            if signum == signal.SIGTERM:
                provisional.on_sigterm()

        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, on_signal)
        signal.signal(signal.SIGCONT, lambda *_: None)

    def _rank_env(self, cfg: Config) -> dict:
        """The rank's environment: torch's variables from SLURM_*, its threads within the task's CPUs."""
        dist_env = torch_env_from_slurm(os.environ)
        allotted = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)  # --cpus-per-task (cluster.cpus_per_task)
        threads = threads_per_rank(int(dist_env.get("LOCAL_WORLD_SIZE", "1")), allotted)
        return rank_process_env(dist_env, engine_env(cfg, self.run_dir), threads=threads)

    def _start_rank(self, cfg: Config, env: dict, rank: int, node: str, prefix: list[str], numa_node: int | None):
        """(the rank's process, "warm" | "cold"): forked by the node's warm agent when it can, else started here
        under numactl and, for the ranks train.nsys chose, nsys profile."""
        profile = nsys_prefix(cfg, rank, self.run_dir)
        env[WRAPPER_PID_ENV] = str(os.getpid())
        child = self._start_warm(env, rank, node, numa_node if prefix else None, profile)
        if child is not None:
            return child, "warm"
        cold = subprocess.Popen(
            prefix + profile + [sys.executable, "-m", "training.main", self.run_dir],
            env=env,
            stderr=subprocess.PIPE,
            preexec_fn=_ignore_stop_signals,
        )
        return cold, "cold"

    def _start_clock(self, env: dict, forwarder: _Forwarder, rank: int) -> None:
        """The time-limit stop, on our own clock (Slurm's USR2 is the backup)."""
        stop_at = float(env.get("MESHRUN_STOP_AT") or 0)
        if stop_at:
            timer = threading.Timer(max(0.0, stop_at - time.time()), self._clock_stop, (forwarder, rank, stop_at))
            timer.daemon = True
            timer.start()

    def _wait(self, child, forwarder: _Forwarder, ender: _StepEnder | None, cause_file: str):
        """(exit code, cause, the output's tail) once the rank has ended; its standard error copied through."""
        tail: list[bytes] = []  # the child's last output: its exception line goes into the rank's record
        pump = start_pump(child.stderr, [sys.stderr.buffer], tail)
        code = child.wait()
        forwarder.done.set()
        if ender is not None:
            ender.done.set()
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            # Nothing left to stop; Python's own handler would turn back into "terminate" at exit.
            signal.signal(sig, signal.SIG_IGN)
        pump.join(timeout=5)
        cause = _read_cause(cause_file) if code not in (EXIT_OK, EXIT_STOPPED) else {}
        if getattr(child, "lost", "") and not cause:
            cause = {"error": child.lost}
        code, cause = _ended_by_the_step(ender, code, cause)
        return code, cause, tail

    def _start_warm(self, env: dict, rank: int, node: str, numa_node: int | None, profile: list[str]):
        """The rank forked by this node's warm agent, or None (start it cold): no agents in this job, a rank
        profiled under nsys (it must run under nsys's command), or the agent cannot (the reason is logged and
        recorded as `warm_start_missed`)."""
        if os.environ.get(WARM_ENV) != "1" or profile:
            return None
        child, why = warm_slurm.start(env, self.run_dir, numa_node)
        if child is None:
            print(f"meshrun: rank {rank} on {node} starts cold: {why}", file=sys.stderr)
            append_event(self.run_dir, "warm_start_missed", rank=rank, node=node, reason=why)
        return child

    def _clock_stop(self, forwarder: _Forwarder, rank: int, stop_at: float) -> None:
        if rank == 0:
            append_event(
                self.run_dir,
                "stop_requested",
                source="clock",
                stop_at=stop_at,
                reason="the job's time limit minus cluster.signal_delay_s minus Slurm's 30 s sweep",
            )
        forwarder.on_clock(signal.SIGUSR2)
