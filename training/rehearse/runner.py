"""One rank of the rehearsal: the engine's own code for one training step, a checkpoint save's and a resume's
collectives, on the meta device under torch's fake process group, with every collective recorded.

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
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from training.contract.config import Config, derived_dp
from training.parallel import collectives as comm
from training.rehearse.kernels import CudaKernels

PHASES = ("setup", "forward_backward", "optimizer", "save", "resume")
"""The step phases a call is labelled with (rehearsal.json's per-phase counts)."""


@dataclass
class RankResult:
    """What one rehearsed rank did."""

    rank: int
    """Global rank."""
    coords: Dict[str, int]
    """tp, pp, cp, dp, ep ranks."""
    calls: List[comm.CommCall]
    """Every recorded call, in issue order."""
    memory: Dict[str, int] = field(default_factory=dict)
    """Bytes per part (weights, grads, optimizer, activations, param_gather, zero3_gathered, peak)."""
    groups: Dict[str, tuple] = field(default_factory=dict)
    """The rank's group of each mesh kind, as global ranks (to name a call's group)."""
    error: str = ""
    """The exception that stopped this rank's rehearsal ("" when it ran to the end)."""
    seconds: float = 0.0
    """Wall time of this rank's rehearsal."""


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def meta_bytes(objs: List[Any], depth: int = 4, seen: Optional[set] = None) -> int:
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


def _inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
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
    evaluation, one step, no host-memory keeping (meta)."""
    data = dataclasses.replace(cfg.data, kind=type(cfg.data.kind)("synthetic"))
    train = dataclasses.replace(cfg.train, eval_every=0, steps=1, host_memory_keep=False, compile=False)
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
        _run_engine(cfg, run_dir, mesh, rec, result)
    except Exception as exc:  # reported per rank; the checks run on what was recorded
        import traceback

        result.error = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc().splitlines(True)[-8:])
    finally:
        comm.stop_recording()
        comm.destroy_process_group()
        comm._WARMED.clear()
    result.seconds = time.perf_counter() - t0
    return result


def _run_engine(cfg: Config, run_dir: str, mesh, rec: comm.Recorder, result: RankResult) -> None:
    """Build, one step, the save's and the resume's collectives (see the module doc)."""
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh, checkpointing=cfg.train.checkpointing)
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
    with kernels, torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        trainer.train_step()
    # Pipeline schedules count the bytes their forwards save themselves (their hooks are the innermost):
    # the engine's own figure, the peak over the micro-batches in flight.
    piped = getattr(getattr(trainer.schedule, "stats", None), "peak_saved_bytes", 0)
    mem["activations"] = max(saved.peak, int(piped or 0))
    mem["param_gather"] = _engine_peak(opt, "param_gather", "peak_bytes")
    mem["zero3_gathered"] = _engine_peak(opt, "zero3", "peak_gathered_bytes")
    if trainer.checkpointer is not None:
        rec.phase = "save"
        _save_collectives(trainer)
        rec.phase = "resume"
        _resume_collectives(trainer)
    mem["peak"] = sum(v for k, v in mem.items() if k != "host_offload")
    gc.collect()


def _engine_peak(opt, attr: str, counter: str) -> int:
    """The engine's own peak counter of a gather (optimizer and its expert optimizer)."""
    total = 0
    for o in (opt, getattr(opt, "experts", None)):
        part = getattr(o, attr, None) if o is not None else None
        total += int(getattr(part, counter, 0) or 0)
    return total


def _save_collectives(trainer) -> None:
    """A checkpoint save's collectives, in CheckpointManager.save's order, up to the file writes (which meta
    tensors cannot feed): the stop/cadence agreement, rank 0's directory name, the optimizer's state dict (the
    ZeRO gathers), and the sharded state dict's metadata exchange."""
    from training.checkpoint.layout import exchange_chunk_lists

    ck = trainer.checkpointer
    ck.decide(trainer.state.step)
    ck._bcast(None)
    opt_state = trainer.optimizer.state_dict()
    pieces = ck._pieces(trainer.chunks, opt_state, for_save=True)
    exchange_chunk_lists(pieces)


def _resume_collectives(trainer) -> None:
    """A resume's collectives, in CheckpointManager.maybe_resume's order, without the reads: the candidates from
    rank 0, every rank's share of the verification, the optimizer's state dict and its reload."""
    ck = trainer.checkpointer
    ck._bcast(([], None))
    everyone: List[Any] = [None] * ck.world
    comm.all_gather_object(everyone, [], group=ck._ckpt_group)
    opt_state = trainer.optimizer.state_dict()
    ck._pieces(trainer.chunks, opt_state, for_save=False)
    trainer.optimizer.load_state_dict(opt_state)
