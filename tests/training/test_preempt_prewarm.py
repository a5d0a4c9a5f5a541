"""Issue 28: what the engine does off the critical paths.

- The checkpoint save path (DCP and the DTensor code behind it) is imported in the background once the first
  step is done, so a save at a preemption signal does not pay for the import; nothing imports it before, the
  warm agent's imports (what a requeued job's first fork waits for) included; those imports run with the
  cyclic garbage collector off and freeze what they made (training/run/import_gc.py).
"""

from __future__ import annotations


def _first_steps() -> dict:
    """Three steps of a tiny model in a fresh rank (forked from training/run/local_ranks.py's forkserver, which has
    imported torch and the engine but not the save path): what was imported when."""
    import sys
    import tempfile

    from training.contract.config import Config
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    cfg.parallel.micro_batch = cfg.parallel.global_batch = 2
    cfg.data.kind, cfg.train.progress = "synthetic", False
    cfg.cluster.peak_tflops = 1.0  # a fixed peak: no matmul timing
    cfg.train.steps, cfg.train.checkpoint_every = 3, 100
    seen = {"before_build": "torch.distributed.checkpoint" in sys.modules}
    trainer = Trainer(cfg, tempfile.mkdtemp(), ProcessMesh.single("cpu"))
    seen["before_run"] = "torch.distributed.checkpoint" in sys.modules
    step_fn = trainer.train_step

    def train_step(*a, **k):
        out = step_fn(*a, **k)
        if trainer.state.step == 2:  # the loop's boundary after step 1 ran; no save yet (checkpoint_every 100)
            t = trainer.checkpointer._prewarm_thread
            seen["thread"] = t.name if t is not None else None
            t.join(120)
            seen["imported_before_any_save"] = (
                "torch.distributed.checkpoint" in sys.modules and not trainer.checkpointer.history
            )
        return out

    trainer.train_step = train_step
    seen["exit"] = trainer.run()
    seen["saved"] = [s.reason for s in trainer.checkpointer.history]
    return seen


def test_save_path_is_imported_in_the_background_after_the_first_step():
    from helpers.dist import run_distributed

    (seen,) = run_distributed(_first_steps, 1, timeout_s=300, fresh=True)
    assert seen["before_build"] is False, "the rank started with DCP imported: the check below would prove nothing"
    assert seen["before_run"] is False, "building the trainer must not import DCP (start-up pays for it)"
    assert seen["thread"] == "meshrun-checkpoint-import", seen
    assert seen["imported_before_any_save"] is True, seen
    assert seen["exit"] == 0 and seen["saved"] == ["final"], seen


def test_warm_agent_imports_leave_the_save_path_out_and_freeze_what_they_made():
    """The warm agent's imports (training/run/warm_agent.py warm_up), in a fresh interpreter: every module a rank
    needs before its first step, and not DCP or DTensor (about a third of that import's CPU); made with the
    collector off (training/run/import_gc.py), which is on again afterwards, the imported objects frozen."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    script = (
        "import gc, sys\n"
        "from training.run.warm_agent import warm_up\n"
        "assert gc.isenabled() and gc.get_freeze_count() == 0\n"
        "print(repr(warm_up()), gc.isenabled(), gc.get_freeze_count() > 100000)\n"
        "print(sorted(m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', 'training.run.loop',"
        " 'training.checkpoint.lean_read') if m in sys.modules))\n"
    )
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # as the agent's main() sets it: numpy's pool is one thread
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == ["'' True True", "['training.checkpoint.lean_read', 'training.run.loop']"], (
        res.stdout
    )


def test_imports_without_gc_restores_the_collector_after_an_error():
    import subprocess
    import sys

    from helpers import ROOT

    script = (
        "import gc\n"
        "from training.run.import_gc import imports_without_gc\n"
        "try:\n"
        "    with imports_without_gc():\n"
        "        inside = gc.isenabled()\n"
        "        import no_such_module_here\n"
        "except ImportError:\n"
        "    pass\n"
        "print(inside, gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "gc.disable()\n"
        "with imports_without_gc():\n"
        "    pass\n"
        "print(gc.isenabled())\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "True", "True", "False"], res.stdout
