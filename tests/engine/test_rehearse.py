"""meshrun's rehearsal (training/rehearse/): the engine's own step on meta under torch's fake process group, every
rank of a layout, its collectives checked. The unmodified engine passes on the layouts the features exist for; each
defect of the issue's list, put into the engine by monkeypatch, is found with a report naming it.

The ranks run in this process (workers=1), so a monkeypatched engine is the one rehearsed. Tiny models keep it
cheap; the presets at their real sizes run in bench/bench_rehearse.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.cli import compose_cfg

from training.contract.exit_codes import EXIT_OK, EXIT_REHEARSAL_DEFECT
from training.parallel import collectives as comm
from training.rehearse import checks
from training.rehearse.main import rehearse

CUDA = ("cluster.device=cuda", "data=synthetic", "train.precision=bf16", "parallel.micro_batch=1")


def _rehearse(tmp_path, *overrides, name="run"):
    cfg = compose_cfg(*CUDA, *overrides)
    run_dir = str(tmp_path / name)
    os.makedirs(run_dir, exist_ok=True)
    cfg.run.dir = run_dir
    doc, code = rehearse(cfg, run_dir, workers=1, quiet=True)
    assert not [r["error"] for r in doc["ranks"] if r["error"]], [r["error"] for r in doc["ranks"] if r["error"]]
    with open(os.path.join(run_dir, "rehearsal.json")) as f:
        assert json.load(f)["ok"] == doc["ok"]
    return doc, code


LAYOUTS = {
    "cp2": (
        "model=llama3_8b",
        "model.num_layers=2",
        "model.hidden_size=256",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=512",
        "model.seq_length=64",
        "model.vocab_size=512",
        "parallel.cp=2",
        "parallel.dp=1",
        "parallel.global_batch=2",
        "cluster.gpus_per_node=2",
    ),
    "cp3_tp2_sp_pp2": (
        "model=tiny",
        "model.position=rope",
        "model.seq_length=96",
        "parallel.tp=2",
        "parallel.sp=true",
        "parallel.pp=2",
        "parallel.cp=3",
        "parallel.dp=1",
        "parallel.global_batch=4",
        "cluster.gpus_per_node=12",
    ),
    "ep2_moe": ("model=tiny_moe", "parallel=tp2", "parallel.dp=2", "parallel.ep=2", "cluster.gpus_per_node=4"),
    "cp4": (
        "model=llama3_8b",
        "model.num_layers=2",
        "model.hidden_size=256",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=512",
        "model.seq_length=128",
        "model.vocab_size=512",
        "parallel.cp=4",
        "parallel.dp=1",
        "parallel.global_batch=2",
        "cluster.gpus_per_node=4",
    ),
    "ep8_moe": (
        "model=tiny_moe",
        "model.num_experts=8",
        "parallel.dp=8",
        "parallel.ep=8",
        "parallel.global_batch=8",
        "cluster.gpus_per_node=8",
    ),
    "cp2_tp2_sp_pp2": (
        "model=tiny",
        "model.position=rope",
        "model.seq_length=64",
        "parallel.tp=2",
        "parallel.sp=true",
        "parallel.pp=2",
        "parallel.cp=2",
        "parallel.dp=1",
        "parallel.global_batch=4",
        "cluster.gpus_per_node=8",
    ),
    # pp4: the middle stages' exchanges name both neighbours (the simulation once called 1f1b's a deadlock)
    "pp4_1f1b": ("model=tiny", "parallel.pp=4", "parallel.dp=1", "parallel.global_batch=8", "cluster.gpus_per_node=4"),
    "pp4_uneven_zb_h1": (
        "model=tiny",
        "model.num_layers=6",
        "parallel.pp=4",
        "parallel.first_stage_layers=1",
        "parallel.last_stage_layers=1",
        "parallel.schedule=zb_h1",
        "parallel.dp=1",
        "parallel.global_batch=8",
        "cluster.gpus_per_node=4",
    ),
    "zero3_dp4": (
        "model=tiny",
        "parallel.zero=3",
        "parallel.dp=4",
        "cluster.gpus_per_node=4",
        "parallel.global_batch=8",
    ),
    "zero2_offload": (
        "model=tiny",
        "parallel.zero=2",
        "parallel.dp=2",
        "cluster.gpus_per_node=2",
        "parallel.offload=cpu",
    ),
    "vpp2_pp2_dp2": (
        "model=tiny",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.dp=2",
        "parallel.zero=1",
        "parallel.schedule=interleaved_1f1b",
        "parallel.global_batch=8",
        "cluster.gpus_per_node=4",
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_unmodified_engine_passes(tmp_path, layout):
    doc, code = _rehearse(tmp_path, *LAYOUTS[layout])
    assert code == EXIT_OK and doc["ok"], doc["defects"][:2]
    assert doc["rehearsed_ranks"] == doc["layout"]["world_size"]
    phases = {p for r in doc["ranks"] for per in r["collectives"].values() for p in per}
    assert {"forward_backward", "optimizer", "save", "resume"} <= phases
    if "cp" in layout:  # the ring ran: batched exchanges on the cp group, after its communicator's collective
        kinds = {k for r in doc["ranks"] for k in r["collectives"]}
        assert any(k.startswith("p2p:cp") for k in kinds), kinds


# ---- the mutations ------------------------------------------------------------------------------------------------


def _split_ring(self, send, tag):
    """The ring exchange as it was: a separate isend then irecv."""
    recv = torch.empty_like(send)
    return recv, [
        comm.isend(send, self.next, group=self.group, tag=tag),
        comm.irecv(recv, self.prev, group=self.group, tag=tag),
    ]


@pytest.mark.parametrize("layout", ["cp2", "cp3_tp2_sp_pp2"])
def test_a_split_ring_exchange_is_a_deadlock(tmp_path, monkeypatch, layout):
    from training.parallel import context

    monkeypatch.setattr(context._Ring, "start", _split_ring)
    doc, code = _rehearse(tmp_path, *LAYOUTS[layout])
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "deadlock" and "cycle of waits" in d["message"], d
    assert any("_split_ring" in s for s in d["sites"]), d["sites"]  # the (patched) ring's own line
    assert all("isend" in seq[0] for seq in d["sequences"].values()), d["sequences"]


def test_a_cpu_tensor_in_an_all_reduce_is_found(tmp_path, monkeypatch):
    """moe_metrics as it was: the table reduced on the CPU."""
    from training.model import moe

    def cpu_table(chunks, mesh, num_layers, num_experts):
        table = torch.zeros(num_layers, num_experts + 3, dtype=torch.float64)
        comm.all_reduce_op(table, group=mesh.dp_group)
        return {}

    monkeypatch.setattr(moe, "moe_metrics", cpu_table)
    import training.observe.moe_load as moe_load
    import training.run.loop as loop

    monkeypatch.setattr(moe_load, "moe_metrics", cpu_table)
    real_step = loop.Trainer.train_step

    def step_and_log(self, *a, **k):
        out = real_step(self, *a, **k)
        moe_load.moe_metrics(self.chunks, self.mesh, self.cfg.model.num_layers, self.cfg.model.num_experts)
        return out

    monkeypatch.setattr(loop.Trainer, "train_step", step_and_log)
    doc, code = _rehearse(tmp_path, *LAYOUTS["ep2_moe"])
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "foreign_device" and "cpu tensor reaches all_reduce" in d["message"], d
    assert "tests/engine/test_rehearse.py" in d["sites"][0] and sorted(d["ranks"]) == [0, 1, 2, 3]


def test_one_rank_issuing_one_collective_more_is_a_mismatch(tmp_path, monkeypatch):
    """An MoE branch on the local routing (ep rank 1 exchanges its counts twice): its ep group diverges."""
    from training.model import moe

    real = moe.MoEMLP._dispatch_compute_combine

    def branchy(self, send, counts):
        if self.ep > 1 and self.first_expert > 0:
            comm.all_to_all_single(torch.empty_like(counts), counts.contiguous(), group=self.ep_group)
        return real(self, send, counts)

    monkeypatch.setattr(moe.MoEMLP, "_dispatch_compute_combine", branchy)
    doc, code = _rehearse(tmp_path, *LAYOUTS["ep2_moe"])
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "mismatch" and "all_to_all_single" in d["message"], d
    # ep rank 1's extra count exchange shifts its sequence: the next call differs (counts against tokens).
    assert len(d["ranks"]) == 2 and len(d["sequences"]) == 2
    assert any("int64" in x for seq in d["sequences"].values() for x in seq)


def test_two_collectives_in_a_different_order_is_a_mismatch(tmp_path, monkeypatch):
    """dp rank 1 reduces the norm's two partial sums in the opposite order."""
    import training.run.loop as loop

    real = loop.Trainer._global_loss

    def swapped(self, local):
        a = torch.zeros(1, device=self.mesh.device)
        b = torch.zeros(2, device=self.mesh.device)
        first, second = (a, b) if self.mesh.dp_rank == 0 else (b, a)
        comm.all_reduce_op(first, group=self.mesh.dp_group)
        comm.all_reduce_op(second, group=self.mesh.dp_group)
        return real(self, local)

    monkeypatch.setattr(loop.Trainer, "_global_loss", swapped)
    doc, code = _rehearse(tmp_path, *LAYOUTS["zero3_dp4"])
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "mismatch" and "float32[1]" in d["message"] and "float32[2]" in d["message"], d


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_the_save_and_resume_are_the_checkpoint_managers(tmp_path, monkeypatch, async_save):
    """The save's and the resume's calls are CheckpointManager's own (training/checkpoint/manager.py), with only
    its file I/O recorded: one extra collective in its sealing, on rank 1 only, is a mismatch in phase save (in
    the async save's background job too); one in its verification is a mismatch in phase resume."""
    from training.checkpoint.manager import CheckpointManager

    real_commit, real_verify = CheckpointManager._commit_or_clean, CheckpointManager._verify_shared

    def commit(self, *args, **kwargs):
        if self.rank == 1:
            comm.barrier(group=self._ckpt_group)
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "_commit_or_clean", commit)
    layout = (*LAYOUTS["cp2"], f"train.async_save={async_save}")
    doc, code = _rehearse(tmp_path, *layout)
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "mismatch" and "barrier" in d["message"] and "[save]" in d["message"], d
    assert sorted(d["ranks"]) == [0, 1]

    def verify(self, directory):
        if self.rank == 1:
            comm.barrier(group=self._ckpt_group)
        return real_verify(self, directory)

    monkeypatch.setattr(CheckpointManager, "_commit_or_clean", real_commit)
    monkeypatch.setattr(CheckpointManager, "_verify_shared", verify)
    doc, code = _rehearse(tmp_path, *layout, name="resume")
    assert code == EXIT_REHEARSAL_DEFECT
    d = doc["defects"][0]
    assert d["kind"] == "mismatch" and "barrier" in d["message"] and "[resume]" in d["message"], d


def test_a_pipeline_send_without_its_receive_is_found(tmp_path, monkeypatch):
    """One pipeline exchange loses its receive (the first rank that receives drops it from its batch): the
    sender's batch waits for a receive that never comes."""
    real = comm.batch_isend_irecv
    dropped = []

    def lossy(ops):
        recvs = [p for p in ops if p.op is torch.distributed.irecv]
        if recvs and not dropped:
            dropped.append(comm.rank())
            ops = [p for p in ops if p is not recvs[0]]
        return real(ops)

    monkeypatch.setattr(comm, "batch_isend_irecv", lossy)
    doc, code = _rehearse(tmp_path, *LAYOUTS["vpp2_pp2_dp2"])
    assert code == EXIT_REHEARSAL_DEFECT and dropped
    d = doc["defects"][0]
    assert d["kind"] == "deadlock", d
    assert "lossy" in " ".join(d["sites"]) and "send" in json.dumps(d["sequences"]), d  # the exchange's batch


# ---- the checks on their own ----------------------------------------------------------------------------------


def _call(order, op, group, peer=None, batch=None, numel=4, site="x.py:1 (f)"):
    return comm.CommCall(
        order, op, tuple(group), "float32", numel, "meta", site, "forward_backward", peer=peer, batch=batch
    )


def test_the_deadlock_simulation_follows_nccl_rules():
    g = (0, 1)
    # cp = 2's split exchange: both ranks send first on the pair: a cycle.
    split = {r: [_call(0, "isend", g, peer=1 - r), _call(1, "irecv", g, peer=1 - r)] for r in (0, 1)}
    d = checks.check_deadlock(split, 2)
    assert d and "cycle" in d[0].message and sorted(d[0].ranks) == [0, 1]
    # The same exchange batched: fine.
    batched = {r: [_call(0, "send", g, peer=1 - r, batch=0), _call(1, "recv", g, peer=1 - r, batch=0)] for r in (0, 1)}
    assert checks.check_deadlock(batched, 2) == []
    # Un-batched but ordered send/recv against recv/send: fine.
    ordered = {
        0: [_call(0, "isend", g, peer=1), _call(1, "irecv", g, peer=1)],
        1: [_call(0, "irecv", g, peer=0), _call(1, "isend", g, peer=0)],
    }
    assert checks.check_deadlock(ordered, 2) == []
    # A middle pipeline stage's batch names two peers: rank 0's receive matches rank 1's send at once and rank 0
    # moves on to a collective, while rank 1's batch still waits for rank 2's send. The matched op stays matched
    # (NCCL runs the batch's ops together): no deadlock (a rule that re-checked rank 0's current call found one).
    middle = {
        0: [_call(0, "recv", g, peer=1, batch=0), _call(1, "all_reduce", (0, 1, 2))],
        1: [
            _call(0, "send", g, peer=0, batch=0),
            _call(1, "recv", g, peer=2, batch=0),
            _call(2, "all_reduce", (0, 1, 2)),
        ],
        2: [_call(0, "all_reduce", (9,)), _call(1, "send", g, peer=1, batch=0), _call(2, "all_reduce", (0, 1, 2))],
    }
    assert checks.check_deadlock(middle, 3) == []
    # Two batches posted in the same order on both sides of a direction pair by issue order: the second send of
    # rank 0 meets rank 1's second receive even though rank 1 posts them in separate batches.
    two = {
        0: [_call(0, "send", g, peer=1, batch=0), _call(1, "send", g, peer=1, batch=0)],
        1: [_call(0, "recv", g, peer=0, batch=0), _call(1, "recv", g, peer=0, batch=1)],
    }
    assert checks.check_deadlock(two, 2) == []
    # A send whose receiver finished: unmatched.
    lonely = {0: [_call(0, "send", g, peer=1, batch=0)], 1: []}
    d = checks.check_deadlock(lonely, 2)
    assert d and "finished without the matching call" in d[0].message
    # Collectives in a different order on two groups: a cycle through the collectives.
    crossed = {
        0: [_call(0, "all_reduce", (0, 1)), _call(1, "all_reduce", (0, 1, 2))],
        1: [_call(0, "all_reduce", (0, 1, 2)), _call(1, "all_reduce", (0, 1))],
        2: [_call(0, "all_reduce", (0, 1, 2))],
    }
    assert checks.check_deadlock(crossed, 3)


def test_the_simulation_stops_where_it_stops_whatever_the_ranks_order():
    """The simulation moves rank by rank as events allow (training/rehearse/checks.py _Simulation); where the ranks
    stop, and the report, do not depend on the order it tries them in. A 64-rank world: a ring of batched sends,
    world and pair collectives, then rank 5 issuing one pair's two collectives in the other order."""
    world = 64
    calls = {}
    for r in range(world):
        nxt, prev = (r + 1) % world, (r - 1) % world
        seq = [_call(0, "all_reduce", range(world))]
        seq += [_call(1, "send", range(world), peer=nxt, batch=0), _call(2, "recv", range(world), peer=prev, batch=0)]
        pair = (r // 2 * 2, r // 2 * 2 + 1)
        seq += [_call(3, "all_reduce", pair), _call(4, "all_reduce", range(world), numel=8)]
        calls[r] = seq
    assert checks.check_deadlock(calls, world) == []
    assert checks.check_deadlock(dict(reversed(list(calls.items()))), world) == []
    calls[5] = calls[5][:3] + [calls[5][4], calls[5][3]]  # rank 5: the world's collective before its pair's
    reports = [checks.check_deadlock(dict(order), world) for order in (calls.items(), reversed(list(calls.items())))]
    assert reports[0] and [d.to_json() for d in reports[0]] == [d.to_json() for d in reports[1]]
    assert "cycle" in reports[0][0].message and sorted(reports[0][0].ranks) == [4, 5], reports[0][0]


# ---- the presets at their documented sizes (slow: one rank each, ~30 s) ------------------------------------------

REAL_SIZE = {
    # docs/GUIDE.md's Mixtral plan: the activations (router input, the gated output index_add saves, the indices)
    # and both optimizers' param-gather windows in flight at once.
    "mixtral_8x7b_tp2_sp_ep8_zero1": (
        "model=mixtral_8x7b",
        "cluster=dgx_h100",
        "cluster.nodes=8",
        "parallel.auto=false",
        "parallel.tp=2",
        "parallel.pp=1",
        "parallel.sp=true",
        "parallel.ep=8",
        "parallel.zero=1",
        "parallel.micro_batch=1",
        "parallel.global_batch=512",
        "parallel.dp=null",
        "train.precision=bf16",
    ),
    # zero=3 at pp = 1: two neighbouring units gathered at once (the embedding and the first layer).
    "llama3_8b_zero3_full": (
        "model=llama3_8b",
        "cluster=dgx_h100",
        "cluster.nodes=1",
        "parallel.auto=false",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.dp=8",
        "parallel.zero=3",
        "parallel.recompute=full",
        "parallel.micro_batch=1",
        "parallel.global_batch=64",
        "train.precision=bf16",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(REAL_SIZE))
def test_real_size_memory_matches_the_plan(tmp_path, layout):
    """Rank 0 of the preset at its real size: every memory part within memory.TOLERANCE of plan.json."""
    from helpers.cli import run_cli

    from training.contract.config import load_config
    from training.rehearse.memory import TOLERANCE

    run_dir = str(tmp_path / "run")
    res = run_cli("action=plan", f"run.dir={run_dir}", *REAL_SIZE[layout], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = load_config(os.path.join(run_dir, "config.json"))
    cfg.run.dir = run_dir
    doc, code = rehearse(cfg, run_dir, ranks=[0], workers=1, quiet=True)
    assert not doc["ranks"][0]["error"], doc["ranks"][0]["error"]
    rows = {m["part"]: m for m in doc["ranks"][0]["memory"]}
    for part in ("weights", "grads", "optimizer", "activations", "param_gather", "zero3_gathered"):
        m = rows[part]
        assert abs(m["rehearsed"] - m["planned"]) <= TOLERANCE * max(m["planned"], 1), m
    assert code == EXIT_OK, doc["defects"]


def test_the_tracked_peak_is_compared_with_the_plans_total():
    """The parts the plan has no figure for (checkpoint staging) are shown and judged through the total: the
    tracked device peak against plan.json's memory_bytes total, with the parts' tolerance. The pipeline messages
    are a planned part, compared on their own and inside the step's transient peak."""
    from types import SimpleNamespace

    from training.rehearse.memory import compare, memory_defects, tracked_total

    gib = 2**30
    measured = {"weights": 10 * gib, "grads": 10 * gib, "optimizer": 20 * gib, "activations": 4 * gib}
    measured.update(pipeline_messages=2 * gib, checkpoint_staging=3 * gib, checkpoint_staging_host=40 * gib)
    measured.update(param_gather=gib)  # the plan's reserve: outside its total
    assert tracked_total(measured) == 40 * gib + max(4 * gib + 2 * gib, 3 * gib)
    measured["checkpoint_staging"] = 8 * gib  # a save's staging above the step's transient peak
    assert tracked_total(measured) == 40 * gib + max(4 * gib + 2 * gib, 8 * gib)
    planned = {k: v for k, v in measured.items() if k in ("weights", "grads", "optimizer", "activations")}
    planned.update(param_gather=gib, pipeline_messages=2 * gib, total=46 * gib)  # staging unplanned: 48 tracked
    rows = {r["part"]: r for r in compare(measured, planned)}
    assert all(rows[p]["ok"] for p in rows if p != "total")
    assert rows["checkpoint_staging"]["rehearsed"] == 8 * gib and not rows["total"]["ok"]
    assert rows["pipeline_messages"]["planned"] == 2 * gib
    result = SimpleNamespace(error="", memory=measured, coords={"pp": 0}, rank=3)
    (defect,) = memory_defects([result], {"memory_bytes": planned})
    assert defect.kind == "memory" and "total" in defect.message and defect.ranks == [3], defect
    planned["total"] = 48 * gib
    assert memory_defects([result], {"memory_bytes": planned}) == []
    # messages the plan does not count are a part of their own that differs
    (defect,) = memory_defects([result], {"memory_bytes": dict(planned, pipeline_messages=0)})
    assert "pipeline_messages" in defect.message and "the plan counts none" in defect.message, defect


# ---- which ranks run, and the CLI ------------------------------------------------------------------------------


def test_select_runs_every_rank_up_to_256_then_classes_and_whole_groups():
    from training.parallel.mesh import coords_of, rank_groups
    from training.rehearse import ranks

    assert ranks.select(4, 2, 1, 32)[0] == list(range(256))
    assert set(ranks.select(2, 2, 2, 4, 2)[1].values()) == {"all"}
    tp, pp, cp, dp, ep = 8, 2, 2, 32, 4  # 1,024 ranks
    chosen, why = ranks.select(tp, pp, cp, dp, ep)
    assert len(chosen) < 256 and set(chosen) == set(why)
    classes = {
        ranks.coordinate_class(coords_of(r, tp, pp, cp, dp), tp, pp, cp, dp, ep) for r in range(tp * pp * cp * dp)
    }
    have = {ranks.coordinate_class(coords_of(r, tp, pp, cp, dp), tp, pp, cp, dp, ep) for r in chosen}
    assert have == classes and len(classes) > 2 * 3 * 2
    for kind, lists in rank_groups(tp, pp, cp, dp, ep).items():  # every member of one group of each kind
        assert any(set(g) <= set(chosen) for g in lists), kind


_MUTATED = """
import sys, torch
from training.parallel import context, collectives as comm
def start(self, send, tag):
    recv = torch.empty_like(send)
    return recv, [comm.isend(send, self.next, group=self.group, tag=tag), comm.irecv(recv, self.prev, group=self.group, tag=tag)]
context._Ring.start = start
from training.rehearse.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_cli_rehearses_and_exits_6_on_a_defect(tmp_path, monkeypatch):
    """meshrun action=rehearse: the plan gate, the rehearsal in its own process, its exit code the command's; the
    split ring exchange put into that process is a deadlock (exit 6), the unmodified engine passes (exit 0)."""
    import sys

    from helpers.cli import run_cli

    from launcher.launch import rehearse as launch

    args = [*CUDA, *LAYOUTS["cp2"], "parallel.auto=false", "parallel.tp=1", "parallel.zero=0"]
    res = run_cli("action=rehearse", f"run.dir={tmp_path / 'ok'}", *args, cwd=tmp_path)
    assert res.returncode == EXIT_OK, res.stderr[-2000:]
    monkeypatch.setattr(launch, "rehearse_argv", lambda run_dir: [sys.executable, "-c", _MUTATED, run_dir])
    res = run_cli("action=rehearse", f"run.dir={tmp_path / 'bad'}", *args, cwd=tmp_path)
    assert res.returncode == EXIT_REHEARSAL_DEFECT, res.stderr[-2000:]
    with open(tmp_path / "bad" / "rehearsal.json") as f:
        doc = json.load(f)
    assert doc["defects"][0]["kind"] == "deadlock" and not doc["ok"]


# ---- deduplication: one rank per coordinate class, the others derived (training/rehearse/dedup.py) ------------

DEDUP_LAYOUTS = {
    "tp2_pp2_dp2_zero1": (
        "model=tiny",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.zero=1",
        "parallel.global_batch=8",
        "cluster.gpus_per_node=8",
    ),
    # 127,974 parameters: the last of the 4 ZeRO-3 shards (31,994 each) carries 2 elements of padding
    "zero3_dp4_uneven": LAYOUTS["zero3_dp4"]
    + ("model.hidden_size=66", "model.num_attention_heads=2", "model.vocab_size=501"),
    # vocab 250 over tp 4 (padded to 252 rows: 63 a rank; the middle tp ranks derived)
    "tp4_sp_dp4": (
        "model=tiny",
        "model.vocab_size=250",
        "parallel.tp=4",
        "parallel.sp=true",
        "parallel.dp=4",
        "parallel.zero=1",
        "parallel.global_batch=8",
        "cluster.gpus_per_node=16",
    ),
    "ep2_moe": LAYOUTS["ep2_moe"],
    "cp2": LAYOUTS["cp2"],
    "cp4": LAYOUTS["cp4"],
    "ep8_moe": LAYOUTS["ep8_moe"],
}


@pytest.mark.parametrize("layout", sorted(DEDUP_LAYOUTS))
def test_dedup_derives_exactly_what_every_rank_runs(tmp_path, layout):
    """Every rank run on its own against its class representative's calls relabelled: the same calls (op, group,
    dtype, numel, device, site, phase, root, peer, batch, ...), groups, memory, and the same check results."""
    import dataclasses

    from training.contract.config import derived_dp
    from training.rehearse import dedup
    from training.rehearse.runner import rehearsal_config, rehearse_rank

    cfg = compose_cfg(*CUDA, *DEDUP_LAYOUTS[layout])
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, exist_ok=True)
    cfg.run.dir = run_dir
    p, dp = cfg.parallel, derived_dp(cfg)
    world = p.tp * p.pp * p.cp * dp
    rc = rehearsal_config(cfg)
    full = {r: rehearse_rank(rc, run_dir, r, emulate="nccl") for r in range(world)}
    assert not [x.error for x in full.values() if x.error]
    members = dedup.classes(list(range(world)), p.tp, p.pp, p.cp, dp, p.ep)
    derived = {}
    for rep, others in members.items():
        derived[rep] = full[rep]
        for r in others:
            d = dedup.derive_result(full[rep], r, p.tp, p.pp, p.cp, dp, p.ep)
            want = full[r]
            assert [dataclasses.asdict(c) for c in d.calls] == [dataclasses.asdict(c) for c in want.calls], (rep, r)
            assert (d.coords, d.groups, d.memory) == (want.coords, want.groups, want.memory), (rep, r)
            derived[r] = d
    if layout in ("zero3_dp4_uneven", "tp4_sp_dp4", "cp4", "ep8_moe"):
        assert len(members) < world  # middle positions were derived
    got_calls, want_calls = {r: x.calls for r, x in derived.items()}, {r: x.calls for r, x in full.items()}
    for dev in ("cuda", "cpu"):
        got = checks.check_matching(got_calls, world) + checks.check_devices(got_calls, dev)
        want = checks.check_matching(want_calls, world) + checks.check_devices(want_calls, dev)
        got += checks.check_deadlock(got_calls, world)
        want += checks.check_deadlock(want_calls, world)
        assert [x.to_json() for x in got] == [x.to_json() for x in want]


def test_dedup_rehearsal_reports_as_the_full_one(tmp_path):
    """rehearse(dedup=True) against dedup=False on a layout with middle dp ranks: the same rehearsal.json, less
    the timings and the derivation notes; fewer engine runs."""
    a, code_a = _rehearse(tmp_path, *DEDUP_LAYOUTS["zero3_dp4_uneven"], name="dedup")
    cfg = compose_cfg(*CUDA, *DEDUP_LAYOUTS["zero3_dp4_uneven"])
    run_dir = str(tmp_path / "full")
    os.makedirs(run_dir, exist_ok=True)
    cfg.run.dir = run_dir
    b, code_b = rehearse(cfg, run_dir, workers=1, quiet=True, dedup=False)
    assert code_a == code_b == EXIT_OK and a["engine_runs"] < b["engine_runs"] == b["layout"]["world_size"]

    def strip(doc):
        ranks = [{k: v for k, v in r.items() if k not in ("seconds", "why")} for r in doc["ranks"]]
        timings = ("seconds", "check_seconds", "engine_runs")
        return {**{k: v for k, v in doc.items() if k not in timings}, "ranks": ranks}

    assert strip(a) == strip(b)
