"""End-to-end checkpoint acceptance with the real engine (gloo, fp32, tiny model).

- bit-exact resume at tp=2 sp dp=2 zero=1: stopped after step 5 by exit_interval and by a real SIGUSR2
  that reaches one rank only, resumed to 10: exactly the losses of the uninterrupted run;
- resume across layouts (tp 2->1, 1->4, dp 2->4, zero 1->0) within 1e-5 relative;
- resume across pipeline layouts (pp 2->1 and back 1->2, 4-layer model, tp=1 dp=2 zero=1) within 1e-5 relative;
- SIGKILL of a rank in the middle of a save: the previous checkpoint stays the chosen one.

Cases share process launches (the expensive part on CI's two cores): four spawns in all, a mesh per layout
in each (the fixtures killed, four, two, again_four).
"""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any

import pytest
from helpers.dist import run_distributed

from training.checkpoint import storage
from training.contract.config import Config, config_from_dict, config_to_dict
from training.contract.rundir.events import read_events

# Checkpoints every HALF steps; the layout cases go HALF -> LATER -> STEPS; the kill hits the save of KILL.
STEPS, HALF, LATER = 10, 5, 8
KILL_EVERY = 2
KILL = 2 * KILL_EVERY


def _cfg(tp=2, dp=2, sp=True, zero=1, steps=STEPS, pp=1, layers=2, **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = layers, 32, 4, 16
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp, cfg.parallel.zero = tp, dp, sp and tp > 1, zero
    cfg.parallel.pp = pp
    cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 8
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = tp * pp * dp, 1.0  # a fixed peak: no matmul timing
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = steps, 3, False
    cfg.train.dist_timeout_s = 30
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg.data.kind, cfg.data.max_bytes = "text", 60_000
    return cfg


def _train(cfg: Config, run_dir: str, mesh, hook: str = "") -> dict[str, Any]:
    """One Trainer on `mesh` (shared by every case of this layout in the spawn), run to its end."""
    import torch.distributed.checkpoint as dcp

    from training.checkpoint import manager
    from training.run.loop import Trainer

    trainer = Trainer(cfg, run_dir, mesh)
    if hook == "signal" and mesh.rank == 1:
        step_fn = trainer.train_step

        def train_step(*args, **kwargs):
            out = step_fn(*args, **kwargs)
            if trainer.state.step == HALF:
                os.kill(os.getpid(), signal.SIGUSR2)  # only this rank gets it: the ranks must agree anyway
            return out

        trainer.train_step = train_step
    if hook == "kill_in_save" and mesh.rank == 1:
        real_save = dcp.save

        class _Dcp:
            def __getattr__(self, name):
                return getattr(dcp, name)

            @staticmethod
            def save(state, storage_writer, **kwargs):  # kwargs: the checkpoint group (process_group)
                if trainer.state.step == KILL:
                    with open(os.path.join(storage_writer.path, "__1_0.distcp"), "wb") as f:
                        f.write(b"partial")
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_save(state, storage_writer=storage_writer, **kwargs)

        real_dcp = manager._dcp  # the manager imports DCP on first use, through this function
        manager._dcp = lambda: (_Dcp(), real_dcp()[1])
    code = trainer.run()
    if hook == "signal":
        # The stop flag is per process; the next Trainer of this spawn stands for a new process (a relaunch).
        from training.run import signals

        signals.clear()
    return {"code": code, "losses": list(trainer.losses)}


def _spawned(cases: list[tuple[str, dict, str, str]]) -> dict[str, Any]:
    """Every case (name, config, run dir, hook) in order, in this one spawn: a mesh per layout, built once.

    After each case, rank 0 records what the run left on disk (checkpoint steps, latest, events)."""
    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh

    meshes: dict[tuple, Any] = {}
    out: dict[str, Any] = {}
    for name, cfg_dict, run_dir, hook in cases:
        cfg = config_from_dict(cfg_dict)
        p = cfg.parallel
        key = (p.tp, p.pp, p.cp, p.dp)
        if key not in meshes:
            meshes[key] = ProcessMesh.from_env(*key, timeout_s=cfg.train.dist_timeout_s)
        res = _train(cfg, run_dir, meshes[key], hook)
        dist.barrier()  # every rank's part of the final checkpoint is on disk before anyone reads it
        res.update(
            steps=storage.list_steps(run_dir),
            latest=storage.read_latest(run_dir),
            events=read_events(run_dir),
            tmp=[n for n in os.listdir(storage.checkpoints_dir(run_dir)) if n.startswith(".tmp")],
        )
        out[name] = res
    next(iter(meshes.values())).destroy()
    return out


def _run(cases: list[tuple[str, Config, str, str]], timeout_s: float) -> dict[str, Any]:
    """The cases in one spawn of as many ranks as their layouts have (all the same); rank 0's results."""
    worlds = {c.parallel.tp * c.parallel.pp * c.parallel.dp for _, c, _, _ in cases}
    assert len(worlds) == 1, worlds
    plain = [(name, config_to_dict(c), run_dir, hook) for name, c, run_dir, hook in cases]
    return run_distributed(_spawned, worlds.pop(), args=(plain,), timeout_s=timeout_s)[0]


def _pp_cfg(pp: int, **train) -> Config:
    """The pipeline cases: 4 layers (divisible by pp=2), tp=1 dp=2 zero=1; with pp=2 there are
    global_batch / (micro_batch x dp) = 2 micro-batches per step, enough for 1f1b (>= pp)."""
    return _cfg(tp=1, dp=2, zero=1, pp=pp, layers=4, **train)


def _copy_step(src_run: str, step: int, dst_run: str) -> None:
    os.makedirs(storage.checkpoints_dir(dst_run), exist_ok=True)
    shutil.copytree(storage.step_dir(src_run, step), storage.step_dir(dst_run, step))


# Four spawns in all (each case used to be its own): the kill, then every 4-rank case that needs no 2-rank
# checkpoint, then the 2-rank resumes, then the 4-rank resumes of those.
@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """SIGKILL of rank 1 in the middle of the step-KILL save (its own spawn: a rank dies)."""
    run_dir = str(tmp_path_factory.mktemp("killed"))
    with pytest.raises(RuntimeError, match="died|Connection closed|failed") as err:  # whichever rank reports first
        _run([("kill", _cfg(checkpoint_every=KILL_EVERY, dist_timeout_s=10), run_dir, "kill_in_save")], timeout_s=120)
    return {
        "dir": run_dir,
        "error": str(err.value),
        "latest": storage.read_latest(run_dir),
        "steps": storage.list_steps(run_dir),
    }


@pytest.fixture(scope="module")
def four(tmp_path_factory, killed):
    """The 4-rank cases: the uninterrupted STEPS-step reference (leaves step_HALF and step_STEPS checkpoints for
    the layout cases), the stops at HALF and their resumes, the pp=2 reference, the resume after the kill."""
    base = tmp_path_factory.mktemp("four")
    d = {name: str(base / name) for name in ("ref", "exit_interval", "signal", "ref_pp2")}
    return _run(
        [
            ("ref", _cfg(checkpoint_every=HALF), d["ref"], ""),
            ("exit_interval_first", _cfg(exit_interval=HALF), d["exit_interval"], ""),
            ("exit_interval_second", _cfg(), d["exit_interval"], ""),
            ("signal_first", _cfg(), d["signal"], "signal"),
            ("signal_second", _cfg(), d["signal"], ""),
            ("ref_pp2", _pp_cfg(2, checkpoint_every=HALF), d["ref_pp2"], ""),
            ("killed_resume", _cfg(exit_interval=KILL), killed["dir"], ""),
        ],
        timeout_s=900,
    ) | {"dirs": d}


@pytest.fixture(scope="module")
def two(tmp_path_factory, four):
    """tp 2 -> 1 (and sp off) from the reference's step HALF; pp 2 -> 1 from the pp=2 reference's step HALF;
    both on to step LATER (train.steps stays STEPS everywhere: it shapes the LR schedule; exit_interval stops
    early)."""
    base = tmp_path_factory.mktemp("two")
    d = {"tp1": str(base / "tp1"), "pp1": str(base / "pp1")}
    _copy_step(four["dirs"]["ref"], HALF, d["tp1"])
    _copy_step(four["dirs"]["ref_pp2"], HALF, d["pp1"])
    return _run(
        [
            ("tp1", _cfg(tp=1, dp=2, zero=1, exit_interval=LATER), d["tp1"], ""),
            ("pp1", _pp_cfg(1, exit_interval=LATER), d["pp1"], ""),
        ],
        timeout_s=400,
    ) | {"dirs": d}


@pytest.fixture(scope="module")
def again_four(tmp_path_factory, two):
    """From the 2-rank checkpoints of step LATER, on to STEPS: tp 1 -> 4 with zero 1 -> 0, dp 2 -> 4, pp 1 -> 2."""
    base = tmp_path_factory.mktemp("again")
    d = {name: str(base / name) for name in ("tp4", "dp4", "pp2")}
    _copy_step(two["dirs"]["tp1"], LATER, d["tp4"])
    _copy_step(two["dirs"]["tp1"], LATER, d["dp4"])
    _copy_step(two["dirs"]["pp1"], LATER, d["pp2"])
    return _run(
        [
            ("tp4", _cfg(tp=4, dp=1, zero=0), d["tp4"], ""),
            ("dp4", _cfg(tp=1, dp=4, zero=1), d["dp4"], ""),
            ("pp2", _pp_cfg(2), d["pp2"], ""),
        ],
        timeout_s=600,
    )


@pytest.fixture(scope="module")
def reference(four):
    out = four["ref"]
    assert out["code"] == 0 and len(out["losses"]) == STEPS
    assert out["steps"] == [STEPS, HALF] and out["latest"] == STEPS
    return four["dirs"]["ref"], out["losses"]


@pytest.mark.parametrize("how", ["exit_interval", "signal"])
def test_stop_midway_and_resume_is_bit_exact(reference, four, how):
    _, ref = reference
    first, second = four[f"{how}_first"], four[f"{how}_second"]
    assert first["code"] == 3, first
    assert first["losses"] == ref[:HALF]
    assert first["latest"] == HALF
    events = first["events"]
    assert any(e["event"] == "checkpoint" and e["step"] == HALF for e in events)
    if how == "signal":
        assert any(e["event"] == "signal" and e["name"] == "SIGUSR2" and e["step"] == HALF for e in events)
    assert second["code"] == 0
    assert second["losses"] == ref[HALF:], (second["losses"], ref[HALF:])  # exact, not approximately
    assert any(e["event"] == "resumed" and e["step"] == HALF for e in second["events"])


def _close(got, want, tol=1e-5) -> float:
    """Assert every loss within tol relative; return the largest relative difference (shown with -s)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= tol * abs(b), (got, want)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"max relative loss difference {worst:.2e}")
    return worst


def _resumed_with_new_layout(events: list[dict[str, Any]], step: int) -> bool:
    return any(e["event"] == "resumed" and e["step"] == step and e["layout_changed"] for e in events)


def test_resume_across_layouts(reference, two, again_four):
    _, ref = reference
    # tp 2 -> 1 (and sp off), from the tp=2 sp dp=2 zero=1 checkpoint of step HALF, on to step LATER.
    out = two["tp1"]
    assert out["code"] == 3
    _close(out["losses"], ref[HALF:LATER])
    # tp 1 -> 4 together with zero 1 -> 0, from that tp=1 checkpoint of step LATER.
    _close(again_four["tp4"]["losses"], ref[LATER:STEPS])
    # dp 2 -> 4 from the same tp=1 dp=2 checkpoint.
    _close(again_four["dp4"]["losses"], ref[LATER:STEPS])


def test_resume_across_pp_layouts(four, two, again_four):
    """A pp=2 checkpoint resumes at pp=1, and that pp=1 checkpoint resumes at pp=2 again.

    With tied embeddings the last stage holds a replica of `embedding.word.weight` (and its optimizer
    state) that must be filled from the first stage's copy when loading at pp=2, and must not collide
    with it when saving; layer names are global, so layer i is the same key whichever stage holds it.
    """
    ref = four["ref_pp2"]
    assert ref["code"] == 0 and len(ref["losses"]) == STEPS
    assert ref["steps"] == [STEPS, HALF]
    ref = ref["losses"]
    # pp 2 -> 1 from step HALF, on to step LATER.
    out = two["pp1"]
    assert out["code"] == 3 and _resumed_with_new_layout(out["events"], HALF)
    _close(out["losses"], ref[HALF:LATER])
    # pp 1 -> 2 from that pp=1 checkpoint of step LATER, on to step STEPS.
    out = again_four["pp2"]
    assert out["code"] == 0 and _resumed_with_new_layout(out["events"], LATER)
    _close(out["losses"], ref[LATER:STEPS])


def test_sigkill_during_save_keeps_previous_checkpoint(reference, killed, four):
    _, ref = reference
    assert killed["latest"] == KILL_EVERY and killed["steps"] == [KILL_EVERY]
    # The partial step KILL is either left as .tmp_step_10_* (never read) or already removed by rank 0's cleanup.
    out = four["killed_resume"]
    assert out["losses"] == ref[KILL_EVERY:KILL]
    assert out["steps"] == [KILL, KILL_EVERY]
    assert not out["tmp"]
