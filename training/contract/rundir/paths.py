"""The map of a run directory: RunPaths(run_dir) names every file and folder meshrun, its ranks and the tools
it starts (TensorBoard, W&B, submitit) put in run.dir, one property each (a method where a rank, an attempt or a
node picks the file). Pure Python, no I/O: launcher and ranks import it.

Who writes each file is another module's business (training/contract/rundir/files.py writes meshrun's own;
checkpoints: training/checkpoint/storage.py); this module only says where it lies. RUN_FILES (files.py) is
derived from the top-level names here, so a new file added here is checked for planted links before a launch.
"""

from __future__ import annotations

import os

# The top-level names, for the modules that own a file's format (events.py, metrics.py, lock.py, ...).
CONFIG_FILE = "config.json"
CONFIG_YAML_FILE = "config.yaml"
PLAN_FILE = "plan.json"
SUMMARY_FILE = "summary.json"
EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
PURGED_FILE = "metrics.purged.jsonl"
"""Rows of steps a resume went back over (moved out of metrics.jsonl, never deleted)."""
SECRETS_FILE = "secrets.json"
REQUEST_FILE = "resume_request.json"
LOCK_FILE = ".meshrun.lock"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
"""Inside checkpoints/: names the newest complete checkpoint (training/checkpoint/storage.py)."""
SLURM_DIR = "slurm"
SUBMITIT_DIR = "submitit"
SUBMITIT_PREFLIGHT_DIR = "submitit_preflight"
CODE_DIR = "code"
CANCEL_FILE = "cancel.json"
SWEEP_FILE = "sweep.json"
GOODPUT_FILE = "goodput.json"
POINT_FILE = "point.json"
PREFLIGHT_FILE = "preflight.json"
PREFLIGHT_DIR = "preflight"
HEALTH_FILE = "health.jsonl"
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"
REPORT_DIR = "report"
RECOMMEND_FILE = "recommend.json"
CALIBRATE_DIR = "calibrate"
REHEARSAL_FILE = "rehearsal.json"
WANDB_FILE = "wandb.json"
WANDB_DIR = "wandb"
DATA_DIR = "data"


class RunPaths:
    """Where each file of the run directory `run_dir` lies (strings, as os.path.join makes them).

    A property per fixed name; a method where a rank, an attempt or a node is part of the name."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = str(run_dir)

    def __repr__(self) -> str:
        return f"RunPaths({self.run_dir!r})"

    def _join(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    # ---------------------------------------------------------------- what a launch writes
    @property
    def config(self) -> str:
        """config.json: the configuration every rank reads (training/contract/rundir/config_files.py)."""
        return self._join(CONFIG_FILE)

    @property
    def config_yaml(self) -> str:
        """config.yaml: the same configuration, for people."""
        return self._join(CONFIG_YAML_FILE)

    @property
    def plan(self) -> str:
        """plan.json: the layout, memory and time the planner expects."""
        return self._join(PLAN_FILE)

    @property
    def secrets(self) -> str:
        """secrets.json (0600): secret cluster.env values kept out of config.json."""
        return self._join(SECRETS_FILE)

    @property
    def resume_request(self) -> str:
        """resume_request.json: an explicit train.resume, for the first attempt of a launch only."""
        return self._join(REQUEST_FILE)

    @property
    def lock(self) -> str:
        """.meshrun.lock: the one owner of the run directory (training/contract/rundir/lock.py)."""
        return self._join(LOCK_FILE)

    @property
    def code(self) -> str:
        """code/: the snapshot of the source a Slurm job runs (launcher/slurm/snapshot.py)."""
        return self._join(CODE_DIR)

    @property
    def data(self) -> str:
        """data/: the byte corpus built from data.paths (training/data/sources.py)."""
        return self._join(DATA_DIR)

    # ---------------------------------------------------------------- what the run records
    @property
    def events(self) -> str:
        """events.jsonl: the job's append-only events (training/contract/rundir/events.py)."""
        return self._join(EVENTS_FILE)

    @property
    def metrics(self) -> str:
        """metrics.jsonl: one row per logged step, written by rank 0."""
        return self._join(METRICS_FILE)

    @property
    def metrics_purged(self) -> str:
        """metrics.purged.jsonl: rows of steps a resume went back over."""
        return self._join(PURGED_FILE)

    @property
    def summary(self) -> str:
        """summary.json: the run's totals, written when the trainer ends."""
        return self._join(SUMMARY_FILE)

    @property
    def health(self) -> str:
        """health.jsonl: GPU health samples (training/observe/health.py)."""
        return self._join(HEALTH_FILE)

    @property
    def checkpoints(self) -> str:
        """checkpoints/: step_<N> directories, `latest` and abandoned/ (training/checkpoint/storage.py)."""
        return self._join(CHECKPOINTS_DIR)

    @property
    def latest(self) -> str:
        """checkpoints/latest: the name of the newest complete checkpoint of the current line."""
        return self._join(CHECKPOINTS_DIR, LATEST_FILE)

    def checkpoint(self, step: int) -> str:
        """checkpoints/step_<step>/: one committed checkpoint (its files: training/checkpoint/storage.py)."""
        return self._join(CHECKPOINTS_DIR, f"step_{step}")

    @property
    def logs(self) -> str:
        """logs/: each rank's output on a local run, and the preflight ranks' and warm agent's."""
        return self._join(LOGS_DIR)

    def rank_log(self, rank: int) -> str:
        """logs/rank_<rank>.log: a local rank's output (each attempt under a header line)."""
        return self._join(LOGS_DIR, f"rank_{rank}.log")

    def preflight_log(self, rank: int) -> str:
        """logs/preflight_rank_<rank>.log: a local preflight rank's output."""
        return self._join(LOGS_DIR, f"preflight_rank_{rank}.log")

    @property
    def warm_agent_log(self) -> str:
        """logs/warm_agent.log: the local warm agent's output."""
        return self._join(LOGS_DIR, "warm_agent.log")

    # ---------------------------------------------------------------- Slurm
    @property
    def slurm(self) -> str:
        """slurm/: one folder per Slurm attempt."""
        return self._join(SLURM_DIR)

    def attempt(self, n: int) -> str:
        """slurm/attempt_<n>/: an attempt's prologue.json and each rank's rank_<r>.json."""
        return self._join(SLURM_DIR, f"attempt_{n}")

    def prologue(self, n: int) -> str:
        """slurm/attempt_<n>/prologue.json: what the attempt's prologue found."""
        return os.path.join(self.attempt(n), "prologue.json")

    def rank_record(self, n: int, rank: int) -> str:
        """slurm/attempt_<n>/rank_<rank>.json: how a rank of the attempt ended."""
        return os.path.join(self.attempt(n), f"rank_{rank}.json")

    def rank_cause(self, n: int, rank: int) -> str:
        """slurm/attempt_<n>/.cause_rank_<rank>.json: the error a rank reported before it exited."""
        return os.path.join(self.attempt(n), f".cause_rank_{rank}.json")

    def epilogue_pid(self, n: int) -> str:
        """slurm/attempt_<n>/epilogue.pid: the attempt's epilogue process, while it runs."""
        return os.path.join(self.attempt(n), "epilogue.pid")

    @property
    def submitit(self) -> str:
        """submitit/: submitit's folder for the training job (its logs: <job>_0_log.out)."""
        return self._join(SUBMITIT_DIR)

    @property
    def submitit_preflight(self) -> str:
        """submitit_preflight/: submitit's folder for a standalone preflight job."""
        return self._join(SUBMITIT_PREFLIGHT_DIR)

    # ---------------------------------------------------------------- actions on the run
    @property
    def cancel(self) -> str:
        """cancel.json: the mark `action=cancel` leaves for the job to find."""
        return self._join(CANCEL_FILE)

    @property
    def goodput(self) -> str:
        """goodput.json: where the run's wall time went (launcher/records/goodput.py)."""
        return self._join(GOODPUT_FILE)

    @property
    def report(self) -> str:
        """report/: report.html and its figures."""
        return self._join(REPORT_DIR)

    @property
    def report_html(self) -> str:
        return self._join(REPORT_DIR, "report.html")

    @property
    def recommend(self) -> str:
        """recommend.json: the layouts `action=recommend` found."""
        return self._join(RECOMMEND_FILE)

    @property
    def calibrate(self) -> str:
        """calibrate/: the short measured runs of `action=calibrate`."""
        return self._join(CALIBRATE_DIR)

    @property
    def rehearsal(self) -> str:
        """rehearsal.json: what `action=rehearse` measured."""
        return self._join(REHEARSAL_FILE)

    @property
    def sweep(self) -> str:
        """sweep.json: a sweep directory's list of points."""
        return self._join(SWEEP_FILE)

    @property
    def point(self) -> str:
        """point.json: a sweep point's record in its own run directory."""
        return self._join(POINT_FILE)

    # ---------------------------------------------------------------- preflight
    @property
    def preflight(self) -> str:
        """preflight.json: the preflight checks' merged report (training/preflight/report.py)."""
        return self._join(PREFLIGHT_FILE)

    @property
    def preflight_nodes(self) -> str:
        """preflight/: per-node partial reports, written before any collective can hang."""
        return self._join(PREFLIGHT_DIR)

    def preflight_node(self, node: str) -> str:
        """preflight/<node>.json: one node's partial report."""
        return self._join(PREFLIGHT_DIR, f"{node}.json")

    # ---------------------------------------------------------------- observers
    @property
    def tensorboard(self) -> str:
        """tensorboard/: the TensorBoard writer's event files."""
        return self._join(TENSORBOARD_DIR)

    @property
    def profile(self) -> str:
        """profile/: profiler traces, memory snapshots, NVTX ranges and nsys reports, one file per rank."""
        return self._join(PROFILE_DIR)

    def profile_trace(self, rank: int) -> str:
        """profile/trace_rank<rank>.json: torch.profiler's Chrome trace of train.profile_steps."""
        return self._join(PROFILE_DIR, f"trace_rank{rank}.json")

    def memory_snapshot(self, rank: int) -> str:
        """profile/memory_snapshot_rank<rank>.pickle: a CUDA memory snapshot (pytorch.org/memory_viz)."""
        return self._join(PROFILE_DIR, f"memory_snapshot_rank{rank}.pickle")

    def nvtx_counts(self, rank: int) -> str:
        """profile/nvtx_rank<rank>.json: on CPU, the NVTX ranges a rank would have opened, counted."""
        return self._join(PROFILE_DIR, f"nvtx_rank{rank}.json")

    def nsys_report(self, rank: int) -> str:
        """profile/nsys_rank<rank>: an nsys report's path without its suffix (nsys adds .nsys-rep)."""
        return self._join(PROFILE_DIR, f"nsys_rank{rank}")

    @property
    def wandb(self) -> str:
        """wandb.json: the W&B run id, so a resumed run continues the same W&B run."""
        return self._join(WANDB_FILE)

    @property
    def wandb_dir(self) -> str:
        """wandb/: W&B's own files (wandb.init(dir=run_dir))."""
        return self._join(WANDB_DIR)


def top_level_names() -> tuple[str, ...]:
    """Every name RunPaths gives directly under run_dir (files and folders), in the order they are defined."""
    probe = RunPaths("")
    names = []
    for attr, value in vars(RunPaths).items():
        if isinstance(value, property):
            path = getattr(probe, attr)
            if os.sep not in path and path not in names:
                names.append(path)
    return tuple(names)
