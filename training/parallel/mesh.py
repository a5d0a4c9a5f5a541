"""The process mesh: every process group a training run uses is created here (the preflight and the cost probe,
which run apart from training, start their own).

Rank order (docs/CONTRACTS.md): global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank,
i.e. tp varies fastest (so a TP group sits inside a node), then cp, then pp, then dp.

`rank_groups` computes every group's rank lists as a pure function (tested without processes);
`ProcessMesh.from_env` creates the matching torch.distributed groups. Every rank calls `new_group`
for every list in the same order, which torch requires, and keeps the one it belongs to.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from training.parallel import collectives as comm
from training.parallel.rendezvous import wait_for_store

# The group kinds ProcessMesh holds, in creation order.
GROUP_KINDS = ("tp", "cp", "pp", "dp", "dp_cp", "model_parallel", "embedding", "ep", "edp")


def rank_of(tp_rank: int, cp_rank: int, pp_rank: int, dp_rank: int, tp: int, cp: int, pp: int) -> int:
    """Global rank of a mesh coordinate (tp fastest, then cp, pp, dp)."""
    return ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank


def coords_of(rank: int, tp: int, pp: int, cp: int, dp: int) -> dict[str, int]:
    """Inverse of `rank_of`: the mesh coordinate of a global rank."""
    if not 0 <= rank < tp * pp * cp * dp:
        raise ValueError(f"rank {rank} outside a world of tp*pp*cp*dp = {tp * pp * cp * dp}")
    return {
        "tp": rank % tp,
        "cp": (rank // tp) % cp,
        "pp": (rank // (tp * cp)) % pp,
        "dp": rank // (tp * cp * pp),
    }


def rank_groups(tp: int, pp: int, cp: int, dp: int, ep: int = 1) -> dict[str, list[list[int]]]:
    """Rank lists of every group kind for a tp x pp x cp x dp layout (pure; no processes).

    tp: ranks differing only in tp_rank.      cp: only in cp_rank.     pp: only in pp_rank.
    dp: only in dp_rank.                      dp_cp: in dp_rank and cp_rank (gradient reduction with cp).
    model_parallel: in tp_rank and pp_rank (one model replica's shards: gradient-norm reduction).
    embedding: first and last pipeline stage at one (dp, cp, tp) position (tied-embedding grad reduction);
    a single rank when pp == 1, and for each middle stage when pp > 2.
    ep: expert parallelism, carved out of dp: ep consecutive dp ranks (dp_rank // ep the same) at one
    (pp, cp, tp) position hold the experts between them and exchange tokens (all-to-all).
    edp: expert-data-parallel, the dp ranks holding the same experts (dp_rank % ep the same): expert grads.
    At ep = 1 ep is a single rank and edp equals dp.
    """
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp), ("ep", ep)):
        if v < 1:
            raise ValueError(f"parallel degree {name}={v} must be >= 1")
    if dp % ep:
        raise ValueError(
            f"parallel.ep={ep} does not divide the data-parallel degree dp={dp}: choose an ep that divides it"
        )
    R = lambda t, c, p, d: rank_of(t, c, p, d, tp, cp, pp)  # noqa: E731
    g: dict[str, list[list[int]]] = {k: [] for k in GROUP_KINDS}
    for d in range(dp):
        for p in range(pp):
            for c in range(cp):
                g["tp"].append([R(t, c, p, d) for t in range(tp)])
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                g["cp"].append([R(t, c, p, d) for c in range(cp)])
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                g["pp"].append([R(t, c, p, d) for p in range(pp)])
    for p in range(pp):
        for c in range(cp):
            for t in range(tp):
                g["dp"].append([R(t, c, p, d) for d in range(dp)])
    for p in range(pp):
        for t in range(tp):
            g["dp_cp"].append(sorted(R(t, c, p, d) for d in range(dp) for c in range(cp)))
    for d in range(dp):
        for c in range(cp):
            g["model_parallel"].append(sorted(R(t, c, p, d) for p in range(pp) for t in range(tp)))
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                stages = sorted({0, pp - 1})
                g["embedding"].append([R(t, c, p, d) for p in stages])
                # Middle stages hold no embedding: each gets a group of its own, so every kind
                # partitions the world and no rank's group is None (None would mean WORLD to torch).
                g["embedding"].extend([R(t, c, p, d)] for p in range(1, pp - 1))
    for p in range(pp):
        for c in range(cp):
            for t in range(tp):
                for b in range(dp // ep):
                    g["ep"].append([R(t, c, p, d) for d in range(b * ep, (b + 1) * ep)])
                for j in range(ep):
                    g["edp"].append([R(t, c, p, d) for d in range(j, dp, ep)])
    return g


def consecutive_block_group(size: int, timeout_s: float | None = None) -> Any:
    """This rank's group among blocks of `size` consecutive ranks (preflight's bandwidth blocks).

    Collective: every rank calls it with the same size. Lives here so that this module stays the one
    place that creates process groups. timeout_s bounds its collectives (None: torch's default).
    """
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    group, _ = comm.new_subgroups(size, timeout=timeout)
    return group


def local_cuda_index(local_rank: int) -> int:
    """The CUDA device of this local rank: local_rank modulo the devices this process sees. Slurm's
    --gpus-per-task / cgroup binding shows each task only its own GPU(s), renumbered from 0, so cuda:LOCAL_RANK
    would name a device that does not exist for every local rank past the first."""
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError("cluster.device=cuda but torch sees no CUDA device (CUDA_VISIBLE_DEVICES, driver?)")
    return local_rank % count


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"environment variable {name} is not set: start ranks with `python -m training.main RUN_DIR` "
            "through meshrun (or torchrun), which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    return int(value)


@dataclass
class ProcessMesh:
    """This rank's place in the tp x pp x cp x dp layout and its process groups.

    Groups are real torch.distributed groups in a multi-process run (also when their size is 1),
    and None in `ProcessMesh.single()`; the helpers in training.parallel.collectives treat None and
    size-1 groups as identity. Never pass a None group straight to torch.distributed: there None means WORLD.
    """

    rank: int = 0
    """Global rank."""
    world_size: int = 1
    """tp * pp * cp * dp."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree."""
    dp: int = 1
    """Data-parallel degree."""
    tp_rank: int = 0
    """Index inside the tensor-parallel group."""
    pp_rank: int = 0
    """Pipeline stage of this rank."""
    cp_rank: int = 0
    """Index inside the context-parallel group."""
    dp_rank: int = 0
    """Data-parallel replica index."""
    ep: int = 1
    """Expert-parallel degree (inside dp)."""
    ep_rank: int = 0
    """Index inside the expert-parallel group: dp_rank % ep (this rank holds experts ep_rank x E/ep ..)."""
    edp: int = 1
    """Expert-data-parallel degree: dp / ep replicas of each expert."""
    edp_rank: int = 0
    """Index inside the expert-data-parallel group: dp_rank // ep."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """cpu, or cuda:LOCAL_RANK with NCCL."""
    backend: str | None = None
    """gloo | nccl; None for a single process without a process group."""
    tp_group: Any = None
    """Ranks sharing one tensor-parallel shard set."""
    pp_group: Any = None
    """Ranks forming one pipeline."""
    dp_group: Any = None
    """Data-parallel replicas of this shard."""
    cp_group: Any = None
    """Context-parallel ranks."""
    dp_cp_group: Any = None
    """dp x cp: the gradient reduction group when cp > 1."""
    model_parallel_group: Any = None
    """tp x pp: one model replica (gradient-norm reduction)."""
    embedding_group: Any = None
    """First and last pipeline stage at this (dp, cp, tp) position (tied embedding grads)."""
    ep_group: Any = None
    """ep consecutive dp ranks: the experts of a layer split between them (token all-to-all)."""
    edp_group: Any = None
    """The dp ranks holding the same experts (expert grad reduction, expert optimizer sharding)."""
    background_group: Any = None
    """Every rank, always gloo: the checkpoint phases' collectives (DCP's in saves, the commit's outcome, the
    resume's checks) run here, under their own timeout (from_env's checkpoint_timeout_s; by default the
    collective timeout: a longer one kept the survivors of a SIGKILLed rank waiting in gloo for all of it),
    and those issued from background threads (async checkpoint writes) never interleave with the
    training's collectives on the other groups."""
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    """Global ranks of this rank's group of each kind (for logs and tests)."""

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the first pipeline stage (embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (head and loss)."""
        return self.pp_rank == self.pp - 1

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ProcessMesh:
        """A one-process mesh without init_process_group; every group is None."""
        ranks = {k: [0] for k in GROUP_KINDS}
        return cls(device=torch.device(device), group_ranks=ranks)

    @classmethod
    def from_env(
        cls,
        tp: int,
        pp: int,
        cp: int,
        dp: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        ep: int = 1,
        checkpoint_timeout_s: float | None = None,
    ) -> ProcessMesh:
        """Join the job described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and build every group.

        timeout_s bounds every collective, so a dead peer becomes a RuntimeError instead of a hang;
        checkpoint_timeout_s (default timeout_s, never below it) those of background_group.
        """
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        _env_int("MASTER_PORT")
        if tp * pp * cp * dp != world:
            raise ValueError(
                f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {tp * pp * cp * dp} but WORLD_SIZE={world}: "
                "set parallel.dp (or the number of ranks) so that the product equals the world size"
            )
        if backend == "nccl":
            device = torch.device("cuda", local_cuda_index(int(os.environ.get("LOCAL_RANK", "0"))))
            torch.cuda.set_device(device)
        elif backend == "gloo":
            device = torch.device("cpu")
        elif backend == "fake":  # the rehearsal (training/rehearse/): torch's fake process group, meta tensors
            device = torch.device("meta")
        else:
            raise ValueError(f"backend {backend!r}: use gloo (cpu) or nccl (cuda)")
        # new_group does not inherit init_process_group's timeout (it falls back to torch's 10/30 min
        # default), so every group gets it explicitly.
        timeout = datetime.timedelta(seconds=timeout_s)
        if not comm.is_initialized():
            wait_for_store(timeout_s)
            comm.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        c = coords_of(rank, tp, pp, cp, dp)
        mesh = cls(
            rank=rank,
            world_size=world,
            tp=tp,
            pp=pp,
            cp=cp,
            dp=dp,
            tp_rank=c["tp"],
            pp_rank=c["pp"],
            cp_rank=c["cp"],
            dp_rank=c["dp"],
            ep=ep,
            ep_rank=c["dp"] % ep,
            edp=dp // ep,
            edp_rank=c["dp"] // ep,
            device=device,
            backend=backend,
        )
        pp_rank_is_end = c["pp"] in (0, pp - 1)
        # One group per distinct rank list: on NCCL each group is a communicator with its own buffers on every
        # member GPU, and the kinds often coincide (dp and dp_cp at cp=1, tp and model_parallel at pp=1). The pp
        # group keeps its own: pipeline stages run different programs, and its point-to-point traffic on a
        # shared communicator would be ordered against the collectives of the kinds sharing it.
        made: dict[tuple, Any] = {}
        for kind, lists in rank_groups(tp, pp, cp, dp, ep).items():
            mine = None
            for ranks in lists:
                # Every rank must call new_group for every new list, in the same order.
                key = (kind == "pp", tuple(ranks))
                group = made.get(key)
                if group is None:
                    group = made[key] = comm.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    assert mine is None, f"rank {rank} in two {kind} groups"
                    mine = (group, ranks)
            assert mine is not None, f"rank {rank} in no {kind} group"
            setattr(mesh, f"{kind}_group", mine[0])
            mesh.group_ranks[kind] = list(mine[1])
            expected = {
                "tp": tp,
                "cp": cp,
                "pp": pp,
                "dp": dp,
                "dp_cp": dp * cp,
                "model_parallel": tp * pp,
                "embedding": min(pp, 2) if pp_rank_is_end else 1,
                "ep": ep,
                "edp": dp // ep,
            }[kind]
            assert comm.world_size(mine[0]) == expected, (kind, mine[1], expected)
        ckpt_s = max(timeout_s, checkpoint_timeout_s or 0.0)
        mesh.background_group = comm.new_group(
            list(range(world)),
            backend="gloo" if backend != "fake" else None,  # a rehearsal's groups are all fake
            timeout=datetime.timedelta(seconds=ckpt_s),
        )
        return mesh

    def destroy(self) -> None:
        """Barrier, then destroy the process group (the barrier avoids a known gloo crash at exit)."""
        if self.backend is not None and comm.is_initialized():
            comm.barrier()
            comm.destroy_process_group()
