"""Per-rank preflight: node checks, then matmul and collectives over all ranks, then the verdict.

Entry points:
- `python -m training.preflight RUN_DIR` (meshrun action=preflight, locally or as a Slurm job);
- `before_training(cfg, run_dir)`, called by the training main when cluster.preflight.mode is warn or gate.

Ranks on a node the preflight finds bad exit with EXIT_NODE_BAD (4), the others with 0; under
gate no rank trains in that attempt. preflight.json and the `preflight` event name the bad nodes.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from training.contract.config import Config, load_config
from training.contract.exit_codes import EXIT_INVALID, EXIT_NODE_BAD, EXIT_OK
from training.contract.rundir.events import append_event
from training.contract.rundir.paths import RunPaths
from training.contract.slurm_env import PREFLIGHT_PASSED_ENV, hostnames
from training.preflight import collectives, gpu_nvml, ib_sysfs, matmul, os_tunables
from training.preflight.report import FAIL, Check, Report, checks_from_dicts, fail, format_table, ok


def node_name() -> str:
    """The node as Slurm names it (fake nodes n1, n2 share one host on the dev cluster)."""
    return os.environ.get("MESHRUN_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def node_checks(cfg: Config, node: str, before_ib: dict | None = None) -> tuple[list[Check], dict[str, Any]]:
    """GPU (NVML), OS and IB checks of this node; run by one rank per node."""
    pf, cl = cfg.cluster.preflight, cfg.cluster
    checks: list[Check] = []
    if cl.health.nvml_double:  # machines without GPUs (tests, bench/gpu_preflight.sh --dry)
        from training.preflight.nvml_double import make_nvml_double

        nvml, why = make_nvml_double(cl.health.nvml_double, node), ""
    else:
        nvml, why = gpu_nvml.load_nvml()
    facts: dict[str, Any] = {"gpus": [], "driver": None}
    if nvml is None:
        if cl.device == "cuda":
            checks.append(fail("gpu.nvml", why + " but cluster.device=cuda", node=node))
        else:
            checks.append(ok("gpu.nvml", f"no GPU expected (cluster.device={cl.device}); {why}", node=node))
    else:
        try:
            gchecks, facts = gpu_nvml.check_gpus(nvml, pf, cl.gpus_per_node, node, own_pids=_job_pids())
            checks += gchecks
        finally:
            nvml.nvmlShutdown()
    checks += os_tunables.check_os(
        pf, node, gpu_bus_ids=[g["bus_id"] for g in facts["gpus"]], numa=cl.numa, numa_map=cl.numa_map
    )
    root = pf.ib_sysfs_root_by_node.get(node, pf.ib_sysfs_root)
    checks += ib_sysfs.check_ib(
        root, ib_sysfs.expected_hcas(pf.ib_hcas, cl.env), pf.ib_rate_gbps, node, before=before_ib
    )
    # The operations checklist: NCCL transport and IB settings, RDMA modules, IRQ affinity, read-ahead, cgroup memory.
    from training.preflight import nccl_checks, node_ops

    checks += nccl_checks.transport_checks(os.environ, root, node)
    checks += node_ops.check_node_ops(
        cfg, node, root, dict(os.environ), int(os.environ.get("LOCAL_WORLD_SIZE", cl.gpus_per_node))
    )
    return checks, facts


def _job_pids(proc: str = "/proc", environ=os.environ) -> set:
    """This process, its parent, its siblings on the node (the launcher or srun's step daemon started the job's
    other ranks: each holds GPU memory by now) and, under Slurm, every process of this job (SLURM_JOB_ID in its
    environment): cold-started ranks each have a parent of their own (their launcher/slurm/rank_task.py wrapper),
    so they are not siblings. None of these count as 'other processes' on a GPU. Processes whose environment
    this user cannot read (another user's) are never the job's. A process of this job must also be of this
    attempt (the same MESHRUN_ATTEMPT and SLURM_RESTART_COUNT, each set or unset alike): a rank left over from an
    earlier attempt of a requeued job still holds GPU memory, and is foreign to this one."""
    me, parent = os.getpid(), os.getppid()
    pids = {me, parent}
    job = environ.get("SLURM_JOB_ID", "")
    marker = f"SLURM_JOB_ID={job}".encode() if job else b""
    attempt = {key: environ.get(key) for key in ATTEMPT_KEYS}
    try:
        names = os.listdir(proc)
    except OSError:
        return pids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1].isdigit() and int(fields[1]) == parent:
            pids.add(int(name))
        elif marker:
            entries = _environ_entries(os.path.join(proc, name, "environ"))
            if marker in entries and _attempt_of(entries) == attempt:
                pids.add(int(name))
    return pids


ATTEMPT_KEYS = ("MESHRUN_ATTEMPT", "SLURM_RESTART_COUNT")
"""What numbers a job's attempt in a rank's environment: the Slurm driver's export (launcher/slurm/driver.py,
counted across resubmissions) and Slurm's own requeue count (unset before the first requeue)."""


def _attempt_of(entries: list[bytes]) -> dict:
    """The ATTEMPT_KEYS values in a /proc/<pid>/environ's entries (None when unset)."""
    found: dict = {key: None for key in ATTEMPT_KEYS}
    for entry in entries:
        key, sep, value = entry.partition(b"=")
        name = key.decode(errors="replace")
        if sep and name in found:
            found[name] = value.decode(errors="replace")
    return found


def _environ_entries(path: str) -> list[bytes]:
    """The NUL-separated entries of a /proc/<pid>/environ, or none when unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def passed_earlier(environ=os.environ) -> list[str]:
    """Nodes of this step that passed the preflight earlier in this allocation (an in-job restart)."""
    return [n for n in environ.get(PREFLIGHT_PASSED_ENV, "").split(",") if n]


def step_nodes(environ=os.environ) -> list[str]:
    """This srun step's nodes (every rank reads the same list)."""
    try:
        return hostnames(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "")
    except Exception:  # noqa: BLE001 - no list: nothing is skipped
        return []


def _node_phase(cfg: Config, run_dir: str, node: str, reused: bool) -> tuple[list[Check], dict[str, Any]]:
    """The node leader's checks before any collective: its own checks (or the note that it passed earlier in this
    allocation) and the facts the version checks need."""
    if reused:
        note = ok("preflight.reused", "passed the preflight earlier in this allocation (in-job restart)", node=node)
        return [note], {"driver": None}
    own, facts = node_checks(cfg, node)
    # Written before any collective: if a rendezvous hangs on a bad node, its verdict survives.
    os.makedirs(RunPaths(run_dir).preflight_nodes, exist_ok=True)
    with open(RunPaths(run_dir).preflight_node(node), "w") as f:
        json.dump([c.to_dict() for c in own], f, indent=1, default=str)
    return own, facts


def _open_group(cfg: Config, rank: int, world: int, device: str) -> bool:
    """The preflight's own process group when none exists yet; True when this call created it."""
    import torch

    from training.parallel import collectives as comm
    from training.parallel.rendezvous import wait_for_store

    if comm.is_initialized():
        return False
    pf, on_gpu = cfg.cluster.preflight, cfg.cluster.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    wait_for_store(pf.timeout_s)
    comm.init_process_group(
        "nccl" if on_gpu else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pf.timeout_s)
    )
    return True


def _measure_matmul(pf, rank: int, world: int, device: str, on_gpu: bool, reused: bool) -> dict[str, float] | None:
    """This rank's matmul rate (None on a reused node)."""
    from training.parallel import collectives as comm

    n = pf.matmul_size or (8192 if on_gpu else 384)
    if on_gpu:
        return None if reused else matmul.measure_tflops(device, n)
    # CPU ranks share the cores: measure one rank at a time so each gets the whole machine.
    mm = None
    for r in range(world):
        if r == rank and not reused:
            mm = matmul.measure_tflops(device, n)
        comm.barrier()
    return mm


def _job_checks(cfg: Config, everyone: list[dict[str, Any]]) -> list[Check]:
    """The job's checks from every rank's record (sorted by rank): the node checks, then matmul, bandwidth and
    versions across ranks."""
    pf, on_gpu = cfg.cluster.preflight, cfg.cluster.device == "cuda"
    node_of_rank = [r["node"] for r in everyone]
    checks: list[Check] = []
    for r in everyone:
        checks += checks_from_dicts(r["checks"])
    measured = [r["matmul"] for r in everyone if r["matmul"]]
    checks += (
        []
        if not measured
        else matmul.check_matmul(measured, pf.matmul_tflops, pf.min_rate_fraction, pf.straggler_ratio, on_gpu)
    )
    checks += collectives.check_bandwidth(
        [s for r in everyone for s in r["sweep"]],
        node_of_rank,
        pf.busbw_intra_gbps,
        pf.busbw_inter_gbps,
        pf.min_rate_fraction,
    )
    checks += collectives.check_versions(everyone, pf.nccl_version)
    from training.preflight.nccl_checks import version_checks

    checks += version_checks(everyone)  # NCCL >= 2.18, cuDNN agreement, CUDA runtime <= driver
    return checks


def run(cfg: Config, run_dir: str) -> Report:
    """The whole preflight on this rank; every rank returns the same job Report."""
    from training.parallel import collectives as comm

    t0 = time.time()
    pf, cl = cfg.cluster.preflight, cfg.cluster
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", cl.gpus_per_node))
    node = node_name()
    leader = local_rank == 0
    ib_root = pf.ib_sysfs_root_by_node.get(node, pf.ib_sysfs_root)
    # An in-job restart: a node that passed earlier in this allocation is not checked again (node checks,
    # matmul); the collectives still run over every rank, so the new node's links are measured.
    reused = node in passed_earlier()
    before_ib = ib_sysfs.snapshot(ib_root) if leader and not reused else None

    own: list[Check] = []
    facts: dict[str, Any] = {"driver": None}
    if leader:
        own, facts = _node_phase(cfg, run_dir, node, reused)

    on_gpu = cl.device == "cuda"
    from training.parallel.mesh import local_cuda_index

    device = f"cuda:{local_cuda_index(local_rank)}" if on_gpu else "cpu"
    created = _open_group(cfg, rank, world, device)
    try:
        mm = _measure_matmul(pf, rank, world, device, on_gpu, reused)
        sizes_mb = collectives.sweep_sizes_mb(pf.collective_sizes_mb, on_gpu)
        sweep = collectives.run_sweep(
            rank, world, per_node, sizes_mb, pf.collective_iters, device, timeout_s=pf.timeout_s
        )
        if leader and not reused:  # counters read again after the traffic: rising ones fail
            own = [c for c in own if not c.name.startswith("ib.")]
            own += ib_sysfs.check_ib(
                ib_root, ib_sysfs.expected_hcas(pf.ib_hcas, cl.env), pf.ib_rate_gbps, node, before=before_ib
            )
        mine = {
            "rank": rank,
            "node": node,
            "checks": [c.to_dict() for c in own],
            "matmul": {**mm, "rank": rank, "node": node} if mm else None,
            "sweep": sweep,
            "versions": collectives.local_versions(facts.get("driver")),
        }
        from training.preflight.nccl_checks import extra_versions

        mine["versions"].update(extra_versions(facts))  # cuDNN, the driver's CUDA (nccl_checks.version_checks)
        everyone: list[dict[str, Any]] = [None] * world
        comm.all_gather_object(everyone, mine)
        if created:
            comm.barrier()
    finally:
        if created:
            comm.destroy_process_group()

    everyone.sort(key=lambda r: r["rank"])
    nodes = list(dict.fromkeys(r["node"] for r in everyone))
    return Report(
        _job_checks(cfg, everyone),
        nodes,
        {
            "mode": pf.mode,
            "world_size": world,
            "device": cl.device,
            "reused_nodes": [n for n in nodes if n in passed_earlier()],
            "elapsed_s": round(time.time() - t0, 2),
            "versions": everyone[0]["versions"],
        },
    )


def finish(report: Report, run_dir: str, rank: int) -> int:
    """Rank 0 writes preflight.json, prints the table and records the event.

    Returns this rank's exit status: 4 when *its* node is bad, else 0. Only ranks on bad nodes
    report 4, so the requeue (launcher/slurm/requeue.py) excludes exactly those nodes.
    """
    if rank == 0:
        report.write(run_dir)
        print(format_table(report.to_dict()), flush=True)
        append_event(
            run_dir,
            "preflight",
            status=report.status,
            bad_nodes=report.bad_nodes,
            nodes=report.node_status(),
            mode=report.meta.get("mode"),
            elapsed_s=report.meta.get("elapsed_s"),
        )
    return EXIT_NODE_BAD if node_name() in report.bad_nodes else EXIT_OK


def before_training(cfg: Config, run_dir: str) -> None:
    """Training main's hook, after the process group exists (or it creates and destroys its own).

    off: nothing. warn: report only. gate: when any node is bad, no rank trains: ranks on a bad
    node exit 4 ("this node is bad"), the others exit 0 without training (the job's verdict comes
    from the bad ranks' 4 and preflight.json's bad_nodes).
    """
    mode = cfg.cluster.preflight.mode
    if mode == "off":
        return
    step = step_nodes()
    if step and set(step) <= set(passed_earlier()):
        return  # an in-job restart on nodes that all passed earlier in this allocation: nothing new to check
    rank = int(os.environ.get("RANK", 0))
    report = run(cfg, run_dir)
    status = finish(report, run_dir, rank)
    if mode == "gate" and report.bad_nodes:
        if rank == 0:
            print(
                f"preflight gate: bad node(s) {', '.join(report.bad_nodes)}; not training in this attempt",
                file=sys.stderr,
                flush=True,
            )
        if status == EXIT_NODE_BAD:
            # The launcher records a failing rank's last error line: make it say why the node is bad.
            node = node_name()
            why = "; ".join(
                f"{c.name} {c.subject} {c.reason}".replace("  ", " ")
                for c in report.checks
                if c.node == node and c.status == FAIL
            )
            print(f"error: preflight found node {node} bad: {why}", file=sys.stderr, flush=True)
        from training.parallel import collectives as comm

        if comm.is_initialized():
            # A bad rank's exit makes srun kill the whole step: wait until rank 0 has written
            # preflight.json and the `preflight` event.
            comm.barrier()
        raise SystemExit(status)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m training.preflight RUN_DIR (RUN_DIR holds config.json)", file=sys.stderr)
        return EXIT_INVALID
    run_dir = argv[0]
    cfg = load_config(RunPaths(run_dir).config)
    from training.contract.slurm_env import apply_slurm_env

    apply_slurm_env()  # srun starts this module directly: RANK & co., MASTER_ADDR/PORT from SLURM_*
    return finish(run(cfg, run_dir), run_dir, int(os.environ.get("RANK", 0)))
