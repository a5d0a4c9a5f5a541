"""Test helpers that do not depend on the model engineer's code: a stand-in mesh and a process spawner.

The stand-in mesh has the attributes the optimizer and loop read from training.mesh.ProcessMesh, so
optimizer tests can build any tp/pp/dp arrangement of a handful of gloo processes directly.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class StandInMesh:
    """Mesh attributes the optimizer uses; groups are created by `make_mesh`."""

    rank: int = 0
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    is_first_stage: bool = True
    is_last_stage: bool = True
    device: Any = torch.device("cpu")
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    dp_cp_group: Any = None
    model_parallel_group: Any = None
    embedding_group: Any = None


def make_mesh(tp: int = 1, pp: int = 1, dp: int = 1) -> StandInMesh:
    """A mesh over the initialised world with rank = (dp_rank * pp + pp_rank) * tp + tp_rank."""
    if not dist.is_initialized():
        return StandInMesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == tp * pp * dp
    tp_rank, pp_rank, dp_rank = rank % tp, (rank // tp) % pp, rank // (tp * pp)
    m = StandInMesh(rank, world, tp, pp, 1, dp, tp_rank, pp_rank, dp_rank, pp_rank == 0, pp_rank == pp - 1)

    def grid(d, q, p_):
        return (d * pp + p_) * tp + q

    # Every rank must create every group in the same order.
    for d in range(dp):
        for p_ in range(pp):
            g = dist.new_group([grid(d, q, p_) for q in range(tp)])
            if d == dp_rank and p_ == pp_rank:
                m.tp_group = g
        for q in range(tp):
            g = dist.new_group([grid(d, q, p_) for p_ in range(pp)])
            if d == dp_rank and q == tp_rank:
                m.pp_group = m.embedding_group = g
        g = dist.new_group([grid(d, q, p_) for p_ in range(pp) for q in range(tp)])
        if d == dp_rank:
            m.model_parallel_group = g
    for p_ in range(pp):
        for q in range(tp):
            g = dist.new_group([grid(d, q, p_) for d in range(dp)])
            if p_ == pp_rank and q == tp_rank:
                m.dp_group = m.dp_cp_group = g
    return m


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, errfile: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn: Callable, *args, tmpdir: Optional[str] = None) -> None:
    """Run fn(rank, world, *args) in `world` gloo processes; a rank's traceback fails the test."""
    import tempfile

    errfile = os.path.join(tmpdir or tempfile.mkdtemp(), "err")
    try:
        mp.spawn(_entry, args=(world, free_port(), fn, args, errfile), nprocs=world, join=True)
    except Exception as exc:
        msgs = []
        for r in range(world):
            if os.path.exists(f"{errfile}.{r}"):
                msgs.append(f"rank {r}:\n" + open(f"{errfile}.{r}").read())
        raise AssertionError("\n".join(msgs) or str(exc)) from None
