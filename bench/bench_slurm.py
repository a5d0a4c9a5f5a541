"""Slurm timings on the dev cluster (bash slurm/dev-cluster.sh up): model=tiny, 2 nodes x 2 CPU ranks.

- submit-to-first-step: `meshrun` invoked -> first line of metrics.jsonl (includes Hydra, planning,
  sbatch, scheduling, rank start-up, rendezvous and step 1).
- preemption-signal-to-resumed-step: `scancel --signal=USR2` -> first step logged by the requeued attempt
  (includes the save at the next step boundary, the requeue, cred_expire, start-up and the checkpoint load).
Prints one JSON object per figure; exits 77 when the dev cluster is not reachable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from training.events import read_events  # noqa: E402
from training.exit_codes import EXIT_FAILED  # noqa: E402
from training.slurm_env import SlurmUnavailable, slurm_command  # noqa: E402

STEPS = 16


def metrics_lines(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def wait(pred, timeout=300, poll=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"bench_slurm: timed out after {timeout} s")


def main() -> int:
    try:
        up = "UP" in slurm_command(["scontrol", "ping"]).stdout
    except SlurmUnavailable:
        up = False
    if not up:
        print("bench_slurm: SKIPPED: the dev Slurm cluster does not answer (bash slurm/dev-cluster.sh up)")
        return 77
    run_dir = os.path.join(tempfile.mkdtemp(prefix="bench_slurm_"), "run")
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "launcher", "cluster=slurm_dev", "model=tiny", "data=synthetic",
                          "parallel.tp=2", f"train.steps={STEPS}", "train.checkpoint_every=4",
                          f"run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return EXIT_FAILED
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    returned = time.time() - t0
    wait(lambda: metrics_lines(run_dir))
    first_step = time.time() - t0
    print(json.dumps({"figure": "submit_to_first_step_s", "value": round(first_step, 2),
                      "command_returned_s": round(returned, 2), "job_id": job}))
    wait(lambda: len(metrics_lines(run_dir)) >= 4)
    t1 = time.time()
    if slurm_command(["scancel", "--signal=USR2", job]).returncode != 0:
        raise SystemExit(f"bench_slurm: scancel --signal=USR2 {job} failed")
    started = lambda: [e for e in read_events(run_dir) if e["event"] == "started"]  # noqa: E731
    wait(lambda: len(started()) >= 2)
    n_before = len(metrics_lines(run_dir))
    wait(lambda: len(metrics_lines(run_dir)) > n_before)
    resumed = time.time() - t1
    signal_step = next((e["step"] for e in read_events(run_dir) if e["event"] == "signal"), None)
    print(json.dumps({"figure": "preemption_signal_to_resumed_step_s", "value": round(resumed, 2),
                      "signal_step": signal_step, "requeue_restarted_s": round(started()[1]["time"] - t1, 2)}))
    wait(lambda: read_events(run_dir)[-1]["event"] in ("completed", "stopped"))
    print(json.dumps({"figure": "run_dir", "value": run_dir, "final": read_events(run_dir)[-1]["event"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
