"""One module talks to torch.distributed: training/parallel/collectives.py. Every collective and point-to-point
call of the engine goes through its wrappers, which is what lets the rehearsal (training/rehearse/) record them
all at one layer. This test reads every module of training/ and fails on any other use of torch.distributed."""

from __future__ import annotations

import ast
import os

from helpers import ROOT

DOOR = "training/parallel/collectives.py"

# Modules allowed to import a part of torch.distributed, and why. None of them issues a collective of the engine.
EXEMPT = {
    # NVTX ranges: wraps torch.distributed's functions (which collectives.py looks up at call time) to time them.
    "training/observe/nvtx.py": "torch.distributed",
    # torch.distributed.checkpoint (DCP) and ShardedTensor: file formats and DCP's own save/load planning, whose
    # collectives torch issues inside dcp.save/dcp.load on the checkpoint group, not engine calls.
    "training/checkpoint/manager.py": "torch.distributed.checkpoint|torch.distributed._shard",
    "training/checkpoint/layout.py": "torch.distributed._shard",
    "training/checkpoint/crc_writer.py": "torch.distributed.checkpoint",
    "training/checkpoint/safe_read.py": "torch.distributed.checkpoint",
    "training/hf/checkpoint_reader.py": "torch.distributed.checkpoint",
}


def _uses(tree: ast.AST):
    """(line, what) of every import of torch.distributed[.x] and every `torch.distributed.<name>` attribute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" or a.name.startswith("torch.distributed."):
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                yield node.lineno, "torch.distributed"
            elif node.module == "torch.distributed" or node.module.startswith("torch.distributed."):
                yield node.lineno, node.module
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                yield node.lineno, "torch.distributed (attribute)"


def test_only_the_collectives_module_talks_to_torch_distributed():
    offenders = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, "training")):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT)
            if rel == DOOR:
                continue
            allowed = EXEMPT.get(rel, "").split("|")
            for line, what in _uses(ast.parse(open(path).read())):
                if not any(what == a or what.startswith(a + ".") for a in allowed if a):
                    offenders.append(f"{rel}:{line} {what}")
    assert not offenders, "call torch.distributed through training/parallel/collectives.py:\n" + "\n".join(offenders)


def test_the_door_test_finds_a_direct_call():
    """The scan itself: a module calling dist.all_reduce directly is found."""
    bad = ast.parse("import torch.distributed as dist\ndist.all_reduce(x)\ny = torch.distributed.barrier()\n")
    assert [w for _, w in _uses(bad)] == ["torch.distributed", "torch.distributed (attribute)"]


def test_recording_is_off_by_default_and_records_when_on():
    """Off: no recorder, nothing kept. On (under torch's fake process group, which moves no data): the op, the
    group as its global ranks, dtype, element count, device, the engine's call site, the order, and for
    point-to-point the peer and the batch it was part of."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    from training.parallel import collectives as comm

    assert comm._RECORDER is None
    comm.init_process_group("cpu:fake,cuda:fake,meta:fake", rank=2, world_size=4, store=dist.HashStore())
    try:
        g = comm.new_group([0, 2])
        x = torch.zeros(5, dtype=torch.bfloat16, device="meta")
        comm.all_reduce(x, g)  # not recorded: no recorder yet
        rec = comm.Recorder(no_data=True, phase="forward_backward")
        comm.start_recording(rec)
        comm.all_reduce(x, g, op=comm.ReduceOp.MAX)
        comm.batch_isend_irecv([comm.send_op(x, 0, g), comm.recv_op(torch.zeros(2, device="cpu"), 0, g)])
        box = ["mine"]
        comm.broadcast_object_list(box, src=0, group=g)
        comm.stop_recording()
        comm.all_reduce(x, g)
    finally:
        comm.destroy_process_group()
    assert comm._RECORDER is None
    a, s, r, b = rec.calls
    assert (a.op, a.group, a.dtype, a.numel, a.device, a.reduce_op, a.order) == (
        "all_reduce",
        (0, 2),
        "bfloat16",
        5,
        "meta",
        "MAX",
        0,
    )
    assert a.site.startswith("tests/engine/test_collectives_door.py:") and a.phase == "forward_backward"
    assert (s.op, s.peer, s.batch, r.op, r.peer, r.batch, r.device) == ("send", 0, 0, "recv", 0, 0, "cpu")
    assert b.op == "broadcast_object_list" and box == ["mine"]
