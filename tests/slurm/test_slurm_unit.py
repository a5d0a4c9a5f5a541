"""Slurm launcher pieces that need no cluster: golden sbatch text, quoting, NUMA helpers,
Slurm env mapping, requeue decisions, status."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from helpers.cli import run_cli
from helpers.slurm import dev_cfg

from launcher.manage.status import run_status
from launcher.ranks import numa
from launcher.slurm.requeue import decide, plan_exclusion
from launcher.slurm.sbatch import (
    PROJECT_ROOT,
    SlurmConfigError,
    array_group_key,
    array_job_spec,
    cpus_per_task,
    dry_run_text,
    job_spec,
    preflight_job_spec,
    prologue_line,
    sbatch_text,
    setup_lines,
    srun_line,
    validate_for_slurm,
    with_cpus_per_task,
)
from training.contract import slurm_env
from training.contract.config import ClusterConfig, Config, ContainerConfig
from training.contract.rundir.events import append_event

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "slurm_dry_run.txt")


def dry_run(cfg: Config, run_dir: str) -> str:
    return dry_run_text(cfg, job_spec(cfg, run_dir), run_dir)


def normalise(text: str, run_dir: str) -> str:
    return (
        text.replace(shlex.quote(sys.executable), "<PYTHON>")
        .replace(sys.executable, "<PYTHON>")
        .replace(run_dir, "<RUN_DIR>")
        .replace(PROJECT_ROOT, "<ROOT>")
    )


def test_dry_run_matches_golden(tmp_path):
    run_dir = str(tmp_path / "run")
    text = normalise(dry_run(dev_cfg(), run_dir), run_dir)
    if os.environ.get("MESHRUN_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read()
    # The contract, not only the bytes: requeue, USR2 (never USR1), kill-on-bad-exit, NCCL env.
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=USR2@45" in text and "USR1" not in text
    assert "--kill-on-bad-exit=1" in text and "export NCCL_IB_HCA=mlx5_0" in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text  # tp=2


def test_cuda_max_connections_only_with_tp(tmp_path):
    cfg = dev_cfg()
    cfg.parallel.tp = 1
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in dry_run(cfg, str(tmp_path))


def test_gpus_requested_only_on_cuda(tmp_path):
    assert "gpus_per_node" not in job_spec(dev_cfg(), str(tmp_path)).parameters
    assert job_spec(dev_cfg(device="cuda"), str(tmp_path)).parameters["gpus_per_node"] == 2


def test_env_values_with_metacharacters_arrive_verbatim(tmp_path):
    nasty = f"$(touch {tmp_path}/pwned); `id` 'q' \"d\" \\ ; & | > <"
    cfg = dev_cfg(env={"MESHRUN_NASTY": nasty})
    lines = [ln for ln in setup_lines(cfg, [str(tmp_path / "r un")]) if ln.startswith("export ")]
    script = "\n".join(lines) + '\nprintf %s "$MESHRUN_NASTY" > "$0.out"; printf %s "$MESHRUN_RUN_DIR" > "$0.dir"'
    path = tmp_path / "s.sh"
    path.write_text(script)
    subprocess.run(["bash", str(path)], check=True)
    assert (tmp_path / "s.sh.out").read_text() == nasty
    assert (tmp_path / "s.sh.dir").read_text() == str(tmp_path / "r un")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "shell, cluster_env, expected",
    [
        ({}, {}, "1"),
        ({"OPENBLAS_NUM_THREADS": "6"}, {}, "6"),
        ({"OPENBLAS_NUM_THREADS": "6"}, {"OPENBLAS_NUM_THREADS": "3"}, "3"),
    ],
)
def test_openblas_threads_default_to_one_in_the_job(tmp_path, shell, cluster_env, expected):
    """The job's processes (each task's submitit wrapper imports numpy) get one OpenBLAS thread unless the
    submitting shell (sbatch passes its environment on) or cluster.env says otherwise; and numpy, imported under
    the script's exports, really starts that many."""
    lines = [ln for ln in setup_lines(dev_cfg(env=cluster_env), [str(tmp_path / "r")]) if ln.startswith("export ")]
    probe = "import numpy, os; print(len(os.listdir('/proc/self/task')))"  # OpenBLAS's pool: one per core at most
    path = tmp_path / "s.sh"
    path.write_text(
        "\n".join(lines)
        + f'\nprintf %s "$OPENBLAS_NUM_THREADS" > "$0.env"\n{shlex.quote(sys.executable)} -c {shlex.quote(probe)} > "$0.pool"'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    subprocess.run(["bash", str(path)], check=True, env={**env, **shell})
    assert (tmp_path / "s.sh.env").read_text() == expected
    assert int((tmp_path / "s.sh.pool").read_text()) == min(int(expected), len(os.sched_getaffinity(0)))


def test_array_task_selects_its_own_run_dir(tmp_path):
    """A sweep's job array: one batch script, task i exports run_dirs[i] (quoted, spaces and $ intact)."""
    dirs = [str(tmp_path / name) for name in ("p 0", "p$(id)1", "p'2")]
    cfg = dev_cfg()
    spec = array_job_spec(cfg, dirs, str(tmp_path / "submitit"))
    lines = [ln for ln in spec.parameters["setup"] if ln != prologue_line()]
    path = tmp_path / "s.sh"
    path.write_text("\n".join(lines) + '\nprintf %s "$MESHRUN_RUN_DIR" > "$0.$SLURM_ARRAY_TASK_ID"')
    for task in range(3):
        subprocess.run(["bash", str(path)], check=True, env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task)})
        assert (tmp_path / f"s.sh.{task}").read_text() == dirs[task]
    assert spec.folder == str(tmp_path / "submitit")
    # Apart from the run dir lines and the name (the sweep's, not its first point's), the array's script is the
    # plain job's.
    single = job_spec(cfg, dirs[0]).parameters
    assert single["job_name"] == "meshrun-p-0"
    assert spec.parameters["job_name"] == f"meshrun-{tmp_path.name}"
    assert {k: v for k, v in spec.parameters.items() if k not in ("setup", "job_name")} == {
        k: v for k, v in single.items() if k not in ("setup", "job_name")
    }
    assert spec.parameters["setup"][2:] == single["setup"][1:]
    assert "#SBATCH --requeue" in sbatch_text(spec)


def test_array_groups_only_identical_jobs():
    a, b = dev_cfg(), dev_cfg()
    b.parallel.micro_batch = 4  # the engine's business: same job
    assert array_group_key(a) == array_group_key(b)
    for change in (dict(nodes=1), dict(time_min=5), dict(exclude="n2"), dict(env={"NCCL_DEBUG": "INFO"})):
        assert array_group_key(dev_cfg(**change)) != array_group_key(a), change
    c = dev_cfg()
    c.parallel.tp = 1  # no CUDA_DEVICE_MAX_CONNECTIONS: another environment
    assert array_group_key(c) != array_group_key(a)


def test_array_task_job_id_is_submitits():
    env = {"SLURM_JOB_ID": "107", "SLURM_ARRAY_JOB_ID": "105", "SLURM_ARRAY_TASK_ID": "2"}
    assert slurm_env.slurm_job_id(env) == "105_2"
    assert slurm_env.slurm_job_id({"SLURM_JOB_ID": "107"}) == "107"
    assert slurm_env.slurm_job_id({}) is None


@pytest.mark.parametrize(
    "field,value",
    [("partition", "debug;touch /tmp/x"), ("account", "a b"), ("qos", "$(id)"), ("exclude", "n1\n#SBATCH --x")],
)
def test_metacharacters_in_sbatch_fields_are_rejected(field, value, tmp_path):
    cfg = dev_cfg(**{field: value})
    errors = validate_for_slurm(cfg)
    assert len(errors) == 1 and f"cluster.{field}" in errors[0]
    with pytest.raises(SlurmConfigError):
        job_spec(cfg, str(tmp_path))


def test_sbatch_extra_checked(tmp_path):
    errors = validate_for_slurm(dev_cfg(sbatch_extra={"constraint": "a;b", "--mem": "1G", "signal": "USR1@9"}))
    assert len(errors) == 3
    spec = job_spec(dev_cfg(sbatch_extra={"constraint": "h100"}), str(tmp_path))
    assert spec.parameters["additional_parameters"] == {"requeue": True, "constraint": "h100"}


# ------------------------------------------------------------------ resources a real cluster needs
def test_cpus_per_task_defaults_to_the_nodes_cpus_per_rank(tmp_path):
    assert "#SBATCH --cpus-per-task=4" in sbatch_text(job_spec(dev_cfg(), str(tmp_path)))  # 8 CPUs / 2 ranks
    assert cpus_per_task(ClusterConfig(gpus_per_node=8), node_cpus=224) == 28
    assert cpus_per_task(ClusterConfig(gpus_per_node=8, cpus_per_task=6), node_cpus=224) == 6  # explicit wins
    assert cpus_per_task(ClusterConfig(gpus_per_node=8), node_cpus=4) == 1  # more ranks than CPUs
    explicit = with_cpus_per_task(dev_cfg(cpus_per_task=3), node_cpus=8)
    assert "#SBATCH --cpus-per-task=3" in sbatch_text(job_spec(explicit, str(tmp_path)))
    # Unknown node CPUs is an error naming the fix, never Slurm's silent 1 CPU per task.
    unresolved = dev_cfg()
    unresolved.cluster.cpus_per_task = 0
    with pytest.raises(SlurmConfigError, match="set cluster.cpus_per_task"):
        job_spec(unresolved, str(tmp_path))
    with pytest.raises(SlurmConfigError, match="set cluster.cpus_per_task"):
        with_cpus_per_task(unresolved, node_cpus=0)


def test_exclusive_is_a_bare_flag_and_mem_a_size(tmp_path):
    plain = sbatch_text(job_spec(dev_cfg(), str(tmp_path)))
    assert "--exclusive" not in plain and "--mem" not in plain
    lines = sbatch_text(job_spec(dev_cfg(exclusive=True, mem="64G"), str(tmp_path))).splitlines()
    assert "#SBATCH --exclusive" in lines and not any(ln.startswith("#SBATCH --exclusive=") for ln in lines)
    assert "#SBATCH --mem=64G" in lines
    assert "#SBATCH --mem=0" in sbatch_text(job_spec(dev_cfg(mem="0"), str(tmp_path))).splitlines()


IMAGE = "nvcr.io#nvidia/pytorch:24.05-py3"


def test_container_is_rendered_as_quoted_srun_options(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = dev_cfg(container=ContainerConfig(image=IMAGE, mounts=["/data:/data:ro", "/scratch/r un:/scratch/r un"]))
    assert validate_for_slurm(cfg) == [
        "cluster.container.mounts entry '/scratch/r un:/scratch/r un': use "
        "SRC:DST[:FLAGS] with absolute paths and no commas, colons or spaces "
        "inside them (e.g. /data:/data:ro)"
    ]
    cfg = dev_cfg(container=ContainerConfig(image=IMAGE, mounts=["/data:/data:ro", f"{tmp_path}:{tmp_path}"]))
    assert validate_for_slurm(cfg) == []
    line = srun_line(sbatch_text(job_spec(cfg, run_dir)))
    assert f"'--container-image={IMAGE}'" in line  # `#` quoted: never a comment, whatever the shell
    # The shell hands srun exactly these words: the image with its `#`, the mounts joined by commas.
    words = shlex.split(line)
    assert f"--container-image={IMAGE}" in words
    assert f"--container-mounts=/data:/data:ro,{tmp_path}:{tmp_path}" in words
    assert words.index("--kill-on-bad-exit=1") < words.index(f"--container-image={IMAGE}") < words.index("bash")
    # No image: no pyxis option at all (clusters without pyxis reject them).
    assert "--container" not in sbatch_text(job_spec(dev_cfg(), run_dir))


def test_preflight_job_keeps_resources_and_container_but_no_requeue_machinery(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = dev_cfg(exclusive=True, mem="64G", container=ContainerConfig(image=IMAGE))
    train, pre = job_spec(cfg, run_dir), preflight_job_spec(cfg, run_dir)
    for key in ("nodes", "ntasks_per_node", "cpus_per_task", "exclusive", "mem", "partition", "time"):
        assert pre.parameters[key] == train.parameters[key], key
    text = sbatch_text(pre)
    assert f"--container-image={IMAGE}" in srun_line(text) and "--kill-on-bad-exit" not in text
    assert "#SBATCH --requeue" not in text and "launcher.slurm.driver" not in text  # no prologue, no epilogue
    assert "#SBATCH --job-name=meshrun-preflight" in text and pre.folder == os.path.join(run_dir, "submitit_preflight")
    assert "export NCCL_IB_HCA=mlx5_0" in text


@pytest.mark.parametrize(
    "override,message",
    [
        ("cluster.mem=64GB", "cluster.mem='64GB' is not a Slurm size"),
        ("cluster.cpus_per_task=-2", "cluster.cpus_per_task=-2"),
        ("cluster.container.image='nvcr.io#nvidia/pytorch:24.05 ;id'", "is not an image reference"),
        ("cluster.container.mounts=[/data:/data]", "cluster.container.image is empty"),
        ("+cluster.sbatch_extra.exclusive=true", "cluster.sbatch_extra.exclusive is set by meshrun itself"),
        ("cluster.exclusive=maybe", "invalid configuration"),
        # The tests audit's D4: the contract's "more than 30 s plus one save" was never checked (5 was accepted).
        ("cluster.signal_delay_s=5", "cluster.signal_delay_s=5 leaves no time to save"),
        ("cluster.signal_delay_s=30", "more than 30 s plus one checkpoint save"),
    ],
)
def test_bad_resource_values_exit_2_through_meshrun(override, message, tmp_path):
    # In this process (tests/helpers/cli.py: the console script's cli()); the subprocess smoke test of the same
    # dry run is test_dry_run_through_meshrun_renders_every_option.
    res = run_cli(
        "cluster=slurm_dev",
        "dry_run=true",
        "model=tiny",
        "cluster.cpus_per_task=4",
        f"run.dir={tmp_path / 'run'}",
        override,
        cwd=PROJECT_ROOT,
    )
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert message in res.stderr and "#SBATCH" not in res.stdout


def test_dry_run_through_meshrun_renders_every_option(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "cluster=slurm_dev",
            "dry_run=true",
            "model=tiny",
            f"run.dir={tmp_path / 'run'}",
            "cluster.cpus_per_task=3",
            "cluster.exclusive=true",
            "cluster.mem=500000M",
            f"cluster.container.image='{IMAGE}'",
            "cluster.container.mounts=[/data:/data:ro]",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    for line in ("#SBATCH --cpus-per-task=3", "#SBATCH --exclusive", "#SBATCH --mem=500000M"):
        assert line in lines, line
    assert f"'--container-image={IMAGE}' --container-mounts=/data:/data:ro" in res.stdout


# ------------------------------------------------------------------------------------------ NUMA
def make_sysfs(root, cpulists):
    for i, cl in enumerate(cpulists):
        d = root / "node" / f"node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cl + "\n")
    return str(root / "node")


def test_cpu_ranks_spread_over_numa_nodes(tmp_path):
    nodes = make_sysfs(tmp_path, ["0-15", "16-31"])
    got = [numa.choose_node("auto", [], "cpu", r, 4, sysfs_nodes=nodes) for r in range(4)]
    assert got == [0, 0, 1, 1]
    assert numa.numactl_prefix(1) == ["numactl", "--cpunodebind=1", "--membind=1"]


def test_gpu_rank_binds_to_its_gpus_numa_node(tmp_path):
    nodes = make_sysfs(tmp_path, ["0-15", "16-31"])
    proc = tmp_path / "proc"
    pci = tmp_path / "pci"
    for minor, bus, node in [(0, "00000000:17:00.0", 1), (1, "00000000:A3:00.0", 0)]:
        (proc / bus).mkdir(parents=True)
        (proc / bus / "information").write_text(f"Model: H100\nDevice Minor: {minor}\n")
        short = "0000:" + bus.split(":", 1)[1].lower()
        (pci / short).mkdir(parents=True)
        (pci / short / "numa_node").write_text(f"{node}\n")
    kw = dict(sysfs_nodes=nodes, pci_root=str(pci), proc_root=str(proc))
    assert numa.choose_node("auto", [], "cuda", 0, 2, "0,1", **kw) == 1
    assert numa.choose_node("auto", [], "cuda", 1, 2, "0,1", **kw) == 0
    assert numa.choose_node("auto", [], "cuda", 0, 1, "1", **kw) == 0  # CUDA_VISIBLE_DEVICES remaps


def test_numa_off_and_explicit():
    assert numa.choose_node("off", [], "cuda", 0, 8) is None
    assert numa.choose_node("explicit", [3, 2], "cuda", 1, 2) == 2
    with pytest.raises(ValueError, match="numa_map"):
        numa.choose_node("explicit", [0], "cuda", 1, 2)


def test_affinity_check(tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    nodes = make_sysfs(tmp_path, [",".join(map(str, mine)), "9999"])
    assert slurm_env.check_affinity(0, nodes) is None
    assert "not inside NUMA node 1" in slurm_env.check_affinity(1, nodes)
    assert slurm_env.parse_cpulist("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}


# ------------------------------------------------------------------------------------ Slurm env
def test_hostlist_and_rendezvous():
    assert slurm_env.expand_hostlist("n[1-3],gpu[08-10],x") == ["n1", "n2", "n3", "gpu08", "gpu09", "gpu10", "x"]
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "n[2-3]",
        "SLURM_JOB_ID": "1234",
    }
    out = slurm_env.torch_env_from_slurm(env)
    assert out["RANK"] == "3" and out["WORLD_SIZE"] == "4" and out["LOCAL_RANK"] == "1"
    assert out["LOCAL_WORLD_SIZE"] == "2" and out["MASTER_ADDR"] == "n2"
    port = int(out["MASTER_PORT"])
    assert slurm_env.PORT_BASE <= port < slurm_env.PORT_BASE + slurm_env.PORT_SPAN
    assert slurm_env.port_from_job("1234", 1) != port  # a requeued attempt gets a fresh port
    assert slurm_env.torch_env_from_slurm({}) == {}


# -------------------------------------------------------------------------------------- requeue
def rec(rank, node, code, error="", ended=0.0):
    return {"rank": rank, "node": node, "exit_code": code, "error": error, "ended": ended}


LAYOUT = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
ARGS = dict(
    world_size=4,
    rank_nodes=LAYOUT,
    progressed=True,
    retries_used=0,
    max_retries=2,
    excluded=[],
    partition_nodes=["n1", "n2", "n3"],
    nodes_needed=2,
)


def test_decisions():
    assert decide([rec(r, LAYOUT[r], 0) for r in range(4)], **ARGS).action == "completed"
    assert decide([rec(r, LAYOUT[r], 3) for r in range(4)], **ARGS).action == "requeue"
    d = decide([rec(2, "n2", -9, ended=5.0), rec(0, "n1", -15, ended=6.0)], **ARGS)
    assert d.action == "resubmit" and d.exclude == ["n2"] and d.failures[0].rank == 2
    d = decide([rec(0, "n1", 2, "error: bad")], **ARGS)
    assert d.action == "stop" and d.reason.endswith("not retried: error: bad")  # the rank's own message
    same = [rec(r, LAYOUT[r], 1, "ValueError: boom") for r in range(4)]
    assert decide(same, **{**ARGS, "progressed": False}).action == "stop"
    assert decide(same, **ARGS).action == "resubmit"  # it trained before: not a step-0 bug
    # srun killed the others after the first exit, once they had printed the same exception: still a bug.
    raced = [rec(0, "n1", 1, "ValueError: boom")] + [rec(r, LAYOUT[r], -15, "ValueError: boom") for r in (1, 2, 3)]
    assert decide(raced, **{**ARGS, "progressed": False}).action == "stop"
    # ... but a rank killed before it printed that exception says nothing about it: maybe a bad node.
    early = raced[:3] + [rec(3, "n2", -15, "")]
    assert decide(early, **{**ARGS, "progressed": False}).action == "resubmit"
    d = decide([rec(2, "n2", -9)], **{**ARGS, "retries_used": 2})
    assert d.action == "stop" and "max_retries=2" in d.reason
    d = decide([], **ARGS)  # a node vanished: nobody reported
    assert d.action == "resubmit" and len(d.failures) == 4
    d = decide([rec(r, LAYOUT[r], 4 if r >= 2 else 3) for r in range(4)], **ARGS)
    assert d.action == "resubmit" and d.exclude == ["n2"]


def test_exclusion_never_leaves_too_few_nodes():
    out, note = plan_exclusion(["n2"], ["n1"], ["n1", "n2", "n3"], 2)
    assert out == ["n2"] and "n1" in note and "2 nodes" in note
    assert plan_exclusion([], ["n3"], ["n1", "n2", "n3"], 2) == (["n3"], "")


def test_status_from_events(tmp_path):
    run = str(tmp_path)
    append_event(run, "submitted", job_id="77", attempt=0, excluded_nodes=[])
    append_event(run, "started", job_id="77", attempt=0, nodes=["n1", "n2"])
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    append_event(run, "requeued", job_id="77", attempt=0, cause="failure", excluded_nodes=["n2"], new_job_id="78")
    append_event(run, "started", job_id="78", attempt=1, nodes=["n1", "n3"])
    append_event(run, "completed", job_id="78", attempt=1)
    st = run_status(run)
    goodput = {
        k: st.pop(k) for k in ("goodput", "goodput_s")
    }  # launcher/records/goodput.py (tests/test_in_job_restart.py)
    assert st == {"state": "COMPLETED", "job_id": "78", "attempt": 1, "last_step": 5, "excluded_nodes": ["n2"]}
    assert goodput["goodput_s"]["wall_s"] >= 0 and 0 <= goodput["goodput"] <= 1


def test_status_of_a_sweep_lists_every_point(tmp_path):
    """action=status on a sweep directory: each launched point's own status, skipped points with their
    reason, and the count per state."""
    done, failed = str(tmp_path / "0"), str(tmp_path / "1")
    append_event(done, "submitted", job_id="5_0", attempt=0, excluded_nodes=[])
    append_event(done, "completed", job_id="5_0", attempt=0)
    append_event(failed, "submitted", job_id="5_1", attempt=0, excluded_nodes=[])
    append_event(failed, "stopped", job_id="5_1", attempt=0, reason="invalid configuration or data")
    sweep = {
        "feasible": [
            {"num": 1, "overrides": ["b=2"], "status": "submitted", "job_id": "5_1", "run_dir": failed},
            {"num": 0, "overrides": ["b=1"], "status": "submitted", "job_id": "5_0", "run_dir": done},
        ],
        "infeasible": [{"num": 2, "overrides": ["b=3"], "status": "invalid", "reason": "not divisible"}],
    }
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    res = run_cli("action=status", f"run.dir={tmp_path}", cwd=PROJECT_ROOT)  # in this process: the same cli()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # exactly one JSON object
    assert [p["num"] for p in out["points"]] == [0, 1, 2]
    assert [(p["state"], p.get("job_id")) for p in out["points"]] == [
        ("COMPLETED", "5_0"),
        ("FAILED", "5_1"),
        ("SKIPPED", None),
    ]
    assert out["points"][1]["reason"] == "invalid configuration or data"
    assert out["points"][2]["reason"] == "not divisible"
    assert out["states"] == {"COMPLETED": 1, "FAILED": 1, "SKIPPED": 1}


def test_status_of_local_runs(tmp_path):
    run = str(tmp_path)
    append_event(run, "started", nodes=["here"])
    append_event(run, "checkpoint", step=2)  # a rank's event: the run is still running
    assert run_status(run)["state"] == "RUNNING"
    append_event(run, "stopped", reason="stopped early after a complete checkpoint")
    st = run_status(run)
    assert (st["state"], st["job_id"], st["reason"]) == ("FAILED", "local", "stopped early after a complete checkpoint")
    append_event(run, "started", nodes=["here"])
    append_event(run, "failed", node="here", rank=1, exit_code=1, reason="boom")
    append_event(run, "signal", name="SIGTERM", step=3)
    assert run_status(run)["state"] == "FAILED"


def test_status_of_a_local_run_whose_launcher_was_killed(tmp_path):
    import socket

    # Stand-ins for `python -m launcher ...`: what status looks for is the launcher's pid and command line.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "launcher"])
    gone = subprocess.Popen([sys.executable, "-c", "pass", "launcher"])
    gone.wait()
    run = str(tmp_path)
    try:
        append_event(run, "started", nodes=[socket.gethostname()], launcher_pid=alive.pid)
        assert run_status(run)["state"] == "RUNNING"
    finally:
        alive.kill()
        alive.wait()
    append_event(run, "started", nodes=[socket.gethostname()], launcher_pid=gone.pid)
    st = run_status(run)
    assert st["state"] == "FAILED" and f"pid {gone.pid}" in st["reason"] and "same run.dir" in st["reason"]


def test_slurm_launcher_never_imports_torch():
    code = (
        "import sys, launcher.slurm.submit, launcher.slurm.driver, launcher.slurm.rank_task, launcher.manage.status, "
        "launcher.slurm.requeue, launcher.ranks.numa, launcher.slurm.sbatch, training.contract.slurm_env; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT).returncode == 0


_LATE_SIGNAL_CHILD = r"""
import sys, time
from training.run import signals
signals.install()  # what the Trainer does when a rank starts training (training/run/stop.py decides)
if sys.argv[1] == "finished":
    signals.ignore()  # what Trainer.run does after its final checkpoint
print("ready", flush=True)
time.sleep(0.3)
"""


def _exit_under_signal_storm(stage: str) -> int:
    """A rank process that installed the engine's stop handlers, then exits while USR2/TERM keep coming."""
    import signal
    import time

    p = subprocess.Popen(
        [sys.executable, "-c", _LATE_SIGNAL_CHILD, stage], stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT
    )
    assert p.stdout.readline().strip() == "ready"
    sigs = (signal.SIGUSR2, signal.SIGTERM)
    i = 0
    while p.poll() is None:
        try:
            os.kill(p.pid, sigs[i % 2])
        except ProcessLookupError:
            break
        i += 1
        time.sleep(0.001)
    return p.wait()


@pytest.mark.slow  # starts rank processes under a signal storm
def test_late_stop_signal_cannot_kill_a_rank_after_its_final_save():
    # Python turns its handlers back into the default action (terminate) during interpreter shutdown:
    # with only the flag handler, a late Slurm signal kills a rank that had finished cleanly ...
    assert _exit_under_signal_storm("training") < 0
    # ... once the engine has finished (final checkpoint done) it ignores them and exits 0.
    assert _exit_under_signal_storm("finished") == 0


def test_rank_threads_never_exceed_the_tasks_cpus(monkeypatch):
    """Slurm without CPU binding leaves each task the node's whole affinity: the task's own CPUs
    (SLURM_CPUS_PER_TASK) cap its rank's OpenMP threads."""
    from launcher.ranks import processes as procs

    monkeypatch.setattr(procs, "usable_cores", lambda: 8)
    assert procs.threads_per_rank(2) == 4  # locally: the cores shared by the node's ranks
    assert procs.threads_per_rank(2, allotted=1) == 1 and procs.threads_per_rank(1, allotted=3) == 3
    assert procs.threads_per_rank(4, allotted=16) == 2  # an allotment above the cores' share changes nothing
    assert procs.threads_per_rank(16, allotted=0) == 1


FAKE_PYTHON = """#!/bin/bash
# Stands in for the interpreter of the batch script's epilogue lines: records each epilogue it runs.
if [[ " $* " == *" --srun-rc-on-stdin "* ]]; then
    [ "$MODE" = die ] && exit 3
    read -r rc || exit 0
    printf 'ok\\n'
    echo "early $rc" >> "$LOG"
    exit 40
fi
echo "after srun ${@: -1}" >> "$LOG"
exit 41
"""


@pytest.mark.parametrize("mode, code, ran", [("ok", 40, ["early 2"]), ("die", 41, ["after srun 2"])])
def test_early_epilogue_gets_the_srun_status_once_or_the_epilogue_runs_after_srun(
    tmp_path, monkeypatch, mode, code, ran
):
    """The batch script's own lines (early_epilogue_lines before srun, teardown_lines after it) in bash: the
    early epilogue is handed srun's status and decides the attempt; when it died before the hand-over, the
    epilogue runs after srun as before. Either way exactly one epilogue decides, and the script exits with its
    status."""
    from launcher.slurm import sbatch

    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    monkeypatch.setattr(sbatch, "python_cmd", lambda: shlex.quote(str(fake)))
    lines = sbatch.early_epilogue_lines() + ["sleep 0.3", "(exit 2)  # srun's status"] + sbatch.teardown_lines()
    script = tmp_path / "batch.sh"
    script.write_text("\n".join(["#!/bin/bash", f"export MESHRUN_RUN_DIR={shlex.quote(str(tmp_path))}"] + lines))
    log = tmp_path / "epilogues.log"
    env = dict(os.environ, MODE=mode, LOG=str(log))
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == code, res.stderr
    assert log.read_text().split("\n")[:-1] == ran


@pytest.mark.parametrize(
    "override,message",
    [
        ("+cluster.env.SLURM_JOB_ID=1", "SLURM_JOB_ID"),
        ("+cluster.env.SLURM_RESTART_COUNT=0", "SLURM_RESTART_COUNT"),
        ("+cluster.sbatch_extra.export=NONE", "export"),
        ("+cluster.sbatch_extra.wrap=id", "wrap"),
        ("+cluster.sbatch_extra.uid=0", "uid"),
    ],
)
def test_the_jobs_identity_and_environment_are_meshruns(override, message, tmp_path):
    """The hostile audit's Q2 and Q4, decided (docs/USER_CONTRACTS.md): cluster.env may not set the variables
    that name the job (the prologue's lock claim, the rendezvous port and the warm agents' sockets read them), and
    sbatch_extra may not change the job's environment or user. Both were accepted; both are exit 2 now."""
    res = run_cli(
        "cluster=slurm_dev", "dry_run=true", "model=tiny", f"run.dir={tmp_path / 'run'}", override, cwd=PROJECT_ROOT
    )
    assert res.returncode == 2 and message in res.stderr and "#SBATCH" not in res.stdout, res.stderr[-2000:]
