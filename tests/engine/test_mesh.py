"""Process mesh: rank order and group membership (pure), and real gloo groups on 4 processes."""

import itertools
import os

import pytest
from helpers.dist import run_distributed

from training.parallel.mesh import GROUP_KINDS, ProcessMesh, coords_of, rank_groups, rank_of


def test_rank_groups_2x2x2_tp_pp_dp():
    g = rank_groups(tp=2, pp=2, cp=1, dp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == [[r] for r in range(8)]
    assert g["dp_cp"] == g["dp"]
    assert g["model_parallel"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["embedding"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_rank_groups_with_cp():
    g = rank_groups(tp=2, pp=1, cp=2, dp=2)
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["model_parallel"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["embedding"] == [[r] for r in range(8)]  # pp = 1: the stage is both first and last


@pytest.mark.parametrize("tp,pp,cp,dp", [(1, 1, 1, 1), (2, 2, 2, 2), (4, 1, 1, 2), (1, 4, 1, 2), (2, 3, 1, 1)])
def test_every_kind_partitions_the_world_and_matches_coordinates(tp, pp, cp, dp):
    world = tp * pp * cp * dp
    groups = rank_groups(tp, pp, cp, dp)
    for kind in GROUP_KINDS:
        flat = sorted(itertools.chain.from_iterable(groups[kind]))
        assert flat == list(range(world)), kind
    for r in range(world):
        c = coords_of(r, tp, pp, cp, dp)
        assert rank_of(c["tp"], c["cp"], c["pp"], c["dp"], tp, cp, pp) == r
        tp_group = next(x for x in groups["tp"] if r in x)
        assert [coords_of(x, tp, pp, cp, dp)["tp"] for x in tp_group] == list(range(tp))
        emb = next(x for x in groups["embedding"] if r in x)
        stages = {coords_of(x, tp, pp, cp, dp)["pp"] for x in emb}
        assert stages == ({0, pp - 1} if c["pp"] in (0, pp - 1) else {c["pp"]})


def test_single_mesh_has_no_groups():
    m = ProcessMesh.single()
    assert (m.world_size, m.tp, m.is_first_stage, m.is_last_stage, m.tp_group) == (1, 1, True, True, None)


def test_from_env_without_env_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK"):
        ProcessMesh.from_env(1, 1, 1, 1)


def _mesh_worker(tp, pp, cp, dp):
    import torch
    import torch.distributed as dist

    try:  # a layout that does not multiply to WORLD_SIZE is refused before joining the job
        ProcessMesh.from_env(tp, pp, cp, dp + 1, backend="gloo", timeout_s=60)
        wrong_world = "no error"
    except ValueError as e:
        wrong_world = str(e)
    mesh = ProcessMesh.from_env(tp, pp, cp, dp, backend="gloo", timeout_s=60)
    out = {
        "wrong_world": wrong_world,
        "rank": mesh.rank,
        "coords": (mesh.tp_rank, mesh.cp_rank, mesh.pp_rank, mesh.dp_rank),
        "first": mesh.is_first_stage,
        "last": mesh.is_last_stage,
        "ranks": dict(mesh.group_ranks),
        "sums": {},
    }
    for kind in GROUP_KINDS:
        group = getattr(mesh, f"{kind}_group")
        x = torch.tensor([float(mesh.rank)])
        dist.all_reduce(x, group=group)  # proves the group really holds those ranks
        out["sums"][kind] = x.item()
        out["ranks"][kind + "_torch"] = dist.get_process_group_ranks(group)
    mesh.destroy()
    return out


def test_real_groups_on_4_processes():
    tp, pp, cp, dp = 2, 2, 1, 1
    expected = rank_groups(tp, pp, cp, dp)
    results = run_distributed(_mesh_worker, 4, args=(tp, pp, cp, dp), timeout_s=90)
    for r, res in enumerate(results):
        assert res["rank"] == r
        assert "WORLD_SIZE=4" in res["wrong_world"] and "parallel.dp" in res["wrong_world"], res["wrong_world"]
        c = coords_of(r, tp, pp, cp, dp)
        assert res["coords"] == (c["tp"], c["cp"], c["pp"], c["dp"])
        assert res["first"] == (c["pp"] == 0) and res["last"] == (c["pp"] == pp - 1)
        for kind in GROUP_KINDS:
            mine = next(x for x in expected[kind] if r in x)
            assert res["ranks"][kind] == mine, kind
            assert sorted(res["ranks"][kind + "_torch"]) == mine, kind
            assert res["sums"][kind] == float(sum(mine)), kind


def _dead_peer_worker(timeout_s, done_file):
    import time

    import torch
    import torch.distributed as dist

    mesh = ProcessMesh.from_env(2, 1, 1, 1, backend="gloo", timeout_s=timeout_s)
    if mesh.rank == 1:
        # A peer that never joins the collective (hung or dead): it stays away until rank 0 has given up (a file
        # rank 0 writes then, not a clock), bounded in case rank 0 never does.
        deadline = time.monotonic() + 20 * timeout_s
        while not os.path.exists(done_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.tp_group)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        open(done_file, "w").close()
    return {"error": error, "waited_s": time.monotonic() - t0}


def test_subgroup_collective_with_a_dead_peer_times_out_after_timeout_s(tmp_path):
    # new_group does not inherit init_process_group's timeout: without passing it, a TP collective
    # would wait torch's 30-minute default instead of train.dist_timeout_s.
    res = run_distributed(_dead_peer_worker, 2, args=(3.0, str(tmp_path / "gave_up")), timeout_s=60)[0]
    assert res["error"] is not None
    assert 2.0 <= res["waited_s"] < 10.0, res
