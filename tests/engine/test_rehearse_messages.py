"""Pipeline messages in flight: the rehearsal's model of NCCL's p2p works (training/rehearse/messages.py, from every
pipeline rank's exchanges) and the plan's closed form (launcher/plan/memory.py pipeline_message_count) count the
same sends; a cuda rehearsal's engine holds exactly those, and at the presets' real sizes plan.json's
pipeline_messages part and total agree with the rehearsal."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from helpers.cli import compose_cfg

from launcher.plan.estimate import make_plan
from launcher.plan.memory import pipeline_message_bytes, pipeline_message_count
from training.contract.exit_codes import EXIT_OK
from training.rehearse.main import rehearse
from training.rehearse.messages import lone_send_releases, peak_lone_sends
from training.schedules.pipeline import build_comm_plan, check_schedule


def _cfg(kind: str, p: int, v: int = 1, device: str = "cuda", overlap: bool = True, group: int = 0):
    par = SimpleNamespace(pp=p, vpp=v, schedule=kind, overlap_p2p=overlap, microbatch_group_size=group)
    return SimpleNamespace(parallel=par, cluster=SimpleNamespace(device=device))


def test_the_plans_count_is_the_schedules():
    """Every rank of every schedule at pp 2..6 and m up to 3 p: the closed form is the happens-before count."""
    cases = 0
    for kind, vs in (("1f1b", (1,)), ("gpipe", (1,)), ("zb_h1", (1,)), ("interleaved_1f1b", (2, 3))):
        for v in vs:
            for p in range(2, 7):
                for m in range(1, 3 * p + 1):
                    try:
                        check_schedule(kind, p, v, m, 0)
                    except ValueError:
                        continue
                    for r in range(p):
                        got = pipeline_message_count(_cfg(kind, p, v), r, m)
                        assert got == peak_lone_sends(kind, p, r, m, v), (kind, v, p, m, r)
                        cases += 1
    assert cases > 500


def test_without_overlap_none_and_on_gloo_every_send():
    assert pipeline_message_count(_cfg("1f1b", 4, overlap=False), 0, 8) == 0
    # gloo never reports a send complete before its wait: every send of the step, at its end.
    assert [pipeline_message_count(_cfg("1f1b", 4, device="cpu"), r, 8) for r in range(4)] == [8, 16, 16, 8]
    assert pipeline_message_count(_cfg("interleaved_1f1b", 2, 2, device="cpu"), 1, 4) == 4 * 3
    # interleaved with groups other than pp: the same bound on NCCL
    assert pipeline_message_count(_cfg("interleaved_1f1b", 2, 2, group=3), 0, 6) == 6 * 3


def test_a_lone_send_is_released_once_a_later_message_proves_its_receive_posted():
    """1f1b, pp 4, m 8: rank 0's warm-up sends go alone and stay until the first grad arrives (the exchange
    before B(0), which rank 1 sent after receiving them all); the last stage's last grad is never acknowledged."""
    releases = lone_send_releases("1f1b", 4, 8)
    assert releases[0] == {0: 3, 1: 3, 2: 3}
    # the last exchange of every other rank is its last grad alone, released only at the step's end
    n = [len([s for s in build_comm_plan("1f1b", 4, r, 8) if isinstance(s[0], tuple)]) for r in range(4)]
    assert [releases[r] for r in (1, 2, 3)] == [{n[r] - 1: n[r]} for r in (1, 2, 3)]


CUDA = ("cluster.device=cuda", "data=synthetic", "train.precision=bf16", "parallel.micro_batch=1")
TINY = {
    "pp4_1f1b": ("model=tiny", "parallel.pp=4", "parallel.dp=1", "parallel.global_batch=8", "cluster.gpus_per_node=4"),
    "pp4_zb_h1": (
        "model=tiny",
        "parallel.pp=4",
        "parallel.schedule=zb_h1",
        "parallel.dp=1",
        "parallel.global_batch=8",
        "cluster.gpus_per_node=4",
    ),
    "pp2_vpp2": (
        "model=tiny",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.schedule=interleaved_1f1b",
        "parallel.dp=1",
        "parallel.global_batch=4",
        "cluster.gpus_per_node=2",
    ),
}


@pytest.mark.parametrize("layout", sorted(TINY))
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_each_ranks_messages_are_the_plans(tmp_path, layout, device):
    """Every rank of a tiny pipeline: the engine's own peak of held messages (StepStats.peak_message_bytes) under
    the rehearsal equals plan.json's pipeline_messages of its stage, byte for byte (cuda: NCCL's works; cpu:
    gloo's)."""
    cfg = compose_cfg(*CUDA, *TINY[layout], f"cluster.device={device}")
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg.run.dir = run_dir
    plan = make_plan(cfg)
    doc, _ = rehearse(cfg, run_dir, workers=1, quiet=True, dedup=False)
    p = cfg.parallel
    m = p.global_batch // (p.micro_batch * p.dp)
    for r in doc["ranks"]:
        assert not r["error"], r["error"]
        stage = r["coords"]["pp"]
        row = next(x for x in r["memory"] if x["part"] == "pipeline_messages")
        planned = plan.stages[stage].memory_bytes["pipeline_messages"]
        assert row["rehearsed"] == planned == pipeline_message_bytes(cfg, stage, m) > 0, (r["rank"], row)


# ---- the presets at their real sizes (slow: one rank per stage) --------------------------------------------------

H100 = ("cluster=dgx_h100", "parallel.auto=false", "train.precision=bf16", "parallel.micro_batch=1")
REAL_SIZE = {
    # the interleaved layout: 3 GiB of messages rehearsed and none planned before
    "llama3_70b_tp8_pp4_vpp2": (
        "model=llama3_70b",
        "cluster.nodes=8",
        "parallel.tp=8",
        "parallel.pp=4",
        "parallel.vpp=2",
        "parallel.schedule=interleaved_1f1b",
        "parallel.dp=2",
        "parallel.zero=1",
        "parallel.recompute=full",
        "parallel.global_batch=16",
    ),
    "llama3_70b_zb_h1_uneven": (
        "model=llama3_70b",
        "cluster.nodes=8",
        "parallel.tp=8",
        "parallel.pp=4",
        "parallel.schedule=zb_h1",
        "parallel.first_stage_layers=19",
        "parallel.last_stage_layers=19",
        "parallel.dp=2",
        "parallel.zero=1",
        "parallel.recompute=full",
        "parallel.global_batch=16",
    ),
    "llama3_8b_tp4_sp_pp2": (
        "model=llama3_8b",
        "cluster.nodes=8",
        "parallel.tp=4",
        "parallel.sp=true",
        "parallel.pp=2",
        "parallel.dp=8",
        "parallel.zero=1",
        "parallel.global_batch=64",
    ),
    "gpt3_175b_tp8_sp_pp8": (
        "model=gpt3_175b",
        "cluster.nodes=128",
        "parallel.tp=8",
        "parallel.sp=true",
        "parallel.pp=8",
        "parallel.dp=16",
        "parallel.zero=1",
        "parallel.recompute=full",
        # 8 micro-batches per rank (m = pp) instead of the preset's 96: the messages in flight and the peak are set
        # by the 1F1B warm-up, which m = pp already reaches, at a twelfth of the engine's work.
        "parallel.global_batch=128",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(REAL_SIZE))
def test_real_size_messages_and_total_match_the_plan(tmp_path, layout):
    """One rank of each pipeline stage at the real size: pipeline_messages and the total within memory.TOLERANCE."""
    from helpers.cli import run_cli

    from training.contract.config import load_config
    from training.rehearse.memory import TOLERANCE

    run_dir = str(tmp_path / "run")
    res = run_cli("action=plan", f"run.dir={run_dir}", "train.checkpoint_every_min=60", *H100, *REAL_SIZE[layout])
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = load_config(os.path.join(run_dir, "config.json"))
    cfg.run.dir = run_dir
    p = cfg.parallel
    ranks = [stage * p.tp * p.cp for stage in range(p.pp)]
    doc, code = rehearse(cfg, run_dir, ranks=ranks, workers=1, quiet=True)
    for r in doc["ranks"]:
        assert not r["error"], r["error"]
        rows = {m["part"]: m for m in r["memory"]}
        for part in ("pipeline_messages", "total"):
            m = rows[part]
            assert abs(m["rehearsed"] - m["planned"]) <= TOLERANCE * max(m["planned"], 1), (r["rank"], m)
        assert rows["pipeline_messages"]["planned"] > 0
    assert code == EXIT_OK, doc["defects"]
