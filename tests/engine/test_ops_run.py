"""The operations checklist in real runs (issue 23, items 3, 11, 12), sharing launches:

- one 2-rank spawn (tp=2 sp, gloo) runs three cases in the same ranks: train.nvtx (every range name present and
  balanced, layers, forward and backward, the optimizer, collectives), the checkpoint replica (a damaged primary
  checkpoint restored from the replica, the resumed losses equal to an uninterrupted run's), and a whole-job
  slowdown (steps made slower on purpose: one `slowdown` event against the run's own baseline);
- one local launch through the CLI: a rank bound with numactl (cluster.numa=explicit) whose training raises a
  CUDA out-of-memory error: the `oom` event, the message naming the part and its levers, exit code 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers import ROOT
from helpers.dist import run_distributed

from training.contract.config import Config, config_from_dict, config_to_dict
from training.contract.rundir.events import read_events


def _cfg(steps: int, **train) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp, cfg.parallel.zero = 2, 1, True, 0
    cfg.parallel.micro_batch, cfg.parallel.global_batch = 2, 4
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 2, 1.0  # a fixed peak: no matmul timing
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress, cfg.train.dist_timeout_s = steps, 1, False, 60
    cfg.train.decay_steps = 10  # the same learning rates whatever train.steps is: runs of 4 and 6 steps compare
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg.data.kind = "synthetic"
    return cfg


def _cases(cfgs: dict, base: str):
    import torch.distributed as dist

    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    mesh = ProcessMesh.from_env(2, 1, 1, 1, timeout_s=60)
    out = {}

    def train(name, cfg_dict, run_dir, slow_after=None):
        cfg = config_from_dict(cfg_dict)
        t = Trainer(cfg, run_dir, mesh)
        if slow_after is not None:
            step_fn = t.train_step
            baseline: list = []

            def slow(*a, **k):
                t0 = time.perf_counter()
                res = step_fn(*a, **k)
                if 1 < t.state.step <= slow_after:
                    baseline.append(time.perf_counter() - t0)
                elif t.state.step > slow_after:
                    # Every rank: the step (and its collectives) take over 4x the slowest baseline step, so the
                    # slowdown stays below half the baseline rate however the machine's load moved those steps.
                    time.sleep(4 * max(baseline) + 0.05)
                return res

            t.train_step = slow
        t.run()
        if t.checkpointer is not None and t.checkpointer._replica is not None:
            t.checkpointer._replica.wait()  # the copy runs in the background; a rank's exit would join it
        dist.barrier()  # rank 0's damage below happens after every rank is done with the run
        return t

    # NVTX ranges (counted on CPU).
    run = os.path.join(base, "nvtx")
    train("nvtx", cfgs["nvtx"], run)
    with open(os.path.join(run, "profile", f"nvtx_rank{mesh.rank}.json")) as f:
        out["nvtx"] = json.load(f)
    # Replica: 4 steps saved at 2 and 4; the primary step_4 damaged; resume to 6 restores it from the replica.
    run = os.path.join(base, "replica")
    first = train("replica_a", cfgs["replica_a"], run)
    out["losses_a"] = first.losses
    if mesh.rank == 0:
        shard = sorted(f for f in os.listdir(os.path.join(run, "checkpoints", "step_4")) if f.endswith(".distcp"))[0]
        with open(os.path.join(run, "checkpoints", "step_4", shard), "r+b") as f:
            f.truncate(16)  # a bad disk: the manifest's size and CRC no longer match
    dist.barrier()
    second = train("replica_b", cfgs["replica_b"], run)
    out["losses_b"] = second.losses
    out["reference"] = train("reference", cfgs["reference"], os.path.join(base, "reference")).losses
    # Slowdown: step 1 skipped (start-up), baseline steps 2-3, then 4x slower steps 4, 5, 6.
    run = os.path.join(base, "slow")
    train("slow", cfgs["slow"], run, slow_after=3)
    return out


def test_nvtx_replica_and_slowdown_in_one_spawn(tmp_path):
    base = str(tmp_path)
    replica = str(tmp_path / "replica_copy")
    cfgs = {
        "nvtx": config_to_dict(_cfg(2, nvtx=True)),
        "replica_a": config_to_dict(_cfg(4, checkpoint_every=2, keep_last=2, checkpoint_replica_dir=replica)),
        "replica_b": config_to_dict(_cfg(6, checkpoint_every=2, keep_last=2, checkpoint_replica_dir=replica)),
        "reference": config_to_dict(_cfg(6)),
    }
    slow = _cfg(6)
    slow.cluster.health.baseline_intervals, slow.cluster.health.throttle_samples = 2, 2
    slow.cluster.health.min_throughput_fraction = 0.5
    cfgs["slow"] = config_to_dict(slow)
    r0, r1 = run_distributed(_cases, 2, (cfgs, base), timeout_s=300)
    # NVTX: every kind of range, balanced, on both ranks.
    for r in (r0, r1):
        counts = r["nvtx"]["counts"]
        assert r["nvtx"]["balanced"]
        for name in (
            "step 1",
            "step 2",
            "forward",
            "layer0.forward",
            "layer1.forward",
            "layer0.backward",
            "layer1.backward",
            "optimizer",
            "coll.all_reduce",
        ):
            assert counts.get(name, 0) >= 1, (name, counts)
        assert counts["optimizer"] == 2 and counts["layer0.backward"] == counts["layer0.forward"]
    # Replica: the damaged step_4 was restored from the replica and resumed (not step 2).
    events = read_events(str(tmp_path / "replica"))
    copies = [e["step"] for e in events if e["event"] == "checkpoint_replica"]
    assert copies[:2] == [2, 4]
    assert [e["step"] for e in events if e["event"] == "checkpoint_invalid"] == [4]
    assert [e["step"] for e in events if e["event"] == "checkpoint_restored"] == [4]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4]
    assert os.listdir(tmp_path / "replica" / "checkpoints" / "abandoned")  # the damaged copy is kept
    # Steps 5 and 6 after the restored checkpoint are exactly the uninterrupted run's.
    assert r0["losses_a"] == r0["reference"][:4] and r0["losses_b"] == r0["reference"][4:]
    assert sorted(os.listdir(replica)) == ["step_4", "step_6"]  # the replica keeps keep_last=2 too
    # Slowdown: one event against the run's own baseline.
    slow_events = [e for e in read_events(str(tmp_path / "slow")) if e["event"] == "slowdown"]
    assert [e["kind"] for e in slow_events] == ["baseline"], slow_events
    assert slow_events[0]["ratio"] < 0.5 and slow_events[0]["step"] == 5  # the second slow step in a row


@pytest.mark.slow
def test_local_rank_numa_bound_and_oom_explained(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    # The ranks (only they get cluster.env) replace the training loop with a CUDA out-of-memory error (not a
    # MESHRUN_ name: cluster.env may not set meshrun's own variables, launcher/plan/safety.py).
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('OPS_TEST_OOM'):\n"
        "    import torch\n"
        "    import training.run.loop as loop\n"
        "    def run(self):\n"
        "        raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')\n"
        "    loop.Trainer.run = run\n"
    )
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{ROOT}")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "model=tiny",
            "parallel=single",
            "cluster.gpus_per_node=1",
            "data=synthetic",
            "train.steps=2",
            "cluster.numa=explicit",
            "cluster.numa_map=[0]",
            "+cluster.env.OPS_TEST_OOM=1",
            "cluster.max_retries=0",
            f"run.dir={run}",
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "a local run ignores Slurm-only keys: cluster.max_retries" in p.stdout
    events = read_events(str(run))
    (started,) = [e for e in events if e["event"] == "started"]
    assert started["numa_nodes"] == [0]  # bound with numactl, as on Slurm
    (oom,) = [e for e in events if e["event"] == "oom"]
    assert oom["part"] == "activations" and oom["rank"] == 0 and "parallel.recompute=full" in " ".join(oom["levers"])
    assert "CUDA out of memory on rank 0" in p.stderr and "the activations overflowed" in p.stderr
    assert [e for e in events if e["event"] == "failed"][0]["exit_code"] == 1
    assert shutil.which("numactl")
