"""Rank entry point: `python -m training.main RUN_DIR`.

Reads RUN_DIR/config.json, joins the job from the standard env (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID fill them when absent),
builds the mesh, model, optimizer and data, and trains. Exit codes (docs/CONTRACTS.md): 0 finished,
3 stopped early after a checkpoint, 2 invalid config or data, anything else a failure.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_OK, EXIT_STOPPED
from training.contract.rundir.files import write_atomic
from training.contract.rundir.paths import RunPaths
from training.run.quick_exit import exit_without_finalising


def _env_from_slurm() -> None:
    """Map Slurm's task variables onto the standard ones when a launcher did not set them."""
    from training.contract.slurm_env import apply_slurm_env

    apply_slurm_env()  # also MASTER_ADDR (first node) and MASTER_PORT (from the job id)
    for std, slurm in (
        ("RANK", "SLURM_PROCID"),
        ("WORLD_SIZE", "SLURM_NTASKS"),
        ("LOCAL_RANK", "SLURM_LOCALID"),
        ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"),
    ):
        if std not in os.environ and slurm in os.environ:
            os.environ[std] = os.environ[slurm].split("(")[0]


def _single_process_env() -> None:
    """`python -m training.main RUN_DIR` by hand: a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _claim_run_dir(run_dir: str) -> str:
    """ "" when run_dir belongs to this rank's job (training/contract/rundir/lock.py), else why not."""
    from training.contract.rundir.lock import check_rank
    from training.contract.slurm_env import slurm_job_id

    return check_rank(run_dir, slurm_job_id()) or ""


def _is_save_failure(exc: BaseException) -> bool:
    """A checkpoint that could not be written (disk full, I/O error), as opposed to one that cannot be read."""
    return bool(getattr(exc, "during_save", False)) or str(exc).startswith("saving checkpoint")


def _record_cause(cause: str, message: str) -> None:
    """How this rank failed, in full, for the Slurm epilogue (launcher/slurm/rank_task.py sets the path):
    the log's last line is cut and cannot tell a failed save from a bug."""
    path = os.environ.get("MESHRUN_CAUSE_FILE")
    if not path:
        return
    import json

    try:
        write_atomic(path, json.dumps({"cause": cause, "error": message}))
    except OSError:
        pass


_ENGINE_IMPORTS = (
    "training.checkpoint.storage",
    "training.contract.config",
    "training.contract.layout_rules",
    "training.data",
    "training.hf.hf_config",
)
"""What the rank imports before it reads its config (the modules whose errors main() turns into exit codes)."""


def _start_process() -> None:
    """Before the config is read: the launcher watch, the rank's environment, and the engine's imports."""
    from training.run.launcher_watch import follow_launcher

    follow_launcher()  # a local launcher's rank stops (after a checkpoint) when that launcher dies
    _env_from_slurm()
    _single_process_env()

    from training.run.import_gc import imports_without_gc

    with imports_without_gc():  # a rank forked by a warm agent has these already (imported the same way)
        import torch

        for name in _ENGINE_IMPORTS:
            importlib.import_module(name)
        from training.observe.startup import mark

    mark("imported")  # torch and the engine's modules

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(max(1, int(threads)))


def _read_config(run_dir: str):
    """RUN_DIR/config.json, once this rank's job owns the directory; an exit code when not."""
    from training.contract.config import load_config

    try:
        cfg = load_config(RunPaths(run_dir).config)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        print(
            f"error: cannot read {run_dir}/config.json: {exc}; run through `meshrun`, which writes it", file=sys.stderr
        )
        return EXIT_INVALID
    cfg.run.dir = run_dir
    problem = _claim_run_dir(run_dir)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        _record_cause("invalid", problem)
        return EXIT_INVALID
    from training.contract.rundir.resume_request import effective_resume

    # Read before the process group exists (its rendezvous waits for every rank), so that rank 0 marks the
    # request consumed only after every rank has read it (training/contract/rundir/resume_request.py).
    cfg.train.resume = effective_resume(run_dir, cfg.train.resume)
    # No checkpoint code is imported ahead here: a resume reads the checkpoint without DCP
    # (training/checkpoint/lean_read.py), and the save path is imported once the first step is done.
    return cfg


class _Attempt:
    """This rank's training: the mesh, the preflight gate, the trainer, and the exit code of what went wrong."""

    def __init__(self, cfg, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.mesh = None
        self.states_bytes: int | None = None  # GPU memory held once the engine is built: the model states (oom.py)
        self.built = False

    def train(self) -> int:
        import torch

        from training.contract.config import derived_dp
        from training.observe.startup import mark
        from training.parallel.mesh import ProcessMesh
        from training.run.loop import Trainer

        cfg, p = self.cfg, self.cfg.parallel
        backend = "nccl" if cfg.cluster.device == "cuda" else "gloo"
        self.mesh = mesh = ProcessMesh.from_env(
            p.tp, p.pp, p.cp, derived_dp(cfg), backend, cfg.train.dist_timeout_s, ep=p.ep
        )
        from training.contract.slurm_env import reapply_affinity

        mark("process_group")
        if reapply_affinity():  # a communicator reset the NUMA binding the launcher set
            print(
                f"note: rank {os.environ.get('RANK')}: NUMA affinity re-applied after process-group setup",
                file=sys.stderr,
            )
        from training.preflight.runner import before_training

        before_training(cfg, self.run_dir)  # cluster.preflight.mode gate: a bad node exits 4 before training
        mark("preflight")
        trainer = Trainer(cfg, self.run_dir, mesh, checkpointing=cfg.train.checkpointing)
        mark("built")  # model, optimizer, data
        self.built = True
        if mesh.device.type == "cuda":
            self.states_bytes = torch.cuda.memory_allocated(mesh.device)
        return trainer.run()

    def failed(self, exc: Exception) -> int:
        """The exit code of `exc`, its message printed and its cause recorded (called in its except block)."""
        import torch

        from training.checkpoint.storage import CheckpointError
        from training.contract.layout_rules import LayoutError
        from training.data import DataError
        from training.hf.hf_config import HFError

        if isinstance(exc, CheckpointError):
            print(f"error: {exc}", file=sys.stderr)
            if _is_save_failure(exc):
                # Storage, not the user's input: the previous checkpoint is intact, so the job may requeue from it.
                _record_cause("save_failed", str(exc))
                return EXIT_FAILED
            _record_cause("invalid", str(exc))
            return EXIT_INVALID
        if isinstance(exc, (DataError, LayoutError, HFError)):  # the user's to fix: retrying cannot help
            print(f"error: {exc}", file=sys.stderr)
            _record_cause("invalid", str(exc))
            return EXIT_INVALID
        if isinstance(exc, torch.cuda.OutOfMemoryError):  # which part overflowed, and the levers that fit it
            message = self._oom_message(exc)
            print(f"error: {message}", file=sys.stderr)
            _record_cause("oom", message)
            return EXIT_FAILED
        traceback.print_exc()
        # A Python exception is the program's or its input's, not evidence against the node it ran on.
        _record_cause("exception", f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED

    def _oom_message(self, exc: Exception) -> str:
        import torch

        from training.observe.oom import explain
        from training.preflight.runner import node_name

        mesh = self.mesh
        capacity = (
            torch.cuda.get_device_properties(mesh.device).total_memory
            if mesh is not None and mesh.device.type == "cuda"
            else None
        )
        rank = int(os.environ.get("RANK", 0))
        return explain(self.cfg, self.run_dir, exc, self.states_bytes, capacity, rank, node_name(), built=self.built)

    def close(self) -> None:
        if self.mesh is not None:
            try:
                self.mesh.destroy()
            except Exception:  # a peer already gone at exit must not turn success into failure
                pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m training.main RUN_DIR   (RUN_DIR holds config.json)", file=sys.stderr)
        return EXIT_INVALID
    run_dir = os.path.abspath(argv[0])
    _start_process()
    cfg = _read_config(run_dir)
    if isinstance(cfg, int):
        return cfg
    attempt = _Attempt(cfg, run_dir)
    try:
        code = attempt.train()
    except Exception as exc:
        return attempt.failed(exc)
    attempt.close()
    return code


if __name__ == "__main__":
    exit_code = int(main() or 0)
    if exit_code in (EXIT_OK, EXIT_STOPPED, EXIT_INVALID):
        # EXIT_INVALID too, once its message is printed and its cause recorded: the interpreter's finalisation
        # with libtorch loaded sometimes ended a refusal in std::terminate ("terminate called without an active
        # exception", SIGABRT), which the launchers read as a signal death that implicates the node.
        exit_without_finalising(exit_code)
    # A program failure exits the usual way: the launchers blame the rank that ended first, and a peer that fails
    # only because this rank left its collectives must not overtake it in a quick exit of its own.
    sys.exit(exit_code)
