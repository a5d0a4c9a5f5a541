"""End-to-end checkpoint acceptance with the real engine (gloo, fp32, tiny model).

- bit-exact resume at tp=2 sp dp=2 zero=1: stopped after step 10 by exit_interval and by a real SIGUSR2
  that reaches one rank only, resumed to 20: exactly the losses of the uninterrupted run;
- resume across layouts (tp 2->1, 1->4, dp 2->4, zero 1->0) within 1e-5 relative;
- resume across pipeline layouts (pp 2->1 and back 1->2, 4-layer model, tp=1 dp=2 zero=1) within 1e-5 relative;
- SIGKILL of a rank in the middle of a save: the previous checkpoint stays the chosen one.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from dist_harness import run_distributed
from training.checkpoint import storage
from training.config import Config, config_from_dict, config_to_dict
from training.events import read_events

STEPS = 20


def _cfg(tp=2, dp=2, sp=True, zero=1, steps=STEPS, pp=1, layers=2, **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = layers, 32, 4, 16
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp, cfg.parallel.zero = tp, dp, sp and tp > 1, zero
    cfg.parallel.pp = pp
    cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 8
    cfg.cluster.gpus_per_node = tp * pp * dp
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = steps, 3, False
    cfg.train.dist_timeout_s = 30
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg.data.kind, cfg.data.max_bytes = "text", 60_000
    return cfg


def _train(cfg_dict: dict, run_dir: str, hook: str = ""):
    import torch.distributed.checkpoint as dcp

    from training.checkpoint import manager
    from training.loop import Trainer
    from training.mesh import ProcessMesh

    cfg = config_from_dict(cfg_dict)
    p = cfg.parallel
    mesh = ProcessMesh.from_env(p.tp, p.pp, p.cp, p.dp, timeout_s=cfg.train.dist_timeout_s)
    trainer = Trainer(cfg, run_dir, mesh)
    if hook == "signal10" and mesh.rank == 1:
        step_fn = trainer.train_step

        def train_step(*args, **kwargs):
            out = step_fn(*args, **kwargs)
            if trainer.state.step == 10:
                os.kill(os.getpid(), signal.SIGUSR2)  # only this rank gets it: the ranks must agree anyway
            return out

        trainer.train_step = train_step
    if hook == "kill_in_save10" and mesh.rank == 1:
        real_save = dcp.save

        class _Dcp:
            def __getattr__(self, name):
                return getattr(dcp, name)

            @staticmethod
            def save(state, storage_writer):
                if trainer.state.step == 10:
                    with open(os.path.join(storage_writer.path, "__1_0.distcp"), "wb") as f:
                        f.write(b"partial")
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_save(state, storage_writer=storage_writer)

        real_dcp = manager._dcp  # the manager imports DCP on first use, through this function
        manager._dcp = lambda: (_Dcp(), real_dcp()[1])
    code = trainer.run()
    out = {"code": code, "losses": trainer.losses}
    mesh.destroy()
    return out


def _run(cfg: Config, run_dir: str, hook: str = "", timeout_s: float = 240):
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    return run_distributed(_train, world, args=(config_to_dict(cfg), run_dir, hook), timeout_s=timeout_s)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 20-step run (also leaves step_10 and step_20 checkpoints for the layout tests)."""
    run_dir = str(tmp_path_factory.mktemp("ref"))
    out = _run(_cfg(checkpoint_every=10), run_dir)
    assert out["code"] == 0 and len(out["losses"]) == STEPS
    assert storage.list_steps(run_dir) == [20, 10] and storage.read_latest(run_dir) == 20
    return run_dir, out["losses"]


def _copy_step(src_run: str, step: int, dst_run: str) -> None:
    os.makedirs(storage.checkpoints_dir(dst_run), exist_ok=True)
    shutil.copytree(storage.step_dir(src_run, step), storage.step_dir(dst_run, step))


@pytest.mark.parametrize("how", ["exit_interval", "signal"])
def test_stop_at_10_and_resume_is_bit_exact(reference, how, tmp_path):
    _, ref = reference
    run_dir = str(tmp_path)
    if how == "exit_interval":
        first = _run(_cfg(exit_interval=10), run_dir)
    else:
        first = _run(_cfg(), run_dir, hook="signal10")
    assert first["code"] == 3, first
    assert first["losses"] == ref[:10]
    assert storage.read_latest(run_dir) == 10
    events = read_events(run_dir)
    assert any(e["event"] == "checkpoint" and e["step"] == 10 for e in events)
    if how == "signal":
        assert any(e["event"] == "signal" and e["name"] == "SIGUSR2" and e["step"] == 10 for e in events)
    second = _run(_cfg(), run_dir)
    assert second["code"] == 0
    assert second["losses"] == ref[10:], (second["losses"], ref[10:])  # exact, not approximately
    assert any(e["event"] == "resumed" and e["step"] == 10 for e in read_events(run_dir))


def _close(got, want, tol=1e-5) -> float:
    """Assert every loss within tol relative; return the largest relative difference (shown with -s)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= tol * abs(b), (got, want)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"max relative loss difference {worst:.2e}")
    return worst


def _resumed_with_new_layout(run_dir: str, step: int) -> bool:
    return any(e["event"] == "resumed" and e["step"] == step and e["layout_changed"] for e in read_events(run_dir))


def test_resume_across_layouts(reference, tmp_path):
    ref_dir, ref = reference
    # tp 2 -> 1 (and sp off), from the tp=2 sp dp=2 zero=1 checkpoint of step 10, on to step 15.
    a = str(tmp_path / "tp1")
    _copy_step(ref_dir, 10, a)
    # train.steps stays 20 everywhere (it shapes the LR schedule); exit_interval stops the attempt early.
    out = _run(_cfg(tp=1, dp=2, zero=1, exit_interval=15), a)
    assert out["code"] == 3
    _close(out["losses"], ref[10:15])
    # tp 1 -> 4 together with zero 1 -> 0, from that tp=1 checkpoint of step 15.
    b = str(tmp_path / "tp4")
    _copy_step(a, 15, b)
    out = _run(_cfg(tp=4, dp=1, zero=0), b)
    _close(out["losses"], ref[15:20])
    # dp 2 -> 4 from the same tp=1 dp=2 checkpoint.
    c = str(tmp_path / "dp4")
    _copy_step(a, 15, c)
    out = _run(_cfg(tp=1, dp=4, zero=1), c)
    _close(out["losses"], ref[15:20])


def _pp_cfg(pp: int, **train) -> Config:
    """The pipeline cases: 4 layers (divisible by pp=2), tp=1 dp=2 zero=1; with pp=2 there are
    global_batch / (micro_batch x dp) = 2 micro-batches per step, enough for 1f1b (>= pp)."""
    return _cfg(tp=1, dp=2, zero=1, pp=pp, layers=4, **train)


def test_resume_across_pp_layouts(tmp_path):
    """A pp=2 checkpoint resumes at pp=1, and that pp=1 checkpoint resumes at pp=2 again.

    With tied embeddings the last stage holds a replica of `embedding.word.weight` (and its optimizer
    state) that must be filled from the first stage's copy when loading at pp=2, and must not collide
    with it when saving; layer names are global, so layer i is the same key whichever stage holds it.
    """
    ref_dir = str(tmp_path / "ref_pp2")
    ref = _run(_pp_cfg(2, checkpoint_every=10), ref_dir, timeout_s=420)
    assert ref["code"] == 0 and len(ref["losses"]) == STEPS
    assert storage.list_steps(ref_dir) == [20, 10]
    ref = ref["losses"]
    # pp 2 -> 1 from step 10, on to step 15.
    a = str(tmp_path / "pp1")
    _copy_step(ref_dir, 10, a)
    out = _run(_pp_cfg(1, exit_interval=15), a)
    assert out["code"] == 3 and _resumed_with_new_layout(a, 10)
    _close(out["losses"], ref[10:15])
    # pp 1 -> 2 from that pp=1 checkpoint of step 15, on to step 20.
    b = str(tmp_path / "pp2")
    _copy_step(a, 15, b)
    out = _run(_pp_cfg(2), b, timeout_s=420)
    assert out["code"] == 0 and _resumed_with_new_layout(b, 15)
    _close(out["losses"], ref[15:20])


def test_sigkill_during_save_keeps_previous_checkpoint(reference, tmp_path):
    _, ref = reference
    run_dir = str(tmp_path)
    with pytest.raises(RuntimeError, match="died|Connection closed|failed"):  # whichever rank reports first
        _run(_cfg(checkpoint_every=5, dist_timeout_s=10), run_dir, hook="kill_in_save10", timeout_s=120)
    assert storage.read_latest(run_dir) == 5 and storage.list_steps(run_dir) == [5]
    # The partial step 10 is either left as .tmp_step_10_* (never read) or already removed by rank 0's cleanup.
    out = _run(_cfg(exit_interval=10), run_dir)
    assert out["losses"] == ref[5:10]
    assert storage.list_steps(run_dir) == [10, 5]
    assert not [n for n in os.listdir(storage.checkpoints_dir(run_dir)) if n.startswith(".tmp")]
