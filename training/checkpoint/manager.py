"""CheckpointManager: what the training loop calls to save, resume, and say when a save is due.

Loop usage (every rank, same order):
    ckpt = CheckpointManager(run_dir, mesh, cfg)
    resumed = ckpt.maybe_resume(model_chunks, optimizer, extra)   # None or (step, consumed_samples)
    for step in ...:
        ... train one step ...
        due, stop = rule.decide(step)          # training/run/stop.py: ckpt.step_due / time_due and the stop
                                               # reasons, agreed over all ranks; stop is None or a reason
        if due or stop or step == last:
            ckpt.save(step, model_chunks, optimizer, extra, reason=stop or ("final" if step == last else "interval"))
        if stop or step == last: ckpt.wait()   # then exit with EXIT_STOPPED (3) when stopping
    and in each step, right before the optimizer changes the parameters or its state:
        ckpt.wait_staged()                     # an async save's host copy is complete (a no-op otherwise)

`step` is the number of completed optimizer steps. `extra` is a JSON-serialisable dict owned by the loop and
must hold "consumed_samples"; anything else in it (loss scaler, data position, ...) is saved and restored
in place. Per-rank RNG states (python, numpy, torch, cuda) are handled here.

The optimizer (training/optim/optimizer.py `DistributedOptimizer`) is saved and restored only through its
`state_dict()` / `load_state_dict()`: per parameter, the slice of each state tensor this rank holds and where
it starts in the parameter, plus the scalars step_count, loss_scale and good_steps.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from training.checkpoint import storage
from training.checkpoint.files import CheckpointFiles
from training.checkpoint.layout import Piece, exact_storage, param_info, pieces_for, to_load_state_dict, to_state_dict
from training.checkpoint.staging import HostStager
from training.checkpoint.storage import CheckpointError
from training.contract.config import Config, ModelConfig, checkpoint_minutes, config_to_dict
from training.contract.rundir.events import append_event
from training.contract.stage_split import SPLIT_KEYS, stage_split
from training.optim import SCALARS
from training.optim.model_parallel import TIED_EMBEDDING
from training.parallel import collectives as comm
from training.parallel.mesh import ProcessMesh

# Model fields that change a parameter's shape (or meaning): a checkpoint cannot load across them.
SHAPE_FIELDS = storage.SHAPE_FIELDS
MOE_SHAPE_FIELDS = ("num_experts", "moe_ffn_hidden_size")
"""Mixture-of-experts fields that change parameters (absent from checkpoints written before them: dense)."""

warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")


@dataclass
class SaveStats:
    """Timing of one save."""

    step: int
    """Step saved."""
    reason: str
    """Why: interval (train.checkpoint_every or _min) | final | exit_interval | exit_after_min | SIGTERM | SIGUSR2."""
    blocked_s: float = 0.0
    """Seconds the training loop was blocked (sync: the whole save; async: the save() call plus the wait at
    the staging barrier, wait_staged, for the copy to host memory that runs during the next forward/backward)."""
    total_s: float = 0.0
    """Seconds from the start of the save until the checkpoint was committed."""
    bytes: int = 0
    """Size of the committed checkpoint directory."""


@dataclass
class _Pending:
    """An asynchronous save still copying or writing."""

    stats: SaveStats
    tmp_dir: str
    info: dict[str, Any]
    started: float
    staged: Future = field(default_factory=Future)
    """Done once the state is copied to host memory."""
    waited: bool = False
    """The loop has passed wait_staged() for this save (its wait is in stats.blocked_s)."""
    future: Future | None = None
    """The background job (copy, write, and on rank 0 the commit): its result is rank 0's error or None."""


def _dcp():
    """torch.distributed.checkpoint and its exception type, imported on the first save or load: with the
    DTensor code it pulls in, about 1.1 s of CPU per rank that a fresh start need not pay before its first
    step (training/observe/startup.py); DCP's exception is a BaseException, caught beside Exception."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    return dcp, CheckpointException


def import_save_path() -> tuple[Any, ...]:
    """Import every module a save needs that the engine's start does not (DCP and the DTensor code it pulls
    in, the ShardedTensor wrapping of training/checkpoint/layout.py, the CRC writer): about a second of CPU
    per rank. `CheckpointManager.prewarm` runs it on a background thread once training runs, so that a save
    at a preemption signal, which is on the critical path to the requeue, does not pay for it."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor  # layout.to_state_dict's imports
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

    from training.checkpoint.crc_writer import CrcFileSystemWriter

    return _dcp(), ShardedTensor, ShardedTensorMetadata, CrcFileSystemWriter


def _rank0_print(msg: str) -> None:
    if not comm.is_initialized() or comm.rank() == 0:
        print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)


def _named_params(model_chunks) -> list[tuple[str, torch.Tensor]]:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    out, seen = [], set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The rank's own device only: every visible GPU's state would not restore under a binding that shows
        # this rank fewer GPUs (set_rng_state_all raises IndexError), and the others are other ranks' business.
        state["cuda_device"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda_device"], dtype=torch.uint8))
    elif "cuda" in state:  # a checkpoint of an earlier version: every visible GPU's state, by index
        index = torch.cuda.current_device()
        if index < len(state["cuda"]):
            torch.cuda.set_rng_state(torch.tensor(state["cuda"][index], dtype=torch.uint8))


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")


def _short(exc: BaseException) -> str:
    """One line for an error. DCP wraps rank failures with whole tracebacks: keep the innermost error's
    line ("UnpicklingError: ...", not the hints some errors append), else the last line."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    line = errors[-1] if errors else (lines[-1] if lines else "")
    # torch.load's weights_only error goes on to advise weights_only=False: keep its first sentence and the
    # unpickler's reason only. Every other message is kept whole (cutting at the first ". " lost torch.save's
    # "[enforce fail at inline_container.cc:N] . unexpected pos" on a full disk).
    text = str(exc)
    if "Weights only load failed" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else ""
        reason = next((ln.strip() for ln in reason.splitlines() if ln.strip()), "")
        head = line.split("Weights only load failed")[0] if "Weights only load failed" in line else ""
        line = f"{head}Weights only load failed (refused by torch.load(weights_only=True): {reason[:200]})"
    return f"{type(exc).__name__}: {line[:500]}"


# Less free space than this on run.dir's filesystem right after a failed write: the disk is full, whatever
# the writer's own message says (torch's zip writer reports "unexpected pos", never ENOSPC).
_FULL_BYTES = 1 << 20


def _disk_full_note(path: str, error: str) -> str:
    """ " [ENOSPC: ...]" when a save failed on a (nearly) full filesystem and its message does not say so."""
    if "No space left" in error or "ENOSPC" in error:
        return ""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f" [ENOSPC: {free} bytes free on the filesystem of {path}]" if free < _FULL_BYTES else ""


def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def _use_device(device: torch.device) -> None:
    """A new thread's CUDA device is GPU 0 whatever the training thread set: the save thread's first CUDA
    call (the staging copy) would open a context on GPU 0, on every local rank of the node."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def writer_thread(device: torch.device) -> ThreadPoolExecutor:
    """The async save's one long-lived thread, on this rank's device."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="checkpoint-save", initializer=_use_device, initargs=(torch.device(device),)
    )


RANK_STATE_MAX = 64 << 20
"""The largest rank_state/<rank> record a resume reads (a rank's RNG state in JSON: some kB)."""


class CheckpointManager:
    """Saves and restores the whole training state of this rank as one part of a sharded DCP checkpoint."""

    def __init__(self, run_dir: str, mesh: ProcessMesh, cfg: Config, log=_rank0_print):
        self.run_dir, self.mesh, self.cfg, self.log = run_dir, mesh, cfg, log
        self.distributed = comm.is_initialized()
        self.rank = comm.rank() if self.distributed else 0
        self.world = comm.world_size() if self.distributed else 1
        # Whether this rank does rank 0's part of the files (the temporary directory's name, the sealing, the
        # candidates) and broadcasts it: rank 0; and every rank under a backend that moves no data (the
        # rehearsal's, training/rehearse/runner.py), where a broadcast leaves each rank its own value and each
        # rank's `files` stand for the job's shared checkpoint directory.
        self._rank0_part = self.rank == 0 or comm.moves_no_data()
        self.keep_last = max(1, cfg.train.keep_last)
        self.async_save = bool(cfg.train.async_save)
        # The background write runs DCP's collectives from its own thread; the mesh's dedicated gloo group
        # keeps them from interleaving with the training's collectives on the default group.
        self._async_group = mesh.background_group if (self.async_save and self.distributed) else None
        # Every checkpoint phase's collective (DCP's, the commit's outcome, the resume's checks) runs on the
        # mesh's gloo background group, under its own timeout (training/parallel/mesh.py from_env checkpoint_timeout_s):
        # with zero=0, dp rank 0 writes all replicated state while the others wait.
        self._ckpt_group = mesh.background_group if self.distributed else None
        # Async saves: host buffers kept from one save to the next (staging.py), and one long-lived thread
        # that copies, writes and commits each save in turn (no thread is started per save). Its thread is
        # joined at interpreter exit, so a pending save is committed before the process ends.
        self._stager = HostStager() if self.async_save else None
        # Every file the manager writes or reads goes through this object (training/checkpoint/files.py); the
        # rehearsal replaces it with one that records and writes nothing (training/rehearse/runner.py).
        self.files = CheckpointFiles()
        self._writer_thread = writer_thread(mesh.device) if self.async_save else None
        self._prewarm_thread: threading.Thread | None = None  # prewarm()'s import thread
        # Set by the first wait_staged(): the caller has a barrier before it changes the state, so an async
        # save may return before its host copy is complete (the copy then overlaps the next forward/backward).
        self._has_barrier = False
        self._pending: _Pending | None = None
        self.history: list[SaveStats] = []
        self.last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        if self.rank == 0:
            os.makedirs(storage.checkpoints_dir(run_dir), exist_ok=True)
        # train.checkpoint_replica_dir: rank 0 copies each sealed checkpoint there in the background
        # (training/checkpoint/replica.py) and resumes from that copy when the primary is damaged.
        self._replica = None
        if cfg.train.checkpoint_replica_dir and self.rank == 0:
            from training.checkpoint.replica import Replicator

            self._replica = Replicator(run_dir, cfg.train.checkpoint_replica_dir, self.keep_last)

    # ----- collectives -----------------------------------------------------------------------------
    def _bcast(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        comm.broadcast_object_list(box, src=0, group=self._ckpt_group)
        return box[0]

    # ----- cadence ---------------------------------------------------------------------------------
    def step_due(self, step: int) -> bool:
        """train.checkpoint_every says the boundary after `step` saves (the same answer on every rank)."""
        every = self.cfg.train.checkpoint_every
        return every > 0 and step > 0 and step % every == 0

    def time_due(self, now: float) -> bool:
        """train.checkpoint_every_min has passed since the last save by this rank's clock (monotonic seconds
        `now`); training/run/stop.py agrees the answer over all ranks."""
        minutes = checkpoint_minutes(self.cfg)  # resolved by the launcher (train.checkpoint_every_min=auto)
        return minutes > 0 and (now - self._last_save_time) >= 60 * minutes

    # ----- the sharding description ----------------------------------------------------------------
    def _pieces(self, model_chunks, opt_state: dict[str, Any] | None, for_save: bool) -> list[Piece]:
        """Every tensor of this rank's state (model, and the optimizer's state_dict) as placed pieces;
        for saving, replicas are left out."""
        mesh, V = self.mesh, self.cfg.model.vocab_size
        tp_rank = mesh.tp_rank
        dp_rank = mesh.dp_rank + mesh.cp_rank  # cp replicas: cp rank 0 writes
        first_stage = mesh.pp_rank == 0

        # An expert's replicas are the expert-dp group's ranks (training/model/moe.py): its rank 0 writes.
        edp_rank = mesh.edp_rank

        def owner(name: str, p: torch.Tensor, replicated_over_dp: bool) -> bool:
            if not for_save:
                return True
            if replicated_over_dp and (edp_rank if getattr(p, "expert_parallel", False) else dp_rank) != 0:
                return False
            if getattr(p, "tp_shard_dim", None) is None and tp_rank != 0:
                return False
            # The last stage's copy of the tied embedding: the first stage writes it.
            return not (name == TIED_EMBEDDING and not first_stage)

        pieces: list[Piece] = []
        # zero=3: the model is saved and loaded from each rank's own flat shard of the values (distinct over
        # dp, as optimizer state is), never from gathered parameters: no rank ever holds the whole model.
        model_shards = (opt_state or {}).get("model_shards") or []
        sharded = set((opt_state or {}).get("sharded_params") or [])
        for name, p in _named_params(model_chunks):
            if name not in sharded and owner(name, p, True):
                info = param_info(name, p, tp_rank, V)
                pieces += pieces_for(f"model/{name}", info, p.detach().view(-1), 0)
        for shard in model_shards:
            if owner(shard.name, shard.param, False):
                info = param_info(shard.name, shard.param, tp_rank, V)
                pieces += pieces_for(f"model/{shard.name}", info, shard.tensors["model"], shard.param_start)
        if opt_state is not None:
            for shard in opt_state["params"]:
                if not owner(shard.name, shard.param, opt_state["replicated_over_dp"]):
                    continue
                info = param_info(shard.name, shard.param, tp_rank, V)
                for state, tensor in shard.tensors.items():
                    pieces += pieces_for(f"optim/{state}/{shard.name}", info, tensor, shard.param_start)
        return pieces

    def prewarm(self) -> None:
        """Import the save path in the background (import_save_path), once: the loop calls it after the
        first step, so the start-up before that step does not share its CPU with the import."""
        if self._prewarm_thread is not None:
            return
        self._prewarm_thread = threading.Thread(target=import_save_path, name="meshrun-checkpoint-import", daemon=True)
        self._prewarm_thread.start()

    # ----- save ------------------------------------------------------------------------------------
    def save(
        self, step: int, model_chunks, optimizer, extra_state: dict[str, Any], reason: str = "interval"
    ) -> SaveStats:
        """Write a complete checkpoint of `step` (collective).

        Async: returns once the state is copied to host memory, or, for a caller that has the staging barrier
        (see wait_staged), once that copy has started; the write and the commit run in the background, and
        wait() waits for them."""
        self.wait()
        if self.last_saved_step == step:
            return self.history[-1]
        t0 = time.monotonic()
        tmp = self._bcast(storage.new_tmp_dir(self.run_dir, step) if self._rank0_part else None)
        opt_state = optimizer.state_dict() if optimizer is not None else None
        pieces = self._pieces(model_chunks, opt_state, for_save=True)
        if self._stager is not None:  # async: the pieces become host buffers, filled in the background
            pieces = self._stager.prepare(pieces)
        else:
            pieces = [Piece(p.key, exact_storage(p.tensor), p.offsets, p.global_shape) for p in pieces]
        state = to_state_dict(pieces) if self.distributed else self._plain(pieces)
        state[f"rank_state/{self.rank}"] = _json_tensor({"rng": _rng_state(), "layout": self._layout()})
        info = {
            "step": step,
            "reason": reason,
            "time": time.time(),
            "layout": self._layout(),
            "consumed_samples": int(extra_state.get("consumed_samples", 0)),
            "extra_state": extra_state,
            "optimizer": self._optimizer_scalars(opt_state),
            # The checkpoint this one continues (resumed from or saved last): the history `auto` follows.
            "previous": self.last_saved_step,
        }
        # A snapshot, and it fails here, on every rank, if the loop put something non-JSON in extra_state:
        # an async commit writes it after the loop has moved on (and may have changed its dicts).
        info = json.loads(json.dumps(info))
        stats = SaveStats(step, reason)
        _, CheckpointException = _dcp()
        check = self._stager.raise_if_failed if self._stager is not None else None
        if self.async_save:
            p = self._pending = _Pending(stats, tmp, info, t0)
            if not self._has_barrier:
                self._stage(p)  # no barrier: the caller may change the state as soon as save() returns
            p.future = self._writer_thread.submit(self._save_async, p, state, check)
            stats.blocked_s = time.monotonic() - t0  # wait_staged adds its wait
            self.last_saved_step = step
            self._last_save_time = time.monotonic()
            return stats
        try:
            self.files.write(state, tmp, self.rank, check, self._ckpt_group, _dcp()[0])
            error = None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
            error = _short(exc)
        error = self._commit_or_clean(tmp, info, stats, error)
        stats.blocked_s = stats.total_s = time.monotonic() - t0
        self._after_commit(stats, error)
        return stats

    def _save_async(self, p: _Pending, state: dict[str, Any], check) -> str | None:
        """The background job of an async save: copy to host memory, write, and on rank 0 commit right away
        (not at the next wait(): a crash in between must not cost a checkpoint that is already on disk).
        Returns the error (rank 0's is the one every rank reports), or None."""
        _, CheckpointException = _dcp()
        self._stage(p)
        try:
            self.files.write(state, p.tmp_dir, self.rank, check, self._async_group, _dcp()[0])
            err = None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
            err = _short(exc)
        if self._rank0_part:
            err = self._commit_or_clean(p.tmp_dir, p.info, p.stats, err, broadcast=False)
        return err

    def _stage(self, p: _Pending) -> None:
        """Copy the state to host memory, once per save: in save() when the caller has no barrier, else
        first thing in the background job. A failure is raised by the writer, inside DCP's write step."""
        if p.staged.done():
            return
        try:
            self._stager.copy()
        finally:
            p.staged.set_result(None)

    def wait_staged(self) -> float:
        """The barrier before the optimizer step: wait until a pending async save's host copy is complete,
        so the snapshot holds the state as it was at save(). Seconds waited (added to the save's blocked_s);
        0 when there is nothing to wait for. Local (no collective); never raises: a failed copy fails the
        save, reported by wait().

        Calling it declares that the caller has this barrier before every change of the parameters or the
        optimizer state (the training loop calls it before each optimizer step): from then on save() only
        starts the host copy and returns, and the copy runs while the caller computes the next step's
        forward and backward. Until then an async save makes the copy inside save()."""
        self._has_barrier = True
        return self._wait_for_copy()

    def _wait_for_copy(self) -> float:
        p = self._pending
        if p is None or p.waited:
            return 0.0
        t0 = time.monotonic()
        p.staged.result()  # set in a finally: never an exception
        p.waited = True
        waited = time.monotonic() - t0
        p.stats.blocked_s += waited
        return waited

    def wait(self) -> SaveStats | None:
        """Block until a pending async save is committed (collective when one is pending); raise if it failed."""
        self._wait_for_copy()  # its wait counts as blocked, as at the barrier
        p, self._pending = self._pending, None
        if p is None:
            return None
        try:
            error = p.future.result()
        except BaseException as exc:  # noqa: BLE001 - the job itself died (it catches the save's errors)
            error = f"the checkpoint writer thread failed: {_short(exc)}"
        error = self._bcast(error)  # rank 0's outcome: it committed, or removed the temporary directory
        p.stats.total_s = time.monotonic() - p.started
        self._after_commit(p.stats, error)
        return p.stats

    def _commit_or_clean(self, tmp: str, info, stats: SaveStats, error: str | None, broadcast: bool = True):
        """Rank 0 seals the checkpoint (or removes the failed temporary dir); the outcome goes to every rank."""
        if self._rank0_part:
            if error is None:
                try:
                    stats.bytes = self.files.seal(
                        self.run_dir, tmp, info, config_to_dict(self.cfg), stats.step, self.keep_last
                    )
                    if self._replica is not None:
                        self._replica.submit(stats.step)
                except Exception as exc:  # noqa: BLE001
                    error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                import shutil

                error += _disk_full_note(os.path.dirname(tmp), error)  # before the partial files are removed
                shutil.rmtree(tmp, ignore_errors=True)
        return self._bcast(error) if broadcast else error

    def _after_commit(self, stats: SaveStats, error: str | None) -> None:
        if error is not None:
            self.last_saved_step = None
            prev = storage.read_latest(self.run_dir)
            hint = (
                " (no space left: free space under run.dir or point run.dir at a larger filesystem)"
                if "No space left" in error or "ENOSPC" in error
                else ""
            )
            failure = CheckpointError(
                f"saving checkpoint step_{stats.step} in {storage.checkpoints_dir(self.run_dir)} failed: {error}{hint}; "
                f"the previous checkpoint ({f'step_{prev}' if prev is not None else 'none'}) is untouched"
            )
            failure.during_save = True  # training/main.py: a failed save requeues from the previous checkpoint
            raise failure
        self.history.append(stats)
        self.last_saved_step = stats.step
        self._last_save_time = time.monotonic()
        if self.rank == 0:
            append_event(
                self.run_dir,
                "checkpoint",
                step=stats.step,
                reason=stats.reason,
                blocked_s=round(stats.blocked_s, 4),
                total_s=round(stats.total_s, 4),
                bytes=stats.bytes,
            )
            self.log(
                f"saved step_{stats.step} ({stats.reason}): {stats.bytes / 2**20:.1f} MiB, "
                f"blocked {stats.blocked_s:.3f}s, total {stats.total_s:.3f}s"
            )

    # ----- resume ----------------------------------------------------------------------------------
    def _choose(self) -> tuple[int | None, str | None]:
        """The checkpoint to resume from, the same on every rank; (step or None, error message or None).
        Collective: rank 0 lists the candidates, every rank CRC-reads its share of each one's files
        (storage.verify's part), so the check takes 1/world of one rank reading the whole checkpoint, and
        no rank sits in a collective for that long under its timeout."""
        mode = str(self.cfg.train.resume).strip().lower()
        if mode == "none":
            return None, None
        wanted, error = self._bcast(self._candidates(mode) if self._rank0_part else None)
        if error:
            return None, error
        replica = self.cfg.train.checkpoint_replica_dir
        for step in wanted:
            problems = self._verify_shared(storage.step_dir(self.run_dir, step))
            if not problems:
                return step, self._compatible(step)
            if self.rank == 0:
                append_event(self.run_dir, "checkpoint_invalid", step=step, problems=problems[:10])
            self.log(f"checkpoint step_{step} is incomplete or corrupt, skipped: {'; '.join(problems[:5])}")
            if replica:
                problem = self._bcast(self._restore_from_replica(replica, step) if self.rank == 0 else None)
                if problem is None:
                    self.log(f"checkpoint step_{step} restored from the replica {replica}")
                    return step, self._compatible(step)
                self.log(f"checkpoint step_{step} not restored from the replica: {problem}")
            if mode != "auto":
                return None, f"train.resume={step}: checkpoint step_{step} is damaged ({'; '.join(problems[:3])})"
        return None, None

    def _restore_from_replica(self, replica: str, step: int) -> str | None:
        """Rank 0: copy step back from the replica; None when restored, else the problem."""
        from training.checkpoint.replica import restore

        problem = restore(self.run_dir, replica, step)
        if problem is None and storage.read_latest(self.run_dir) is None:
            storage.set_latest(self.run_dir, step)
        return problem

    def _candidates(self, mode: str) -> tuple[list[int], str | None]:
        """Rank 0: the steps to try, newest first, or the error of a train.resume naming a missing step."""
        if mode == "auto":
            wanted = self.files.candidates(self.run_dir)
        else:
            try:
                step = int(mode)
            except ValueError:
                return [], f"train.resume={self.cfg.train.resume!r}: use auto, none or a step number"
            if step not in self.files.list_steps(self.run_dir):
                have = self.files.list_steps(self.run_dir)
                return [], (
                    f"train.resume={step}: no checkpoint step_{step} in {storage.checkpoints_dir(self.run_dir)} "
                    f"(available: {have or 'none'}); use train.resume=auto or one of those steps"
                )
            wanted = [step]
        replica = self.cfg.train.checkpoint_replica_dir
        if replica and mode == "auto":
            from training.checkpoint.replica import replica_root, replica_steps

            # The primary lost every checkpoint its replica still holds (a wiped or replaced disk): the
            # replica's newest is a candidate too.
            newest = replica_steps(replica_root(replica, self.run_dir))[:1]
            if newest and not wanted and not self.files.list_steps(self.run_dir):
                wanted = newest
        return wanted, None

    def _verify_shared(self, directory: str) -> list[str]:
        """storage.verify over the job: each rank reads the CRC of its share of the files; every rank gets
        all the problems found (in rank order)."""
        problems = self.files.verify(directory, (self.rank, self.world))
        if not self.distributed:
            return problems
        everyone: list[Any] = [None] * self.world
        comm.all_gather_object(everyone, problems, group=self._ckpt_group)
        return list(dict.fromkeys(p for problems in everyone for p in problems))

    def _compatible(self, step: int) -> str | None:
        saved = self.files.read_json(os.path.join(storage.step_dir(self.run_dir, step), storage.CONFIG)).get(
            "model", {}
        )
        now = asdict(self.cfg.model)
        diff = [
            f"model.{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
            for k in SHAPE_FIELDS
            if saved.get(k) != now.get(k)
        ]
        # Expert count and width (training/model/moe.py); a checkpoint from before they existed was dense.
        dense = asdict(ModelConfig())
        diff += [
            f"model.{k}: checkpoint {saved.get(k, dense[k])!r}, now {now.get(k)!r}"
            for k in MOE_SHAPE_FIELDS
            if saved.get(k, dense[k]) != now.get(k)
        ]
        if diff:
            return (
                f"checkpoint step_{step} in {self.run_dir} was written for another model shape ({'; '.join(diff)}); "
                "restore those settings, or start fresh with train.resume=none or a new run.dir"
            )
        return None

    def maybe_resume(self, model_chunks, optimizer, extra_state: dict[str, Any]) -> tuple[int, int] | None:
        """Load the newest complete checkpoint (per train.resume) into the model, optimizer and extra_state.

        Returns (step, consumed_samples), or None for a fresh start. Collective. Raises CheckpointError with the
        fix when the chosen checkpoint cannot be used (changed model shape, missing step).
        """
        step, error = self._choose()  # collective, the same answer on every rank
        if error:
            raise CheckpointError(error)
        if step is None:
            if self.rank == 0 and self.files.list_steps(self.run_dir):
                if self._mode() == "none":
                    self._start_new_line(None)
                elif not self.files.candidates(self.run_dir):
                    self.log("no checkpoint on the current line (latest): starting fresh")
                else:
                    self.log("no usable checkpoint found: starting fresh")
            return None
        t0 = time.monotonic()
        path = storage.step_dir(self.run_dir, step)
        info = self.files.read_json(os.path.join(path, storage.STATE))
        from training.checkpoint import lean_read

        opt_state = optimizer.state_dict() if optimizer is not None else None
        pieces = self._pieces(model_chunks, opt_state, for_save=False)
        # Read without DCP's classes (lean_read.py): a resume that lean_read can load never imports DCP.
        metadata = self.files.read_metadata(os.path.join(path, storage.DCP_METADATA))
        saved_keys = set(metadata.state_dict_metadata)
        missing_master = {p.key for p in pieces if p.key.startswith("optim/master/") and p.key not in saved_keys}
        pieces = [p for p in pieces if not (p.key.startswith("optim/master/") and p.key not in saved_keys)]
        absent = sorted({p.key for p in pieces if p.key not in saved_keys})
        if absent:
            raise CheckpointError(
                f"checkpoint {path} lacks {len(absent)} tensors this run needs "
                f"(first: {absent[:3]}); it was written by an incompatible version or model"
            )
        same_layout = info["layout"] == self._layout()
        rank_key = f"rank_state/{self.rank}"
        rank_state = None
        if same_layout and rank_key in saved_keys:
            size = tuple(getattr(metadata.state_dict_metadata[rank_key], "size", ()) or ())
            # A rank's RNG state is some kB of JSON: a size beyond RANK_STATE_MAX is a forged or damaged record
            # (2^40 bytes ended in the allocator's RuntimeError, a traceback).
            if len(size) != 1 or not isinstance(size[0], int) or not 0 < size[0] <= RANK_STATE_MAX:
                raise CheckpointError(
                    f"checkpoint {path}: {rank_key} claims {size} bytes, not a rank's RNG state (at most "
                    f"{RANK_STATE_MAX}); the metadata is damaged. Delete this checkpoint directory and resume from "
                    "another (train.resume=<step>)"
                )
            rank_state = torch.zeros(size, dtype=torch.uint8)
        destinations = [(p.key, p.tensor, p.offsets) for p in pieces]
        if rank_state is not None:
            destinations.append((rank_key, rank_state, (0,)))
        # The same answer on every rank (it depends on the metadata only), so all take the same path.
        if lean_read.supported(metadata, sorted({key for key, _, _ in destinations})):
            self._load_lean(path, metadata, destinations)
        else:
            self._load_dcp(path, pieces, rank_key, rank_state)
        if optimizer is not None:
            # The tensors were loaded in place into the state_dict's views; the optimizer takes the scalars,
            # and fills the master copies a checkpoint without them (written in fp32) lacks from the params.
            opt_state.update({k: info["optimizer"][k] for k in SCALARS})
            for shard in opt_state["params"]:
                if f"optim/master/{shard.name}" in missing_master:
                    del shard.tensors["master"]
            optimizer.load_state_dict(opt_state)
        if rank_state is not None:
            _set_rng_state(json.loads(bytes(rank_state.tolist()).decode())["rng"])
        extra_state.update(info["extra_state"])
        self.last_saved_step = step
        if self.rank == 0 and self._mode() != "auto" and storage.read_latest(self.run_dir) != step:
            self._start_new_line(step)
        if self.rank == 0:
            how = "same layout" if same_layout else f"resharded from {info['layout']} to {self._layout()}"
            append_event(self.run_dir, "resumed", step=step, layout_changed=not same_layout)
            self.log(
                f"resumed from {path} (step {step}, consumed_samples {info['consumed_samples']}, {how}) "
                f"in {time.monotonic() - t0:.3f}s"
            )
        return step, int(info["consumed_samples"])

    def _load_lean(self, path: str, metadata: Any, destinations: list[tuple[str, torch.Tensor, Any]]) -> None:
        """lean_read.load on every rank, then one collective so that every rank raises the same error when any
        rank's read failed (as dcp.load reports a failure on every rank)."""
        error = None
        try:
            self.files.load(path, metadata, destinations)
        except CheckpointError as exc:
            error = self._unreadable(path, str(exc))
        except Exception as exc:  # noqa: BLE001 - a damaged record that still matched its manifest
            error = self._unreadable(path, _short(exc))
        if self.distributed:
            everyone: list[Any] = [None] * self.world
            comm.all_gather_object(everyone, error, group=self._ckpt_group)
            error = next((e for e in everyone if e), None)
        if error:
            raise CheckpointError(error)

    def _load_dcp(self, path: str, pieces: list[Piece], rank_key: str, rank_state: torch.Tensor | None) -> None:
        """dcp.load of the pieces (and this rank's rng state): for checkpoints lean_read does not handle."""
        from training.checkpoint.safe_read import SafeFileSystemReader

        dcp, CheckpointException = _dcp()
        reader = SafeFileSystemReader(path)
        state = to_load_state_dict(pieces)
        if rank_state is not None:
            state[rank_key] = rank_state
        try:
            dcp.load(state, storage_reader=reader, process_group=self._ckpt_group)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
            raise CheckpointError(self._unreadable(path, _short(exc))) from exc

    # ----- rollback ---------------------------------------------------------------------------------
    def _mode(self) -> str:
        return str(self.cfg.train.resume).strip().lower()

    def _start_new_line(self, step: int | None) -> None:
        """train.resume=<step> (or none) chose a point behind `latest`: it becomes `latest`, so a later
        train.resume=auto (a requeue) follows the new line; the checkpoints past it are not deleted: the
        new line's first save moves them to checkpoints/abandoned/ (storage.prune)."""
        left = [s for s in storage.list_steps(self.run_dir) if step is None or s > step]
        storage.set_latest(self.run_dir, step)
        append_event(self.run_dir, "rollback", step=step, abandoned_steps=left)
        where = f"step_{step}" if step is not None else "a fresh start (train.resume=none)"
        if left:
            self.log(
                f"rolled back to {where}: checkpoints {[f'step_{s}' for s in left]} are off the line now; "
                f"they move to {os.path.join(storage.checkpoints_dir(self.run_dir), storage.ABANDONED)}/ at "
                "the next save and are never resumed"
            )

    # ----- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _unreadable(path: str, why: str) -> str:
        return (
            f"checkpoint {path} passed its manifest check but could not be loaded ({why}); resume from an "
            f"older checkpoint (train.resume=<step>), or start fresh with train.resume=none or a new run.dir"
        )

    def _layout(self) -> dict[str, Any]:
        m = self.mesh
        out: dict[str, Any] = {
            "world": self.world,
            "tp": m.tp,
            "pp": m.pp,
            "cp": m.cp,
            "dp": m.dp,
            "zero": self.cfg.parallel.zero,
        }
        if m.ep > 1:  # named only when used: earlier checkpoints' layouts stay comparable
            out["ep"] = m.ep
        split = stage_split(self.cfg)
        if m.pp > 1 and any(getattr(self.cfg.parallel, k) for k in SPLIT_KEYS):  # an uneven split, likewise
            out["stage_layers"] = split.counts()
        return out

    @staticmethod
    def _optimizer_scalars(opt_state: dict[str, Any] | None) -> dict[str, Any]:
        if opt_state is None:
            return {"step_count": 0, "loss_scale": 1.0, "good_steps": 0}
        return {k: opt_state[k] for k in SCALARS}

    @staticmethod
    def _plain(pieces: Sequence[Piece]) -> dict[str, torch.Tensor]:
        """Without a process group every key is one piece covering its whole tensor: plain tensors suffice."""
        out = {}
        for p in pieces:
            assert p.key not in out and tuple(p.tensor.shape) == p.global_shape, p.key
            out[p.key] = p.tensor
        return out
