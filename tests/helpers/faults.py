"""Faults at known points of known attempts, for the dev-cluster fault tests (tests/slurm/test_kills_slurm.py,
tests/slurm/test_soak_slurm.py): a sitecustomize that every rank process runs reads FAULTS_PLAN (JSON: attempt ->
{"kind", "rank"}) and, in that attempt (MESHRUN_ATTEMPT, exported by the Slurm prologue), does on that rank:

- kill_step: SIGKILL itself before the attempt's second step (one step logged in the attempt);
- kill_save: SIGKILL itself as the attempt's first checkpoint save after a step begins (a save in progress);
- kill_resume: SIGKILL itself as the attempt loads its checkpoint (a requeued or resubmitted attempt's resume);
- kill_first_step: SIGKILL itself in the attempt's first step (e.g. the first step after an in-job restart);
- raise_step: a Python exception before the attempt's second step (no node to blame: an in-job restart);
- any other kind (the test acts from outside: preempt, batch_kill, drain): every rank waits before the attempt's
  second step, marks FAULTS_DIR/held_<attempt>_<rank>, until a stop signal or FAULTS_DIR/release_<attempt>.

Every kill is a real signal death of a rank (exit -9), warm-started ranks included (the sitecustomize runs in a
forked rank too, docs/USER_CONTRACTS.md "Warm rank starts")."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable

from helpers import ROOT

INJECT = """import json, os, signal, sys, time
if "training.main" in getattr(sys, "orig_argv", []):
    _attempt = os.environ.get("MESHRUN_ATTEMPT", "0")
    _plan = json.loads(os.environ.get("FAULTS_PLAN", "{}")).get(_attempt)
    if _plan:
        import training.run.loop as _loop
        from training.checkpoint import manager as _manager
        from training.run import signals as _signals

        _kind, _me = _plan["kind"], os.environ.get("RANK") == str(_plan["rank"])
        _dir = os.environ["FAULTS_DIR"]
        _first = []

        def _die(where):
            with open(os.path.join(_dir, f"killed_{_attempt}_{os.environ.get('RANK')}"), "w") as f:
                f.write(where)
            os.kill(os.getpid(), signal.SIGKILL)

        _real_step = _loop.Trainer.train_step

        def _step(self, *args, **kwargs):
            if not _first:
                _first.append(self.state.step)
                if _kind == "kill_first_step" and _me:
                    _die(f"first step {self.state.step + 1}")
            elif self.state.step == _first[0] + 1 and not _first[1:]:
                _first.append(True)
                if _kind == "kill_step" and _me:
                    _die(f"before step {self.state.step + 1}")
                if _kind == "raise_step" and _me:
                    raise RuntimeError(f"injected error before step {self.state.step + 1}")
                if _kind not in ("kill_save", "kill_resume", "kill_first_step", "kill_step", "raise_step"):
                    open(os.path.join(_dir, f"held_{_attempt}_{os.environ.get('RANK')}"), "w").close()
                    deadline = time.monotonic() + 900
                    while (_signals.received() is None and not os.path.exists(os.path.join(_dir, f"release_{_attempt}"))
                           and time.monotonic() < deadline):
                        time.sleep(0.02)
            return _real_step(self, *args, **kwargs)

        _loop.Trainer.train_step = _step
        _real_save = _manager.CheckpointManager.save

        def _save(self, step, *args, **kwargs):
            if _kind == "kill_save" and _me and _first:
                _die(f"saving step {step}")
            return _real_save(self, step, *args, **kwargs)

        _manager.CheckpointManager.save = _save
        _real_resume = _manager.CheckpointManager.maybe_resume

        def _resume(self, *args, **kwargs):
            if _kind == "kill_resume" and _me:
                _die("resuming")
            return _real_resume(self, *args, **kwargs)

        _manager.CheckpointManager.maybe_resume = _resume
"""

SELF_KINDS = ("kill_step", "kill_save", "kill_resume", "kill_first_step", "raise_step")


def faults_env(tmp_path, plan: dict[int, dict]) -> dict[str, str]:
    """The submitter's environment that injects `plan` (attempt -> {"kind", "rank"}) into every rank."""
    inject = tmp_path / "inject_faults"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(INJECT)
    marks = tmp_path / "faults"
    marks.mkdir(exist_ok=True)
    return {
        "PYTHONPATH": f"{inject}{os.pathsep}{ROOT}",
        "FAULTS_PLAN": json.dumps({str(a): p for a, p in plan.items()}),
        "FAULTS_DIR": str(marks),
    }


def wait_held(env, attempt: int, ranks: Iterable[int], timeout: float = 240) -> None:
    deadline = time.time() + timeout
    marks = [os.path.join(env["FAULTS_DIR"], f"held_{attempt}_{r}") for r in ranks]
    while not all(os.path.exists(m) for m in marks):
        assert time.time() < deadline, f"attempt {attempt}: ranks not held within {timeout} s"
        time.sleep(0.2)


def release(env, attempt: int) -> None:
    open(os.path.join(env["FAULTS_DIR"], f"release_{attempt}"), "w").close()


_REFERENCE: dict[tuple, tuple] = {}


def start_reference(tmp_path_factory, *overrides) -> None:
    """The same run on local CPU ranks (4: as the Slurm runs' 2 nodes x 2), started in the background once per
    test session and configuration (reference() waits for it)."""
    if overrides in _REFERENCE:
        return
    _REFERENCE[overrides] = _launch_reference(tmp_path_factory.mktemp("reference") / "run", overrides)


def _launch_reference(run_dir, overrides) -> tuple:
    out = open(run_dir.parent / "launcher.out", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "cluster=local",
            "cluster.gpus_per_node=4",
            *overrides,
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()  # the child holds its own copy
    return run_dir, proc


@atexit.register
def _stop_references() -> None:
    """A reference no test waited for (its tests deselected or failed early) does not outlive the session."""
    for _, proc in _REFERENCE.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def reference(*overrides) -> dict[int, float]:
    """step -> loss of the reference run started by start_reference with the same overrides."""
    from helpers.slurm import metrics

    run_dir, proc = _REFERENCE[overrides]
    if proc.wait(timeout=600) != 0 and "EADDRINUSE" in (run_dir.parent / "launcher.out").read_text():
        # The launcher's free port was taken by another test's process before rank 0 bound it (the other
        # tests launch ranks beside this one): the same run again, in a fresh directory, once.
        retry = run_dir.parent.parent / (run_dir.parent.name + "-retry")
        retry.mkdir()
        run_dir, proc = _REFERENCE[overrides] = _launch_reference(retry / "run", overrides)
    assert proc.wait(timeout=600) == 0, (run_dir.parent / "launcher.out").read_text()[-3000:]
    return metrics(run_dir)
