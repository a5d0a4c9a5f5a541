"""The operations checklist's GPU paths (issue 23), through the real CLI; run by bench/gpu_ops_check.sh.

On one GPU in about 3 minutes; --dry: every check on CPU (tiny sizes, NVML answered by the double of
training/preflight/nvml_double.py), so the script cannot rot between GPU runs (bench/gpu_check.sh --dry runs it,
tests/bench/test_gpu_check.py reads its summary):
 1. preflight_checklist: preflight with the real NVML and NCCL (--dry: the double, gloo): the checklist's checks
    are present (nccl.transport, nccl.ib_settings, version.nccl_min, version.cudnn, version.cuda_runtime,
    node.rdma_modules, node.read_ahead, node.cgroup_memory) and none fails. --dry: version.nccl_min needs an NCCL
    and version.cudnn a CUDA build of torch; on a torch without them (the preflight's version.nccl / version.cuda
    found nothing) they must be absent, and the summary names them under `not_on_cpu`.
 2. xid_event_set: the real NVML Xid event set registers on the GPUs (training/observe/xid.py), or NVML says it is
    unsupported. --dry: the double's event set, with one Xid (13) queued that the poll must deliver.
 3. nvtx_nsys and health_samples: tiny model, 6 steps, train.nvtx=true and (when nsys is installed) train.nsys=true
    with profile_steps [3,4] (--dry: 4 steps, [2,3]): the run completes, nsys writes
    run.dir/profile/nsys_rank0.nsys-rep, health.jsonl has utilisation samples. --dry: no nsys (it profiles CUDA
    work; a CPU run refuses train.nsys), the NVTX ranges counted on CPU in run.dir/profile/nvtx_rank0.json
    instead, utilisation sampled from the double.
 4. oom_explained: gpt2_125m with a micro-batch far beyond the GPU (cluster.gpu_memory_gb set high so the planner
    lets it through): a real CUDA out-of-memory error becomes the `oom` event (part activations) and exit 1.
    --dry: a CPU run has no device to fill, and torch's CPU allocator refuses with a RuntimeError, not
    torch.OutOfMemoryError; so the tiny model's rank asks the CPU allocator for 2^60 bytes at its first train_step
    and raises the refusal as torch.OutOfMemoryError (a sitecustomize hook, active in the rank only); from there the
    path is the GPU's (training/main.py, training/observe/oom.py): the event, the message, exit 1. The check's
    `simulated` field says so.
Each step is one command in its own session with a time limit; past it the step's whole process tree is killed,
the ranks too (the launcher starts each rank in a session of its own, so its process group alone is not enough:
kill_tree), and the step reports the kill in its log and check.
Prints one JSON object (the last line; also RUN_DIR/summary.json); exit 0 when every check passed.
Usage: python bench/gpu_ops_check.py [--dry] RUN_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from training.contract.rundir.paths import RunPaths  # noqa: E402

STEP_TIMEOUT_S = 300.0
"""Time limit of each meshrun step (GPU_OPS_STEP_TIMEOUT_S overrides it). GPU_OPS_BUDGET_S: seconds for all the
steps together (bench/gpu_first_run.sh gives its own limit less a margin): each step's limit is cut to what is left
(at least 5 s), so that the summary is still written and no step is cut short from outside, ranks left behind."""
KILL_WAIT_S = 10.0
"""How long kill_tree waits for the killed processes to be gone."""
CHECKLIST = [
    "nccl.transport",
    "nccl.ib_settings",
    "version.nccl_min",
    "version.cudnn",
    "version.cuda_runtime",
    "node.rdma_modules",
    "node.read_ahead",
    "node.cgroup_memory",
]
DRY_XID = (0, 13)
"""The Xid the --dry event set delivers: 13 (graphics engine exception) is reported only, not a hardware fault."""
DRY_OOM_BYTES = 1 << 60
"""What the --dry rank asks the CPU allocator for: refused at once (no page is touched)."""
DRY_OOM_HOOK = """\
import os
if os.environ.get("OPS_DRY_OOM"):
    import torch
    import training.run.loop as loop

    def train_step(self, *args, **kwargs):
        try:
            torch.empty({nbytes}, dtype=torch.uint8)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[-1]
            raise torch.OutOfMemoryError(f"dry run on CPU (bench/gpu_ops_check.py): {{first}}") from exc
        raise torch.OutOfMemoryError("dry run on CPU (bench/gpu_ops_check.py): the allocation went through")

    loop.Trainer.train_step = train_step
"""
DRY_OOM_NOTE = (
    "CPU: no device to fill, and torch's CPU allocator refuses with RuntimeError, not torch.OutOfMemoryError; the "
    f"rank's first train_step asked the CPU allocator for {DRY_OOM_BYTES} bytes and raised its refusal as "
    "torch.OutOfMemoryError (sitecustomize hook); from there the path is the GPU's (training/main.py, "
    "training/observe/oom.py)"
)


# --- one step with a time limit, and the kill of its whole process tree ---------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first, then ppid, pgrp, ...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it (parents before their children), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(name))
    tree = [pid]
    for p in tree:  # grows while walked: breadth first
        tree.extend(children.get(p, []))
    return tree


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped) or a pid that is gone is not."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def kill_tree(pid: int, wait_s: float = KILL_WAIT_S) -> dict[str, list[int]]:
    """SIGKILL `pid`, every process descended from it and each one's process group; then wait up to `wait_s` for
    them to be gone. The launcher starts each rank in a session of its own (launcher/launch/local.py), so killing
    the launcher's process group alone left the ranks running (on a GPU: holding it for the next step). Each
    process found is stopped (SIGSTOP) first, so that none forks or exits unseen between the walk and the kill;
    the walk repeats until it finds no new process. Returns {"killed": [...], "left": [...]} (left: still alive)."""
    groups: dict[int, int | None] = {}
    own = os.getpgrp()
    while True:
        new = [p for p in process_tree(pid) if p not in groups]
        if not new:
            break
        for p in new:
            try:
                groups[p] = os.getpgid(p)
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                groups[p] = None
    for p, g in groups.items():
        for kill, target in ((os.killpg, g), (os.kill, p)):
            if target is None or (kill is os.killpg and target == own):  # never this script's own group
                continue
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    end = time.time() + wait_s
    left = [p for p in groups if alive(p)]
    while left and time.time() < end:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return {"killed": sorted(groups), "left": left}


@dataclass
class Step:
    """What one step did: exit status (-9 when killed), output, seconds, and the kill if it ran out of time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    kill: dict[str, list[int]] = field(default_factory=dict)


def run_step(run_dir: str, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> Step:
    """Run `argv` in a session of its own, output to RUN_DIR/<name>.log. Past `timeout` its whole process tree is
    killed (kill_tree) and the step says so: a TimeoutExpired escaping here wrote no summary and left the rank."""
    t = time.time()
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env, cwd=ROOT
    )
    timed_out, kill = False, {}
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out, kill = True, kill_tree(p.pid)
        try:
            out, err = p.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # a process outside the tree holds the pipes: give up on the output
            p.kill()
            out, err = "", ""
        err = (err or "") + (
            f"\ngpu_ops_check: killed after {timeout:g} s (time limit of this step): processes {kill['killed']}"
            + (f"; still alive: {kill['left']}" if kill["left"] else "")
        )
    with open(os.path.join(run_dir, f"{name}.log"), "w") as f:
        f.write((out or "") + "\n--- stderr ---\n" + (err or ""))
    return Step(p.returncode, out or "", err or "", time.time() - t, timed_out, kill)


# --- the checks ------------------------------------------------------------------------------------------------


def _events(d: str) -> list[dict[str, Any]]:
    path = RunPaths(d).events
    return [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []


def _load(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _write_double(path: str, node_values: dict[str, Any]) -> str:
    with open(path, "w") as f:
        json.dump({"gpus": 1, "nodes": {"*": node_values}}, f)
    return os.path.abspath(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="every check on CPU (tiny sizes, the NVML double)")
    ap.add_argument("run_dir")
    a = ap.parse_args(argv)
    run_dir, dry = os.path.abspath(a.run_dir), a.dry
    os.makedirs(run_dir, exist_ok=True)
    py = os.environ.get("PYTHON") or sys.executable
    step_s = float(os.environ.get("GPU_OPS_STEP_TIMEOUT_S") or STEP_TIMEOUT_S)
    deadline = time.time() + float(os.environ.get("GPU_OPS_BUDGET_S") or 1e9)
    summary: dict[str, Any] = {"mode": "dry" if dry else "gpu", "checks": {}}

    def check(name: str, ok: Any, step: Step | None = None, **found: Any) -> None:
        if step is not None:
            found.update(exit_code=step.returncode, seconds=round(step.seconds, 1))
            if step.timed_out:
                found.update(timed_out=True, kill=step.kill)
        summary["checks"][name] = {"ok": bool(ok) and not (step and step.timed_out), **found}

    def meshrun(name: str, args: list[str], env: dict[str, str] | None = None) -> Step:
        limit = max(5.0, min(step_s, deadline - time.time() - 5))
        return run_step(run_dir, name, [py, "-m", "launcher", *args], round(limit, 1), env)

    if dry:
        double = _write_double(os.path.join(run_dir, "nvml_double.json"), {"temperature": 40})
        device = [
            "cluster=local",
            "cluster.device=cpu",
            "cluster.gpus_per_node=1",
            "cluster.nodes=1",
            "cluster.gpu_memory_gb=4",
            "parallel=single",
            "data=synthetic",
        ]
        nvml_args = [f"cluster.health.nvml_double={double}"]
    else:
        import torch  # sizes the GPU

        mem_gb = torch.cuda.get_device_properties(0).total_memory / 2**30  # GiB, as cluster.gpu_memory_gb
        device = [
            "cluster=local",
            "cluster.device=cuda",
            "cluster.gpus_per_node=1",
            "cluster.nodes=1",
            f"cluster.gpu_memory_gb={mem_gb:.1f}",
            "parallel=single",
            "data=synthetic",
        ]
        nvml_args = []

    # 1. preflight
    pf = os.path.join(run_dir, "preflight")
    extra = ["cluster.preflight.matmul_size=256"] if dry else []
    s = meshrun(
        "preflight", ["action=preflight", *device, "cluster.preflight.mode=warn", *nvml_args, *extra, f"run.dir={pf}"]
    )
    names = {c["name"]: c for c in _load(RunPaths(pf).preflight, {}).get("checks", [])}
    want, not_on_cpu = list(CHECKLIST), {}
    if dry:  # what this torch cannot have: then the preflight must not claim it either
        if names.get("version.nccl", {}).get("found") is None:
            not_on_cpu["version.nccl_min"] = "this torch has no NCCL (version.nccl found none)"
        if names.get("version.cuda", {}).get("found") is None:
            not_on_cpu["version.cudnn"] = "this torch is no CUDA build, so has no cuDNN (version.cuda found none)"
        want = [n for n in want if n not in not_on_cpu]
    failed = [n for n in want if names.get(n, {}).get("status") == "fail"]
    claimed = [n for n in not_on_cpu if n in names]
    check(
        "preflight_checklist",
        s.returncode == 0 and all(n in names for n in want) and not failed and not claimed,
        s,
        missing=[n for n in want if n not in names],
        failed=failed,
        found={n: names[n].get("found") for n in want if n in names},
        **({"not_on_cpu": not_on_cpu, "reported_anyway": claimed} if dry else {}),
    )

    # 2. Xid event set
    sys.path.insert(0, ROOT)
    from training.observe.xid import XidWatcher
    from training.preflight.gpu_nvml import load_nvml
    from training.preflight.runner import node_name

    if dry:
        from training.preflight.nvml_double import make_nvml_double

        xid_double = _write_double(os.path.join(run_dir, "xid_double.json"), {"xid": [list(DRY_XID)]})
        nvml, why = make_nvml_double(xid_double, node_name()), ""
    else:
        nvml, why = load_nvml()
    if nvml is None:
        check("xid_event_set", False, reason=why)
    else:
        w = XidWatcher(nvml, nvml.nvmlDeviceGetCount())
        polled = w.poll()
        ok = bool(w.gpus) or bool(w.unsupported)
        if dry:  # the double's queued Xid must come through the event set, once
            ok = w.gpus == [0] and polled == [DRY_XID] and w.poll() == []
        check(
            "xid_event_set",
            ok,
            registered=w.gpus,
            unsupported=w.unsupported,
            pending=polled,
            **({"nvml": "double (training/preflight/nvml_double.py)"} if dry else {}),
        )
        w.close()
        nvml.nvmlShutdown()

    # 3. NVTX + nsys + health sampling
    nsys = shutil.which("nsys") is not None and not dry
    tr = os.path.join(run_dir, "nvtx")
    steps = ["train.steps=4", "train.profile_steps=[2,3]"] if dry else ["train.steps=6", "train.profile_steps=[3,4]"]
    s = meshrun(
        "train_nvtx",
        [
            "model=tiny",
            *device,
            *steps,
            "train.nvtx=true",
            "train.checkpointing=false",
            f"train.nsys={'true' if nsys else 'false'}",
            "cluster.health.interval_s=0.5",
            *nvml_args,
            f"run.dir={tr}",
        ],
    )
    report = RunPaths(tr).nsys_report(0) + ".nsys-rep"
    if dry:  # a CPU build of torch has no NVTX: the ranges are counted (training/observe/nvtx.py)
        counted = _load(RunPaths(tr).nvtx_counts(0), {})
        check(
            "nvtx_nsys",
            s.returncode == 0 and bool(counted),
            s,
            nsys_installed=shutil.which("nsys") is not None,
            nsys="not on CPU (nsys profiles CUDA work)",
            nvtx_counted=counted,
        )
    else:
        check(
            "nvtx_nsys",
            s.returncode == 0 and (os.path.exists(report) or not nsys),
            s,
            nsys_installed=nsys,
            report=report if os.path.exists(report) else None,
        )
    health = RunPaths(tr).health
    util = [json.loads(x).get("utilization_pct") for x in open(health) if x.strip()] if os.path.exists(health) else []
    check(
        "health_samples",
        any(u is not None for u in util),
        samples=len(util),
        low_utilization=[e for e in _events(tr) if e["event"] == "low_utilization"][:1],
    )

    # 4. OOM explained
    oom = os.path.join(run_dir, "oom")
    if dry:
        hook = os.path.join(run_dir, "oom_hook")
        os.makedirs(hook, exist_ok=True)
        with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
            f.write(DRY_OOM_HOOK.format(nbytes=DRY_OOM_BYTES))
        path = os.pathsep.join(x for x in (hook, ROOT, os.environ.get("PYTHONPATH", "")) if x)
        # Only the rank sets OPS_DRY_OOM (cluster.env; not a MESHRUN_ name, launcher/plan/safety.py).
        s = meshrun(
            "oom",
            [
                "model=tiny",
                *device,
                "train.steps=1",
                "train.checkpointing=false",
                "+cluster.env.OPS_DRY_OOM=1",
                f"run.dir={oom}",
            ],
            env=dict(os.environ, PYTHONPATH=path),
        )
    else:
        s = meshrun(
            "oom",
            [
                "model=gpt2_125m",
                *device,
                "cluster.gpu_memory_gb=100000",
                "model.seq_length=1024",
                "parallel.micro_batch=512",
                "parallel.global_batch=512",
                "train.steps=1",
                "train.checkpointing=false",
                f"run.dir={oom}",
            ],
        )
    ev = [e for e in _events(oom) if e["event"] == "oom"]
    ok = s.returncode == 1 and ev and ev[0]["part"] == "activations" and "overflowed" in s.stderr
    if dry:
        ok = ok and "dry run on CPU" in (ev[0].get("error") or "")  # the hook's refusal, not another error
    check("oom_explained", ok, s, event=ev[0] if ev else None, **({"simulated": DRY_OOM_NOTE} if dry else {}))

    summary["ok"] = all(c["ok"] for c in summary["checks"].values())
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps(summary, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
