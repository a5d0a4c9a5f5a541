"""The warm agent: `python -m training.run.warm_agent RUN_DIR`, one per node of a Slurm allocation
(cluster.warm_start; the batch script starts them in their own srun step, launcher/ranks/warm/slurm.py),
and `python -m training.run.warm_agent --local LAUNCHER_PID RUN_DIR` (its socket's name in MESHRUN_WARM_AGENT_NAME),
one per local launch of world >= 2
(launcher/ranks/warm/local.py): it lives as long as that launcher (SIGTERM when the launcher dies) and forks the
launch's ranks as the launcher would have started them (their own session, the run-directory lock kept open,
default stop signals, SIGTERM when the launcher's connection closes).

It imports torch, torch.distributed and the engine's modules once, then forks every rank of every training
step of the allocation on its node (the first step's, each in-job restart's, a spare's when it takes a lost
node's place): a rank starts with its interpreter up and its modules imported, instead of paying a Python start
and torch's import again, and the rendezvous no longer waits for the slowest rank's import
(docs/PERFORMANCE.md: the in-job restart). The forked rank then runs `training.main` exactly as a rank started
by its wrapper: the wrapper's environment, working directory, umask, CPU affinity and NUMA binding, standard
streams, stop signals ignored until the engine installs its handler, the same module run as __main__
(sitecustomize run again, sys.argv and sys.orig_argv as `python -m training.main RUN_DIR`), and its exit code
goes back to the wrapper (training/contract/warm_start.py).

Why a fork from here is safe: the agent imports modules and initialises nothing. No process group, no CUDA
(torch.cuda is never asked anything; PYTORCH_NVML_BASED_CUDA_CHECK=1 keeps even a device count off the
driver: a CUDA context or a driver initialised before fork() is unusable in the child), no thread (checked
from /proc/self/task before it serves: a fork copies only the forking thread, and a lock another thread held
would stay locked in the child); its own state (a selector, the sockets) is closed in the child. When any of
this does not hold the agent does not serve, says why (`warm_agent` event), and the ranks start cold.
"""

from __future__ import annotations

import importlib
import io
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

from training.contract.rundir.events import append_event
from training.contract.warm_start import (
    AGENT_NAME_ENV,
    AGENT_PID_ENV,
    FDS,
    MAX_FDS,
    PAD_ENV,
    recv,
    send,
    socket_name,
)

WARM_MODULES = (
    "torch",
    "torch.distributed",
    "training.main",
    "training.run.loop",
    "training.parallel.mesh",
    "training.preflight.runner",
    "training.checkpoint.lean_read",
    "training.observe.oom",
)
"""What a rank imports before its first step (training/main.py and the Trainer), imported once per node. Not the
distributed-checkpoint package (DCP, with the DTensor code it pulls in: about a third of this list's import
while it was on it, docs/PERFORMANCE.md): a resume reads through lean_read without it, and a rank imports the save path in the
background after its first step (CheckpointManager.prewarm), so on a requeue's path it would only delay the
first fork."""

REQUEST_TIMEOUT_S = 10.0
"""A connected wrapper sends its request at once; one that does not is dropped instead of stalling the agent."""


def native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def warm_up() -> str:
    """Import the rank's modules; "" when the process is still fork-safe, else why not."""
    from training.run.import_gc import imports_without_gc

    with imports_without_gc():
        for name in WARM_MODULES:
            importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialised while importing the engine (a forked rank could not use it)"
    threads = native_threads()
    if threads != 1:
        return f"{threads} threads run after the imports (a fork copies only one)"
    return ""


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


REQUEST_FIELDS = {
    "env": dict,
    "run_dir": str,
    "cwd": str,
    "umask": int,
    "affinity": (list, type(None)),
    "numa_node": (int, type(None)),
    "python": str,
}
"""The fields of a request and their JSON types (training/contract/warm_start.py)."""


def malformed(req: Any) -> str:
    """Why a request is not one a client of this version sends, else "": the agent serves every rank of its node
    and must outlive a bad one."""
    if not isinstance(req, dict):
        return f"the request is a {type(req).__name__}, not an object"
    for key, kind in REQUEST_FIELDS.items():
        if key not in req and key in ("env", "run_dir", "cwd", "umask"):
            return f"the request has no {key!r}"
        if key in req and (not isinstance(req[key], kind) or isinstance(req[key], bool)):
            return f"the request's {key!r} is not a {getattr(kind, '__name__', 'valid value')}"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in req["env"].items()):
        return "the request's 'env' holds values that are not strings"
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in req.get("affinity") or []):
        return "the request's 'affinity' holds values that are not CPU numbers"
    return ""


def _closed_by_peer(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _stream(fd: int, errors: str) -> io.TextIOWrapper:
    """An unbuffered text stream on fd, as PYTHONUNBUFFERED=1 (the ranks' setting) makes them."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors=errors, write_through=True, line_buffering=True
    )


def _bind_numa(node: int) -> str | None:
    """What `numactl --cpunodebind=N --membind=N` does for a cold rank: CPUs of the node, memory from it
    (set_mempolicy MPOL_BIND). Memory the agent touched before the fork stays where it is. None when done."""
    from training.contract.slurm_env import numa_node_cpus

    try:
        os.sched_setaffinity(0, numa_node_cpus(node))
    except (OSError, ValueError) as exc:
        return f"CPU binding to NUMA node {node} failed: {exc}"
    import ctypes
    import platform

    number = {"x86_64": 238, "aarch64": 237}.get(platform.machine())
    if number is None:
        return f"memory binding to NUMA node {node} not done on {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 2, mask, ctypes.c_ulong(words * 64 + 1)) != 0:  # MPOL_BIND
        return f"memory binding to NUMA node {node} failed: errno {ctypes.get_errno()}"
    return None


def _watch_wrapper(conn: socket.socket, signum: int = signal.SIGKILL) -> None:
    """In the rank: its wrapper closed the connection (it died, or srun's step ended it): the rank goes too, as
    a rank started by its wrapper goes with the srun step (SIGKILL). A local launcher's rank gets SIGTERM, its
    own stop path, as a cold one does when its launcher dies (training/run/launcher_watch.py)."""
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signum)


def _rewrite_proc_block(which: str, strings: list[str]) -> bool:
    """Write strings over this process's command line (which="arg") or initial environment ("env") as the
    kernel shows them in /proc/PID/cmdline and /proc/PID/environ, NUL-padded; False (left as it is) when they
    do not fit. A forked rank otherwise shows its agent's, and `ps`, `pgrep -f training.main` and the tools that
    find a run's ranks by their command line and environment would not see it as the rank it is."""
    first = {"arg": 45, "env": 47}[which]  # arg_start/arg_end, env_start/env_end: fields 48-51 of proc(5)'s stat
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[first]), int(fields[first + 1])
        data = b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in strings)
        if start <= 0 or len(data) > end - start:
            return False
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data.ljust(end - start, b"\0"))
        return True
    except (OSError, ValueError, IndexError):
        return False


def _set_parent_death_signal(signum: int) -> bool:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


class Agent:
    def __init__(self, run_dir: str, name: str, local: bool = False) -> None:
        self.run_dir = run_dir
        self.local = local
        self.pid = os.getpid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(name)  # before the imports: a rank that asks now waits for them instead of starting cold
        self.listener.listen(256)
        self.children: dict[int, socket.socket] = {}
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        self.sel = sel
        while not (self.stopping and not self.children):
            if self.stopping and self.listener.fileno() >= 0:
                sel.unregister(self.listener)
                self.listener.close()  # a rank that asks now starts cold at once
            for key, _ in sel.select(timeout=1.0):
                if key.fileobj is self.listener and not self.stopping:
                    self._accept()
                elif key.fileobj == self.wake_r:
                    try:
                        while os.read(self.wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
            self._reap()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            if _peer_uid(conn) != os.getuid():
                conn.close()
                return
            req, fds = recv(conn, with_fds=True, timeout=REQUEST_TIMEOUT_S)
            conn.settimeout(None)
        except (OSError, EOFError, ValueError) as exc:
            print(f"meshrun warm agent: a request was dropped: {exc}", file=sys.stderr)
            conn.close()
            return
        try:
            why = malformed(req)
            if why:
                print(f"meshrun warm agent: a request was dropped: {why}", file=sys.stderr)
            elif len(fds) not in (FDS, MAX_FDS):
                why = f"{len(fds)} file descriptors sent, {FDS} or {MAX_FDS} needed"
            elif req.get("python", sys.executable) != sys.executable:
                # Another interpreter (another virtual environment) would import other code than this one's.
                why = f"the rank's python {req.get('python')} is not the agent's {sys.executable}"
            if why or _closed_by_peer(conn):
                if why:
                    try:
                        send(conn, {"error": why})
                    except OSError:
                        pass  # the client is gone already
                conn.close()
                return
            self._fork(conn, req, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _fork(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            self._become_rank(conn, req, fds)  # ends in SystemExit (the rank's exit) or os._exit
        self.children[pid] = conn
        try:
            send(conn, {"pid": pid, "agent_pid": self.pid})
        except OSError:
            pass  # the wrapper is gone: the rank sees its connection closed and ends

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()

    # ------------------------------------------------------------------------------------------ in the child
    def _become_rank(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
        try:
            self._setup_rank(conn, req, fds)
        except BaseException:  # noqa: BLE001 - the rank could not be set up: its wrapper gets exit 1
            traceback.print_exc()
            os._exit(1)
        try:
            for hook in ("sitecustomize", "usercustomize"):  # run at every interpreter start: once per rank
                if hook in sys.modules:
                    importlib.reload(sys.modules[hook])
            runpy.run_module("training.main", run_name="__main__", alter_sys=True)
        except SystemExit:
            raise
        except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
            traceback.print_exc()
            raise SystemExit(1) from None
        raise SystemExit(0)

    def _setup_rank(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
        # The agent's own state goes first: its signal wiring, selector and sockets.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            # As a cold rank starts: a Slurm rank wrapper's ignores them until the engine installs its handler,
            # a local launcher's has the defaults (the launcher signals only a rank that has its handler).
            signal.signal(sig, signal.SIG_DFL if self.local else signal.SIG_IGN)
        self.sel.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for other in self.children.values():
            other.close()
        for i, fd in enumerate(fds[:FDS]):
            os.dup2(fd, i)
            os.close(fd)
        for fd in fds[FDS:]:
            os.set_inheritable(fd, True)  # kept open (a local launch's run-directory lock), as Popen's pass_fds
        fds.clear()  # closed here: the agent's own cleanup of them (in _accept) must not close the rank's files
        if self.local:
            os.setsid()  # a session of its own, as the local launcher starts a cold rank (Ctrl-C reaches it only)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = _stream(1, "strict")
        sys.stderr = sys.__stderr__ = _stream(2, "backslashreplace")
        os.chdir(req["cwd"])
        os.umask(int(req["umask"]))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in req["env"].items()})
        os.environ[AGENT_PID_ENV] = str(self.pid)
        affinity = set(req.get("affinity") or [])
        if affinity:
            os.sched_setaffinity(0, affinity)
        if req.get("numa_node") is not None:
            problem = _bind_numa(int(req["numa_node"]))
            if problem:
                print(f"warning: rank {os.environ.get('RANK')}: {problem}", file=sys.stderr)
        lost = signal.SIGTERM if self.local else signal.SIGKILL
        threading.Thread(target=_watch_wrapper, args=(conn, lost), daemon=True, name="wrapper-watch").start()
        run_dir = req["run_dir"]
        sys.argv = [sys.modules["training.main"].__file__ or "training/main.py", run_dir]
        # Run as __main__ from its source, as `python -m` does (its imports are the agent's, already loaded).
        del sys.modules["training.main"]
        sys.orig_argv = [sys.executable, "-m", "training.main", run_dir]
        # As the kernel shows a cold rank: `ps`, `pgrep -f training.main`, action=cancel and the tests find ranks so.
        _rewrite_proc_block("arg", sys.orig_argv)
        _rewrite_proc_block("env", [f"{k}={v}" for k, v in os.environ.items()])
        from training.observe import startup

        startup._MARKS.clear()


def main(argv: list[str]) -> int:
    local = bool(argv) and argv[0] == "--local"
    local_name = os.environ.pop(AGENT_NAME_ENV, "")
    if len(argv) != (3 if local else 1) or (local and (not argv[1].isdigit() or not local_name)):
        print(
            "usage: python -m training.run.warm_agent RUN_DIR\n"
            f"       {AGENT_NAME_ENV}=NAME python -m training.run.warm_agent --local LAUNCHER_PID RUN_DIR",
            file=sys.stderr,
        )
        return 2
    run_dir = os.path.abspath(argv[-1])
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the job's stop signal is the ranks' (they get it themselves)
    stop: dict[str, Any] = {"agent": None, "early": False}

    def on_term(signum, frame) -> None:
        # The allocation (or the local launch) ends: no new rank; leave once the running ones are reaped.
        stop["early"] = True
        if stop["agent"] is not None:
            stop["agent"].stopping = True

    signal.signal(signal.SIGTERM, on_term)
    if local:
        # Lives as long as its launcher: SIGTERM (on_term) when it dies, however it dies.
        if not _set_parent_death_signal(signal.SIGTERM) or os.getppid() != int(argv[1]):
            return 0  # the launcher is already gone (or cannot be followed): its ranks start cold
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    os.environ.pop(PAD_ENV, None)  # its room stays in the process's initial environment block, not in its ranks'
    # numpy's OpenBLAS starts its thread pool when it is loaded (torch imports numpy): one thread keeps the agent
    # fork-safe; the engine's own threads are torch's, set per rank (training/main.py).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    t0 = time.time()
    try:
        name = "\0" + local_name if local else socket_name(dict(os.environ), node)  # env holds no NUL
        agent = Agent(run_dir, name, local)
    except OSError as exc:
        append_event(run_dir, "warm_agent", node=node, pid=os.getpid(), ready=False, reason=f"cannot listen: {exc}")
        return 0
    stop["agent"] = agent
    if stop["early"]:
        return 0  # stopped before it served: the ranks (if any asked) start cold
    try:
        problem = warm_up()
    except Exception as exc:  # noqa: BLE001 - said in the event; the ranks start cold and show the real error
        problem = f"importing the engine failed: {type(exc).__name__}: {exc}"
    import_s = round(time.time() - t0, 3)
    append_event(
        run_dir, "warm_agent", node=node, pid=os.getpid(), ready=not problem, reason=problem, import_s=import_s
    )
    if problem:
        print(f"meshrun warm agent on {node}: not serving ({problem}); the ranks start cold", file=sys.stderr)
        agent.listener.close()
        return 0
    agent.serve()
    return 0


if __name__ == "__main__":
    # The agent's end is on a requeue's path: Slurm requeues the job once every process of it has ended, and
    # the interpreter's finalisation with torch loaded took about a second (training/run/quick_exit.py). A rank
    # forked from here never gets this far: it ends in training.main's own exit (or a SystemExit raised
    # through main(), which exits the usual way).
    from training.run.quick_exit import exit_without_finalising

    exit_without_finalising(main(sys.argv[1:]))
