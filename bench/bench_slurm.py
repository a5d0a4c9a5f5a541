"""Slurm turnaround on the dev cluster (bash slurm/dev-cluster.sh up), phase by phase, against Slurm's own
times for a bare job measured in the same run.

    .venv/bin/python bench/bench_slurm.py [--reps 1]

meshrun: model=tiny, 2 nodes x --ranks-per-node CPU ranks (default 2: tp=2 in a node, dp=2 across; with 1: dp=2),
checkpoint every 4 steps.
- submit -> first step: `meshrun` invoked -> the first step of attempt 0 (its `startup` event), split at
  the command's return, `submitted`, `started` (the batch script's prologue), then the engine's start-up
  marks on rank 0 (training/observe/startup.py: srun started the task, the engine's process started,
  imports, process group, preflight, model/optimizer/data built, checkpoint lookup, first step).
- preemption signal -> resumed step: `scancel --signal=USR2` -> the first step of attempt 1, split at the
  `signal` event (seen at a step boundary), the checkpoint written, every rank's exit (its record in
  slurm/attempt_0/), `requeued` (the epilogue asked Slurm), `started` of attempt 1, then its start-up marks
  (`resumed` = checkpoint loaded).
bare: a batch script with one srun step on the same 2 nodes x 2 tasks, no Python, no torch:
- submit -> tasks running: `sbatch` invoked -> every task of the step wrote its start time.
- requeue: `scancel --signal=USR2` -> the step's tasks exit, the script runs `scontrol requeue` (as
  meshrun's epilogue does) -> every task of the restarted job wrote its start time.
Goals: meshrun's signal -> resumed step <= 1.6x the bare requeue; submit -> first step < 8 s.
--in-job (`in_job_main`): a node lost after the first checkpoint (every process of the run on it killed) -> the
resumed step, with an in-job restart onto a spare (cluster.spare_nodes=1) against the resubmission excluding the
node, alternated; the resubmission's queue wait (sacct) set aside. Goal: in-job <= 0.6x.
--preemption-cases: only signal -> resumed step against the bare requeue, at 1 node x 2 ranks and at 2 nodes x 1
rank (each case's meshrun and bare runs alternated, --reps of each), each case <= 1.6x; dp=2 in both cases unless
--tp 2 (see preemption_cases), the workload's step time printed beside the ratio.
Exit 1 when a goal is missed, 77 when the dev cluster does not answer. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from training.contract.rundir.events import read_events  # noqa: E402
from training.contract.rundir.paths import RunPaths  # noqa: E402
from training.contract.slurm_env import SlurmUnavailable, slurm_command  # noqa: E402

STEPS = 16
REQUEUE_VS_BARE = 1.6
"""Goal: preemption signal -> resumed step within 1.6x of Slurm's own requeue of a bare job."""
SUBMIT_TO_STEP_S = 8.0
"""Goal: `meshrun` invoked -> first step in under 8 s."""
NODES = 2
ENGINE_PHASES = [
    ("task_start", "srun started the task"),
    ("process_start", "engine process started"),
    ("imported", "torch + engine imported"),
    ("process_group", "process group up"),
    ("preflight", "preflight checks"),
    ("built", "model, optimizer, data built"),
    ("resumed", "checkpoint loaded (or none)"),
    ("observers", "metrics log, TensorBoard, watchers"),
    ("first_batch", "first batch assembled"),
    ("first_step", "first step"),
]


KEEP_RUNS = False
"""--keep: leave each repetition's runs (run directories, job outputs) in their temporary folder."""


@contextlib.contextmanager
def work_dir(prefix: str):
    """A temporary folder for one repetition's runs: removed afterwards (about 14 MB a repetition); kept, and its
    path printed, with --keep or when the repetition failed."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    except BaseException:
        print(f"bench_slurm: this repetition's runs are kept in {path}", file=sys.stderr)
        raise
    if KEEP_RUNS:
        print(f"bench_slurm: runs kept in {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)


def wait(pred: Callable, timeout: float = 300, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"bench_slurm: timed out after {timeout} s")


def events_of(run_dir: str, name: str, attempt: int | None = None) -> list[dict]:
    return [
        e for e in read_events(run_dir) if e.get("event") == name and (attempt is None or e.get("attempt") == attempt)
    ]


def rank_exits(run_dir: str, attempt: int) -> list[float]:
    out = []
    for path in glob.glob(os.path.join(RunPaths(run_dir).attempt(attempt), "rank_*.json")):
        with open(path) as f:
            out.append(json.load(f)["ended"])
    return out


def engine_marks(run_dir: str, attempt: int) -> list[tuple[str, float]]:
    startup = events_of(run_dir, "startup", attempt)
    if not startup:
        return []
    marks = startup[0]["marks"]
    return [(label, marks[key]) for key, label in ENGINE_PHASES if key in marks]


def print_phases(title: str, t0: float, points: list[tuple[str, float]]) -> dict[str, float]:
    """Each phase's duration (from the previous point) and the running total from t0."""
    print(f"\n{title}")
    print(f"  {'phase ends':34s} {'phase s':>8s} {'total s':>8s}")
    prev, phases = t0, {}
    for label, t in points:
        print(f"  {label:34s} {t - prev:8.2f} {t - t0:8.2f}")
        phases[label] = round(t - prev, 3)
        prev = t
    return phases


def startup_cpu(run_dir: str, attempt: int) -> float:
    return float(events_of(run_dir, "startup", attempt)[0].get("cpu_s") or 0.0)


def workload_step_s(run_dir: str) -> float:
    """The median step time of the run's steps (metrics.jsonl): up to one and a half of them lie inside signal ->
    resumed step (the step under way when the signal comes, and the resumed one), whatever the restart costs."""
    times = []
    with open(RunPaths(run_dir).metrics) as f:
        for line in f:
            row = json.loads(line)
            if "step_time_s" in row:
                times.append(row["step_time_s"])
    return statistics.median(times) if times else 0.0


def meshrun_run(work: str, per_node: int, nodes: int = NODES, tp: int | None = None) -> dict[str, object]:
    run_dir = os.path.join(work, "run")
    tp = min(2, per_node) if tp is None else tp
    t0 = time.time()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "cluster=slurm_dev",
            "model=tiny",
            "data=synthetic",
            f"parallel.tp={tp}",
            f"train.steps={STEPS}",
            "train.checkpoint_every=4",
            f"cluster.nodes={nodes}",
            f"cluster.gpus_per_node={per_node}",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    returned = time.time()
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"bench_slurm: meshrun exited {res.returncode}")
    job = re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)
    wait(lambda: engine_marks(run_dir, 0), timeout=600)
    submit_points = [
        ("meshrun command returned", returned),
        ("sbatch accepted (submitted)", events_of(run_dir, "submitted")[0]["time"]),
        ("batch script started (prologue)", events_of(run_dir, "started", 0)[0]["time"]),
    ]
    submit_points += engine_marks(run_dir, 0)
    submit_phases = print_phases(f"meshrun: submit -> first step (job {job})", t0, submit_points)
    submit_total = submit_points[-1][1] - t0

    wait(lambda: len(events_of(run_dir, "checkpoint")) >= 1)  # a step past the first checkpoint
    t1 = time.time()
    if slurm_command(["scancel", "--signal=USR2", job]).returncode != 0:
        raise SystemExit(f"bench_slurm: scancel --signal=USR2 {job} failed")
    wait(lambda: engine_marks(run_dir, 1), timeout=600)
    signal = events_of(run_dir, "signal", 0)[0]
    saved = [e for e in events_of(run_dir, "checkpoint", 0) if e.get("reason") == "SIGUSR2"]
    requeue_points = [(f"signal seen (step {signal['step']})", signal["time"])]
    if saved:
        requeue_points.append(("checkpoint written", saved[0]["time"]))
    requeue_points += [
        ("every rank exited", max(rank_exits(run_dir, 0))),
        ("epilogue requeued the job", events_of(run_dir, "requeued", 0)[0]["time"]),
        ("batch script started (prologue)", events_of(run_dir, "started", 1)[0]["time"]),
    ]
    requeue_points += engine_marks(run_dir, 1)
    requeue_phases = print_phases("meshrun: preemption signal -> resumed step", t1, requeue_points)
    requeue_total = requeue_points[-1][1] - t1
    wait(lambda: read_events(run_dir)[-1]["event"] in ("completed", "stopped"), timeout=600)
    cpu = (startup_cpu(run_dir, 0), startup_cpu(run_dir, 1))
    print(
        f"\nrank 0's CPU time from process start to its first step: {cpu[0]:.2f} s (attempt 0), {cpu[1]:.2f} s "
        f"(attempt 1); {nodes * per_node} ranks on {os.cpu_count()} cores need at least "
        f"{cpu[1] * nodes * per_node / os.cpu_count():.2f} s of wall time for that (the dev cluster's nodes share "
        f"this machine's cores)"
    )
    return {
        "submit_to_first_step_s": round(submit_total, 2),
        "signal_to_resumed_step_s": round(requeue_total, 2),
        "step_s": round(workload_step_s(run_dir), 3),
        "startup_cpu_s": cpu,
        "submit_phases": submit_phases,
        "requeue_phases": requeue_phases,
        "job_id": job,
        "final": read_events(run_dir)[-1]["event"],
    }


BARE_SCRIPT = """#!/bin/bash
#SBATCH --job-name=bare-requeue
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={tasks}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={work}/bare_%j.out
#SBATCH --time=10
# One step on every task: each writes its start time, then waits for USR2 (the preemption warning).
srun bash -c 'echo "$(date +%s.%N)" >> "{work}/starts_${{SLURM_RESTART_COUNT:-0}}_${{SLURM_PROCID}}"; trap "exit 0" USR2; while :; do sleep 0.05; done'
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
"""


def task_starts(work: str, attempt: int) -> list[float]:
    out = []
    for path in glob.glob(os.path.join(work, f"starts_{attempt}_*")):
        with open(path) as f:
            text = f.read().split()
        if text:
            out.append(float(text[0]))
    return out


def bare_run(work: str, per_node: int, nodes: int = NODES) -> dict[str, float]:
    script = os.path.join(work, "bare.sbatch")
    with open(script, "w") as f:
        f.write(BARE_SCRIPT.format(nodes=nodes, tasks=per_node, work=work))
    ranks = nodes * per_node
    t0 = time.time()
    res = slurm_command(["sbatch", "--parsable", script])
    if res.returncode != 0:
        raise SystemExit(f"bench_slurm: sbatch of the bare job failed: {res.stderr.strip()}")
    job = res.stdout.strip().split(";")[0]
    try:
        wait(lambda: len(task_starts(work, 0)) == ranks, timeout=300)
        submit = max(task_starts(work, 0)) - t0
        time.sleep(1.0)  # the tasks are in their loop
        t1 = time.time()
        slurm_command(["scancel", "--signal=USR2", job])
        wait(lambda: len(task_starts(work, 1)) == ranks, timeout=300)
        requeue = max(task_starts(work, 1)) - t1
    finally:
        slurm_command(["scancel", job])
    return {"submit_to_tasks_s": round(submit, 2), "requeue_s": round(requeue, 2), "job_id": job}


# ---- --in-job: a lost node -> resumed step, in-job restart onto a spare against the resubmission path ----
IN_JOB_VS_REQUEUE = 0.6
"""Goal: a lost node -> the resumed step with an in-job restart within 0.6x of the resubmission path's time,
queue wait aside (launcher/slurm/in_job.py)."""


def _node_pids(run_dir: str, node: str) -> list[int]:
    """Every process of this run on a fake node: the rank wrappers (submitit), their ranks and the node's warm
    agent (its forked ranks show the agent's command line)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (
            f"SLURMD_NODENAME={node}".encode() in env
            and f"MESHRUN_RUN_DIR={run_dir}".encode() in env
            and (b"submitit" in cmd or b"training.main" in cmd or b"training.run.warm_agent" in cmd)
        ):
            pids.append(int(pid))
    return pids


def _queue_wait(job: str, after: float) -> float:
    """Seconds job waited in Slurm's queue (sacct: Submit -> Start of its allocation that started after `after`)."""
    from launcher.records.goodput import sacct_records

    def rec():
        recs = [r for r in sacct_records([job]).get(job, []) if r[1] >= after - 1]
        return recs[0] if recs else None

    submit, start = wait(rec, timeout=60, poll=0.5)
    return max(0.0, start - submit)


def lost_node_run(work: str, per_node: int, in_job: bool) -> dict[str, object]:
    """One run on 2 nodes (in_job: plus 1 spare); after its first checkpoint every process of the run on its
    second node is killed; returns the seconds from the kill to the next attempt's first step, the queue wait
    of a new allocation set aside."""
    import signal as _signal

    run_dir = os.path.join(work, "in_job" if in_job else "requeue")
    extra = ["cluster.spare_nodes=1", "cluster.max_in_job_restarts=1"] if in_job else []
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "cluster=slurm_dev",
            "model=tiny",
            "data=synthetic",
            f"parallel.tp={min(2, per_node)}",
            f"train.steps={STEPS * 4}",
            "train.checkpoint_every=4",
            f"cluster.nodes={NODES}",
            f"cluster.gpus_per_node={per_node}",
            "train.progress=false",
            *extra,
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"bench_slurm: meshrun exited {res.returncode}")
    jobs = [re.search(r"submitted Slurm job (\d+)", res.stdout).group(1)]
    try:
        wait(lambda: events_of(run_dir, "checkpoint", 0), timeout=600)
        node = events_of(run_dir, "started", 0)[0]["nodes"][1]
        t1 = time.time()
        for pid in _node_pids(run_dir, node):
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait(lambda: engine_marks(run_dir, 1), timeout=600)
        started = events_of(run_dir, "started", 1)[0]
        requeued = events_of(run_dir, "requeued", 0)
        if requeued and requeued[0].get("new_job_id"):
            jobs.append(str(requeued[0]["new_job_id"]))
        restarted = events_of(run_dir, "restarted_in_job", 0)
        if in_job and not restarted:
            raise SystemExit(f"bench_slurm: no in-job restart: {read_events(run_dir)[-3:]}")
        queue = 0.0 if in_job else _queue_wait(str(started["job_id"]), t1)
        first_step = dict(engine_marks(run_dir, 1))["first step"]
        decided = (restarted or requeued)[0]["time"]
        points = [
            ("every rank exited, epilogue decided", decided),
            ("batch script started (prologue)", started["time"]),
        ]
        points += engine_marks(run_dir, 1)
        phases = print_phases(
            f"{'in-job restart' if in_job else 'resubmission'}: node {node} lost -> resumed step"
            + ("" if in_job else f" (queue wait {queue:.2f} s set aside)"),
            t1,
            points,
        )
        missed = events_of(run_dir, "warm_start_missed", 1)
        if in_job:
            # The ranks of the restart came from the nodes' warm agents unless one said otherwise.
            print(f"  ranks started cold in the restart: {len(missed)} {[e.get('reason') for e in missed]}")
        return {
            "lost_to_resumed_s": round(first_step - t1 - queue, 2),
            "queue_s": round(queue, 2),
            "cold_ranks": len(missed),
            "phases": phases,
            "jobs": jobs,
        }
    finally:
        slurm_command(["scancel", *jobs])
        wait(lambda: not slurm_command(["squeue", "-h", "-j", ",".join(jobs)]).stdout.strip(), timeout=120, poll=0.5)


def in_job_main(reps: int, per_node: int) -> int:
    """--in-job: the two recovery paths measured alternately, medians and their ratio."""
    inside, requeue = [], []
    for rep in range(reps):
        with work_dir("bench_slurm_in_job_") as work:
            for side in (True, False) if rep % 2 == 0 else (False, True):
                (inside if side else requeue).append(lost_node_run(work, per_node, side)["lost_to_resumed_s"])
    a, b = statistics.median(inside), statistics.median(requeue)
    ratio = a / b
    # Each pair ran back to back: its own ratio is less exposed to the machine's load bursts than the medians.
    pairs = [round(x / y, 3) for x, y in zip(inside, requeue)]
    print(
        f"\n{NODES} nodes x {per_node} ranks; medians of {reps}; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores"
    )
    print(
        f"node lost -> resumed step: in-job restart {a:.2f} s, resubmission {b:.2f} s (queue wait aside) = "
        f"{ratio:.2f}x (goal <= {IN_JOB_VS_REQUEUE})"
    )
    print(f"pair ratios {pairs}, their median {statistics.median(pairs):.2f}x")
    ok = ratio <= IN_JOB_VS_REQUEUE
    print(
        json.dumps(
            {
                "bench": "slurm_in_job",
                "in_job_s": inside,
                "requeue_s": requeue,
                "in_job_median_s": a,
                "requeue_median_s": b,
                "in_job_vs_requeue": round(ratio, 3),
                "pair_ratios": pairs,
                "load_average": round(os.getloadavg()[0], 1),
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


PREEMPTION_CASES = ((1, 2), (2, 1))
"""(nodes, ranks per node) of --preemption-cases: 1 node x 2 ranks and 2 nodes x 1 rank."""


def preemption_cases(reps: int, cases: tuple[tuple[int, int], ...] = PREEMPTION_CASES, tp: int = 1) -> int:
    """--preemption-cases: USR2 -> resumed step against the bare requeue, per case of `cases` (--cases), each
    case's meshrun and bare runs alternated (bare first every other rep); prints each case's ratio of the
    medians and exits 1 when one is above REQUEUE_VS_BARE.

    The layout is tp=`tp` (--tp), dp over the other ranks. Default tp=1: the figure holds up to one and a half
    of the workload's steps, and a tp=2 step of the tiny model takes 0.3-0.9 s on CPU gloo (each of its ~40
    small collectives a micro-batch costs milliseconds there: docs/PERFORMANCE.md), against 0.04-0.06 s at
    dp=2; the workload's median step time is printed beside each case."""
    figures: dict[str, object] = {"bench": "slurm_preemption"}
    ok = True
    for nodes, per_node in cases:
        runs, bares = [], []
        for rep in range(reps):
            with work_dir("bench_slurm_preempt_") as work:
                for side in ("bare", "meshrun") if rep % 2 == 0 else ("meshrun", "bare"):
                    if side == "bare":
                        bares.append(bare_run(work, per_node, nodes))
                        print(
                            f"\nbare job {nodes} node(s) x {per_node}: signal -> requeued tasks running "
                            f"{bares[-1]['requeue_s']:.2f} s"
                        )
                    else:
                        runs.append(meshrun_run(work, per_node, nodes, tp=tp))
        requeue = statistics.median(r["signal_to_resumed_step_s"] for r in runs)
        step_s = statistics.median(r["step_s"] for r in runs)
        bare = statistics.median(b["requeue_s"] for b in bares)
        ratio = requeue / bare
        hit = ratio <= REQUEUE_VS_BARE
        ok &= hit
        name = f"{nodes}x{per_node}"
        figures[name] = {
            "signal_to_resumed_step_s": [r["signal_to_resumed_step_s"] for r in runs],
            "bare_requeue_s": [b["requeue_s"] for b in bares],
            "ratio": round(ratio, 3),
            "tp": tp,
            "workload_step_s": step_s,
            "requeue_phases": runs[-1]["requeue_phases"],
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        print(
            f"\n{nodes} node(s) x {per_node} rank(s): signal -> resumed step {requeue:.2f} s = {ratio:.2f} x "
            f"the bare requeue ({bare:.2f} s; medians of {reps}; goal <= {REQUEUE_VS_BARE}): "
            f"{'yes' if hit else 'NO'} (tp={tp}, the workload's step {step_s:.3f} s; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
        )
    figures["ok"] = ok
    print(json.dumps(figures))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1, help="alternated meshrun / bare pairs (medians printed)")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="CPU ranks (and bare tasks) on each of the 2 nodes")
    ap.add_argument("--keep", action="store_true", help="keep each repetition's run directories (printed)")
    ap.add_argument("--in-job", action="store_true", help="a lost node: in-job restart against the resubmission")
    ap.add_argument(
        "--preemption-cases",
        action="store_true",
        help="only USR2 -> resumed step vs the bare requeue at 1 node x 2 ranks and 2 nodes x 1 rank",
    )
    ap.add_argument(
        "--cases",
        default=",".join(f"{n}x{r}" for n, r in PREEMPTION_CASES),
        help="with --preemption-cases: NODESxRANKS cases to run, comma-separated (default: both)",
    )
    ap.add_argument(
        "--tp", type=int, default=1, help="with --preemption-cases: the runs' tensor-parallel degree (dp: the rest)"
    )
    args = ap.parse_args()
    global KEEP_RUNS
    KEEP_RUNS = args.keep
    try:
        up = "UP" in slurm_command(["scontrol", "ping"]).stdout
    except SlurmUnavailable:
        up = False
    if not up:
        print("bench_slurm: SKIPPED: the dev Slurm cluster does not answer (bash slurm/dev-cluster.sh up)")
        return 77
    if args.in_job:
        return in_job_main(args.reps, args.ranks_per_node)
    if args.preemption_cases:
        cases = tuple(tuple(int(x) for x in case.split("x")) for case in args.cases.split(","))
        return preemption_cases(args.reps, cases, args.tp)  # type: ignore[arg-type]
    runs, bares = [], []
    for rep in range(args.reps):
        with work_dir("bench_slurm_") as work:
            # Alternated, bare first every other time: the machine's load drifts between runs.
            order = ("bare", "meshrun") if rep % 2 == 0 else ("meshrun", "bare")
            for side in order:
                if side == "bare":
                    bares.append(bare_run(work, args.ranks_per_node))
                    print(
                        f"\nbare job (no Python): submit -> tasks running {bares[-1]['submit_to_tasks_s']:.2f} s, "
                        f"signal -> requeued tasks running {bares[-1]['requeue_s']:.2f} s"
                    )
                else:
                    runs.append(meshrun_run(work, args.ranks_per_node))
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    submit, requeue = med(runs, "submit_to_first_step_s"), med(runs, "signal_to_resumed_step_s")
    bare_submit, bare_requeue = med(bares, "submit_to_tasks_s"), med(bares, "requeue_s")
    ratio = requeue / bare_requeue
    print(
        f"\n{NODES} nodes x {args.ranks_per_node} ranks; medians of {args.reps}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"submit -> first step      {submit:6.2f} s   (bare job: submit -> tasks running {bare_submit:.2f} s; "
        f"goal < {SUBMIT_TO_STEP_S:.0f} s)"
    )
    print(
        f"signal -> resumed step    {requeue:6.2f} s   = {ratio:.2f} x the bare job's requeue "
        f"({bare_requeue:.2f} s; goal <= {REQUEUE_VS_BARE})"
    )
    ok = ratio <= REQUEUE_VS_BARE and submit < SUBMIT_TO_STEP_S
    print(
        json.dumps(
            {
                "bench": "slurm",
                "submit_to_first_step_s": submit,
                "bare_submit_to_tasks_s": bare_submit,
                "signal_to_resumed_step_s": requeue,
                "bare_requeue_s": bare_requeue,
                "requeue_vs_bare": round(ratio, 3),
                "ranks": NODES * args.ranks_per_node,
                "startup_cpu_s": runs[-1]["startup_cpu_s"],
                "submit_phases": runs[-1]["submit_phases"],
                "requeue_phases": runs[-1]["requeue_phases"],
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
