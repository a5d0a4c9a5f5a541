"""One rank of the rehearsal: the engine's own code for one training step, a checkpoint save and a resume
(CheckpointManager's own, with its file I/O recorded instead of done: RecordingFiles), on the meta device under
torch's fake process group, with every collective recorded.

The rank is built exactly as training/main.py builds it (ProcessMesh.from_env, Trainer), at the job's real world
size and with the rank's real coordinates; the only differences are the backend ("fake": meta tensors, no data
moved) and the data (synthetic tokens of the same shape: no data set is read). Values do not exist on meta, so
the few places that read one on the host (a loss, a norm, the stop flags) take the stand-in they name
(training/parallel/collectives.py: value).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from training.contract.config import Config, derived_dp
from training.parallel import collectives as comm
from training.rehearse.kernels import CudaKernels
from training.rehearse.messages import NcclWorks

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("setup", "forward_backward", "optimizer", "save", "resume")
"""The step phases a call is labelled with (rehearsal.json's per-phase counts)."""


@dataclass
class RankResult:
    """What one rehearsed rank did."""

    rank: int
    """Global rank."""
    coords: dict[str, int]
    """tp, pp, cp, dp, ep ranks."""
    calls: list[comm.CommCall]
    """Every recorded call, in issue order."""
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes per part (weights, grads, optimizer, activations, param_gather, zero3_gathered, peak)."""
    groups: dict[str, tuple] = field(default_factory=dict)
    """The rank's group of each mesh kind, as global ranks (to name a call's group)."""
    error: str = ""
    """The exception that stopped this rank's rehearsal ("" when it ran to the end)."""
    seconds: float = 0.0
    """Wall time of this rank's rehearsal."""


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def meta_bytes(objs: list[Any], depth: int = 4, seen: set | None = None) -> int:
    """Bytes of the distinct meta storages reachable from `objs` (attributes, lists, dicts, to `depth`)."""
    seen = set() if seen is None else seen
    total, visited = 0, set()
    stack = [(o, 0) for o in objs]
    while stack:
        o, d = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type == "meta":
                key, n = _storage_key(o)
                if key not in seen:
                    seen.add(key)
                    total += n
            continue
        if d >= depth or isinstance(o, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend((v, d + 1) for v in o)
        elif hasattr(o, "__dict__"):
            stack.extend((v, d + 1) for v in vars(o).values())
    return total


class SavedActivations:
    """Peak bytes of the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks), per
    distinct storage, leaving out the model states (parameters saved by a matmul are not activations)."""

    def __init__(self, states: set):
        self.states, self.live, self.refs = states, 0, {}
        self.peak = 0

    def pack(self, t: torch.Tensor):
        if t.device.type != "meta":
            return t
        parts = []
        for inner in _inner_tensors(t):
            key, n = _storage_key(inner)
            if key not in self.states:
                parts.append((key, n))
        if not parts:
            return t
        for key, n in parts:
            count = self.refs.get(key, 0)
            if count == 0:
                self.live += n
                self.peak = max(self.peak, self.live)
            self.refs[key] = count + 1
        return _Saved(t, parts, self)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key, n: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= n


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages `t` keeps alive: a wrapper subclass's (torchao's float8 tensors) inner ones."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        return [x for name in t.__tensor_flatten__()[0] for x in _inner_tensors(getattr(t, name))]
    return [t]


class _Saved:
    __slots__ = ("tensor", "parts", "owner")

    def __init__(self, tensor, parts, owner):
        self.tensor, self.parts, self.owner = tensor, parts, owner

    def __del__(self):
        for key, n in self.parts:
            self.owner.release(key, n)


def _phase(rec: comm.Recorder, obj: Any, name: str, phase: str) -> None:
    """Label the calls made inside obj.name (a bound method of the engine) with `phase`."""
    real = getattr(obj, name)

    def labelled(*args, **kwargs):
        before, rec.phase = rec.phase, phase
        try:
            return real(*args, **kwargs)
        finally:
            rec.phase = before

    setattr(obj, name, labelled)


def rehearsal_config(cfg: Config) -> Config:
    """The run's config as the rehearsal runs it: synthetic tokens of the same shape (no data set is read), no
    evaluation, one step (the Trainer keeps no host memory on meta: rehearse_rank)."""
    data = dataclasses.replace(cfg.data, kind=type(cfg.data.kind)("synthetic"))
    # The save at the step's end is the run's final one; the resume takes it (auto), and no replica is copied.
    train = dataclasses.replace(
        cfg.train,
        eval_every=0,
        steps=1,
        compile=False,
        resume="auto",
        checkpoint_replica_dir="",
    )
    return dataclasses.replace(cfg, data=data, train=train)


def rehearse_rank(cfg: Config, run_dir: str, rank: int, emulate: str = "nccl") -> RankResult:
    """Run rank `rank` of the configured layout on meta; every collective it issues is recorded."""
    from training.parallel.mesh import ProcessMesh

    p = cfg.parallel
    dp = derived_dp(cfg)
    world = p.tp * p.pp * p.cp * dp
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "1")
    t0 = time.perf_counter()
    comm.init_process_group("fake", rank=rank, world_size=world)
    rec = comm.Recorder(no_data=True, backend=emulate, phase="setup")
    comm.start_recording(rec)
    result = RankResult(rank=rank, coords={}, calls=rec.calls)
    try:
        mesh = ProcessMesh.from_env(p.tp, p.pp, p.cp, dp, "fake", cfg.train.dist_timeout_s, ep=p.ep)
        result.coords = {k: getattr(mesh, f"{k}_rank") for k in ("tp", "pp", "cp", "dp", "ep")}
        result.groups = {k: tuple(v) for k, v in mesh.group_ranks.items()}
        with scratch_run_dir(run_dir) as engine_dir:
            _run_engine(cfg, engine_dir, mesh, rec, result)
    except Exception as exc:  # reported per rank; the checks run on what was recorded
        import traceback

        result.error = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc().splitlines(True)[-8:])
    finally:
        comm.stop_recording()
        comm.destroy_process_group()
        comm._WARMED.clear()
    result.seconds = time.perf_counter() - t0
    return result


@contextlib.contextmanager
def scratch_run_dir(run_dir: str):
    """A run directory of the rank's own for the engine: the run's files it reads (config.json, plan.json, ...)
    copied in, and whatever the engine writes there (rank 0's checkpoint and resumed events, the checkpoints
    directory) removed with it, so that run.dir shows no save and no resume that never happened (`meshrun
    action=status` reads events.jsonl). The rehearsal writes rehearsal.json alone."""
    scratch = tempfile.mkdtemp(prefix="meshrun-rehearse-")
    try:
        for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
            path = os.path.join(run_dir, name)
            if name not in SCRATCH_SKIP and os.path.isfile(path) and not os.path.islink(path):
                shutil.copyfile(path, os.path.join(scratch, name))
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


SCRATCH_SKIP = ("events.jsonl", "metrics.jsonl", "rehearsal.json")
"""Files of run.dir the engine's copy leaves out: the run's records, which a rehearsal neither reads nor adds to."""


def _run_engine(cfg: Config, run_dir: str, mesh, rec: comm.Recorder, result: RankResult) -> None:
    """Build, one step, the save's and the resume's collectives (see the module doc)."""
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh, checkpointing=cfg.train.checkpointing, keep_host_memory=False)
    opt = trainer.optimizer
    params = [p for c in trainer.chunks for p in c.parameters()]
    seen: set = set()
    mem = result.memory
    # ZeRO-3 frees the full parameters: the weights are its shards (held by the optimizer's zero3 part).
    zero3 = [getattr(o, "zero3", None) for o in (opt, getattr(opt, "experts", None))]
    mem["weights"] = meta_bytes(params, seen=seen) + meta_bytes(zero3, seen=seen)
    mem["grads"] = meta_bytes(
        [getattr(opt, "grads", None), getattr(getattr(opt, "experts", None), "grads", None)], seen=seen
    )
    stores = [getattr(getattr(o, "adamw", None), "store", None) for o in (opt, getattr(opt, "experts", None))]
    mem["host_offload"] = meta_bytes(stores, seen=seen)  # offload=cpu: host memory, not the device's
    mem["optimizer"] = meta_bytes([opt], seen=seen)
    mem["buffers"] = meta_bytes([b for c in trainer.chunks for b in c.buffers()], seen=seen)
    states = set(seen)
    _phase(rec, trainer.schedule, "forward_backward", "forward_backward")
    _phase(rec, opt, "step", "optimizer")
    saved = SavedActivations(states)
    kernels = CudaKernels() if cfg.cluster.device == "cuda" else contextlib.nullcontext()
    # NCCL's p2p works (one per batch; a lone pipeline send complete once its receive is known posted); the fake
    # backend's are gloo's (one per op, none complete before its wait), which a cpu run keeps.
    works = NcclWorks(trainer.schedule) if rec.backend == "nccl" else contextlib.nullcontext()
    with kernels, works, torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        trainer.train_step()
    # Pipeline schedules count the bytes their forwards save themselves (their hooks are the innermost):
    # the engine's own figure, the peak over the micro-batches in flight.
    piped = getattr(getattr(trainer.schedule, "stats", None), "peak_saved_bytes", 0)
    mem["activations"] = max(saved.peak, int(piped or 0))
    mem["param_gather"] = _engine_peak(opt, "param_gather", "peak_bytes")
    mem["zero3_gathered"] = _engine_peak(opt, "zero3", "peak_gathered_bytes")
    # The schedule's own count of the outgoing messages it holds at once (pipeline p2p buffers in flight; on NCCL
    # per training/rehearse/messages.py).
    mem["pipeline_messages"] = int(getattr(getattr(trainer.schedule, "stats", None), "peak_message_bytes", 0) or 0)
    if trainer.checkpointer is not None:
        files = RecordingFiles(trainer.checkpointer, states, rec)
        rec.phase = "save"
        trainer._boundary()  # the run's last step: training/run/stop.py's decision, save, wait
        rec.phase = "resume"
        trainer.checkpointer.maybe_resume(trainer.chunks, trainer.optimizer, trainer._extra_state())
        mem["checkpoint_staging"] = files.device_staging
        mem["checkpoint_staging_host"] = files.host_staging
    mem["peak"] = sum(v for k, v in mem.items() if k not in HOST_PARTS)
    gc.collect()


def _engine_peak(opt, attr: str, counter: str) -> int:
    """The engine's own peak counter of a gather (optimizer and its expert optimizer)."""
    total = 0
    for o in (opt, getattr(opt, "experts", None)):
        part = getattr(o, attr, None) if o is not None else None
        total += int(getattr(part, counter, 0) or 0)
    return total


HOST_PARTS = ("host_offload", "checkpoint_staging_host")
"""Parts in host memory (not in the device's peak)."""


class RecordingFiles:
    """CheckpointManager's file I/O (training/checkpoint/files.py: CheckpointFiles) under the rehearsal, installed
    as the manager's `files`: everything else of the save and the resume is the manager's own code.

    A save's write records each item of the state dict DCP would write (key, global size, dtype, this rank's
    chunks, bytes) and writes nothing; host tensors (the rank's RNG state) keep their values. The sealing
    records state.json and config.json. The resume's reads are answered from that record: the checkpoint is the
    one saved, complete; its metadata lists this rank's recorded chunks, and each key the resume asks for that
    this rank did not write (other ranks' pieces: the rank sees only its own save) with the global size and
    dtype the rank's own piece of it has. Meta destinations are left as they are; host ones get the values.

    DCP's own collectives inside dcp.save (its planning and commit exchanges over the save's group) cannot run
    under the fake backend (docs/REHEARSAL.md says why); the write records them as one `dcp_save` call on that
    group, which every member must reach in the same place of its sequence, as DCP's symmetric exchanges require.

    Memory: `device_staging`, the bytes of the save's pieces that are not the model's or the optimizer's
    storages (what the optimizer's state_dict materialised for the save); `host_staging`, an async save's host
    buffers (training/checkpoint/staging.py HostStager)."""

    def __init__(self, manager, states: set, rec: comm.Recorder | None = None):
        self.manager, self.states, self.rec = manager, states, rec
        self.items: dict[str, dict[str, Any]] = {}
        self.values: dict[tuple, torch.Tensor] = {}
        self.written_bytes = 0
        self.sealed: dict[str, Any] = {}
        self.step: int | None = None
        self.wanted: list[Any] = []
        self.device_staging = 0
        manager.files = self
        real = manager._pieces

        def pieces(model_chunks, opt_state, for_save):  # observed, not changed
            out = real(model_chunks, opt_state, for_save)
            if for_save:
                seen = set(self.states)
                self.device_staging = max(self.device_staging, meta_bytes([p.tensor for p in out], seen=seen))
            else:
                self.wanted = out
            return out

        manager._pieces = pieces

    @property
    def host_staging(self) -> int:
        stager = self.manager._stager
        return int(stager.nbytes) if stager is not None else 0

    # ----- save ------------------------------------------------------------------------------------
    def write(self, state, tmp, rank, check, group, dcp=None) -> None:
        if check is not None:
            check()
        if self.rec is not None and group is not None:
            caller = sys._getframe(1)  # the manager's line that calls dcp.save through its files
            site = f"{os.path.relpath(caller.f_code.co_filename, _ROOT)}:{caller.f_lineno} ({caller.f_code.co_name})"
            calls = self.rec.calls
            calls.append(
                comm.CommCall(len(calls), "dcp_save", self.rec.ranks_of(group), "", 0, "", site, self.rec.phase)
            )
        for key, value in state.items():
            if hasattr(value, "local_shards"):  # a ShardedTensor
                size = tuple(value.size())
                shards = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
            else:
                size, shards = tuple(value.shape), [((0,) * value.dim(), value)]
            entry = self.items.setdefault(key, {"size": size, "dtype": None, "chunks": {}})
            for offsets, t in shards:
                entry["dtype"] = t.dtype
                entry["chunks"][offsets] = tuple(t.shape)
                self.written_bytes += t.nbytes
                if t.device.type == "cpu":
                    self.values[(key, offsets)] = t.detach().clone()

    def seal(self, run_dir, tmp, info, config, step, keep_last) -> int:
        from training.checkpoint import storage

        self.sealed = {storage.STATE: info, storage.CONFIG: config}
        self.step = step
        return self.written_bytes

    # ----- resume ----------------------------------------------------------------------------------
    def list_steps(self, run_dir) -> list[int]:
        return [] if self.step is None else [self.step]

    def candidates(self, run_dir) -> list[int]:
        return self.list_steps(run_dir)

    def verify(self, directory, share) -> list[str]:
        return []

    def read_json(self, path) -> Any:
        return self.sealed[os.path.basename(path)]

    def read_metadata(self, path) -> Any:
        from training.checkpoint import lean_read as lr

        items = {k: dict(v, chunks=dict(v["chunks"])) for k, v in self.items.items()}
        for p in self.wanted:
            entry = items.setdefault(p.key, {"size": tuple(p.global_shape), "dtype": p.tensor.dtype, "chunks": {}})
            if p.key not in self.items:
                entry["chunks"][tuple(p.offsets)] = tuple(p.tensor.shape)
        state, storage_data = {}, {}
        for key, v in items.items():
            chunks = [lr.ChunkStorageMetadata(offsets=o, sizes=s) for o, s in v["chunks"].items()]
            props = lr.TensorProperties(dtype=v["dtype"])
            state[key] = lr.TensorStorageMetadata(properties=props, size=torch.Size(v["size"]), chunks=chunks)
            for o in v["chunks"]:
                index = lr.MetadataIndex(fqn=key, offset=o)
                storage_data[index] = lr.StorageInfo(relative_path="__0_0.distcp", offset=0, length=0)
        return lr.Metadata(state_dict_metadata=state, storage_data=storage_data)

    def load(self, path, metadata, destinations) -> None:
        for key, t, offsets in destinations:
            value = self.values.get((key, tuple(offsets)))
            if t.device.type == "cpu" and value is not None and value.shape == t.shape:
                t.copy_(value)
