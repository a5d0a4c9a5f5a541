"""The one configuration contract of meshrun.

Plain dataclasses (no torch, no Hydra): the launcher registers them with Hydra's ConfigStore so
that a misspelt key or a wrong type is an error, resolves them, and hands the resolved values to
every rank as ``run.dir/config.json``; ranks rebuild them with :func:`config_from_dict`.
Each field's docstring is the user's documentation of that key.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar, cast

from training.contract.actions import ACTION_NAMES
from training.contract.lr_schedule import SCHEDULES

T = TypeVar("T")


class Choice(str, Enum):
    """A field with a fixed set of values. Hydra's schema rejects anything else at composition time
    (OmegaConf matches a command-line string against the member names, which equal the values).
    Members are strings: they compare equal to, print as and serialise to their value, so code
    and config.json keep working with plain strings."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choice(name: str, values: str) -> Any:
    # The functional form: names such as "1f1b" are not Python identifiers. Typed Any: mypy cannot follow an Enum
    # built from a computed list (Action, LrSchedule), so choice fields are checked as values, not as members.
    factory: Any = Choice
    return factory(name, [(v, v) for v in values.split()], module=__name__, qualname=name)


Norm = _choice("Norm", "layernorm rmsnorm")
Activation = _choice("Activation", "gelu swiglu")
Attention = _choice("Attention", "flash math")
Position = _choice("Position", "learned rope")
Schedule = _choice("Schedule", "gpipe 1f1b interleaved_1f1b zb_h1")
Recompute = _choice("Recompute", "none selective full")
Precision = _choice("Precision", "auto fp32 bf16 fp16 fp8")
Fp8Recipe = _choice("Fp8Recipe", "tensorwise rowwise")
Optimizer = _choice("Optimizer", "adamw")
ClusterKind = _choice("ClusterKind", "local slurm")
Device = _choice("Device", "cpu cuda")
NumaMode = _choice("NumaMode", "auto off explicit")
PreflightMode = _choice("PreflightMode", "off warn gate")
ExportDtype = _choice("ExportDtype", "auto fp32 bf16 fp16")
DataKind = _choice("DataKind", "synthetic text indexed")
Action = _choice("Action", " ".join(ACTION_NAMES))  # the launcher's table: launcher/cli/actions.py
HealthAction = _choice("HealthAction", "warn requeue")
Offload = _choice("Offload", "none cpu nvme")
LrSchedule = _choice("LrSchedule", " ".join(SCHEDULES))  # the one list: training/contract/lr_schedule.py

# Every choice field, by its command-line key: validation and `meshrun action=keys` read it.
CHOICE_FIELDS: dict[str, type[Choice]] = {
    "model.norm": Norm,
    "model.activation": Activation,
    "model.attention": Attention,
    "model.position": Position,
    "parallel.schedule": Schedule,
    "parallel.recompute": Recompute,
    "train.precision": Precision,
    "train.fp8_recipe": Fp8Recipe,
    "train.optimizer": Optimizer,
    "cluster.kind": ClusterKind,
    "cluster.device": Device,
    "cluster.health.action": HealthAction,
    "cluster.numa": NumaMode,
    "cluster.preflight.mode": PreflightMode,
    "data.kind": DataKind,
    "action": Action,
    "export.dtype": ExportDtype,
    "train.lr_schedule": LrSchedule,
}
CHOICE_FIELDS["parallel.offload"] = Offload


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a choice field, as strings."""
    return tuple(m.value for m in CHOICE_FIELDS[key])


@dataclass
class ModelConfig:
    """A GPT decoder."""

    name: str = "tiny"
    """Preset name, for display only."""
    num_layers: int = 4
    """Transformer layers (L)."""
    hidden_size: int = 64
    """Model width (h)."""
    num_attention_heads: int = 4
    """Attention heads (a); h must be divisible by a."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means one per head (multi-head attention)."""
    ffn_hidden_size: int | None = None
    """MLP width (f); None means 4h."""
    seq_length: int = 64
    """Tokens per sample (s)."""
    vocab_size: int = 256
    """Vocabulary size (V) before padding to a multiple of tp; the byte tokenizer needs at least 256."""
    norm: Norm = Norm.layernorm
    """layernorm | rmsnorm."""
    activation: Activation = Activation.gelu
    """gelu (MLP of width f) | swiglu (gate and up projections of width f)."""
    dropout: float = 0.0
    """Dropout probability after attention softmax, attention output and MLP output."""
    attention: Attention = Attention.flash
    """flash (fused SDPA, never stores the s x s scores) | math (explicit softmax, stores them)."""
    position: Position = Position.learned
    """learned (absolute position embedding table) | rope (rotary, no parameters)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    bias: bool = True
    """Biases in the linear layers and LayerNorm (GPT style); Llama-style models set False."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm (GPT-2: 1e-5; Llama: 1e-5 or 1e-6, config.json's rms_norm_eps)."""
    gelu_tanh: bool = False
    """activation=gelu: use the tanh approximation of GELU (GPT-2's gelu_new) instead of the exact erf form."""
    rope_base: float = 10000.0
    """position=rope: the base (theta) of the rotary frequencies, base^(-2i/d) (Llama 3: 500000)."""
    num_experts: int = 0
    """Mixture of experts: experts in every layer's MLP (0 = the dense MLP)."""
    moe_top_k: int = 2
    """Experts each token is routed to (the router's top k; their gates are softmax-normalised over the k, as
    Mixtral does)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert's MLP; None = ffn_hidden_size (or 4 x hidden_size)."""
    moe_aux_loss_coeff: float = 0.01
    """Weight of the load-balancing auxiliary loss (Switch Transformer / Mixtral form) added to the training loss."""
    moe_capacity_factor: float = 0.0
    """Tokens an expert may take per micro-batch, as a multiple of tokens x top_k / num_experts (the rest are
    dropped and counted); 0 = dropless."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass
class ParallelConfig:
    """How the model and the batch are split over ranks: world = tp x pp x cp x dp, tp fastest."""

    auto: bool = False
    """true (parallel=auto, the default of the cuda cluster presets): at plan and launch time the recommender
    (launcher/recommend/auto.py) fills every parallel.* key not given on the command line with the fastest layout
    that fits, and prints it with the runner-up; config.json records the chosen values with auto false (so a
    resumed run keeps its layout) and plan.json's `auto` says what was chosen, the runner-up and why."""
    auto_pinned: str | None = None
    """Written by the launcher into config.json, not set by users: null when the layout was named or given (an
    elastic resize then changes dp only); when parallel=auto chose it, the parallel.* keys the command line pinned,
    space-separated ('' for none; their values are this config's). An elastic resize of such a run re-plans the new
    node count by the same rule, keeping these keys and global_batch (launcher/slurm/elastic.py)."""
    tp: int = 1
    """Tensor-parallel degree (kept inside a node)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual stages (model chunks) per pipeline rank; > 1 only with schedule=interleaved_1f1b."""
    first_stage_layers: int = 0
    """Transformer layers of the first pipeline rank (Megatron's decoder_first_pipeline_num_layers): it also holds
    the embedding, so it may carry fewer; the ranks not fixed share the rest evenly (training/contract/stage_split.py).
    0: not fixed (the even split)."""
    last_stage_layers: int = 0
    """Transformer layers of the last pipeline rank (Megatron's decoder_last_pipeline_num_layers): it also holds the
    output layer and the loss. 0: not fixed."""
    embedding_in_split: bool = False
    """Count the embedding as one layer when the layers are divided evenly (Megatron's
    account_for_embedding_in_pipeline_split): the first virtual stage builds one transformer layer fewer."""
    loss_in_split: bool = False
    """Count the output layer with the loss as one layer when the layers are divided evenly (Megatron's
    account_for_loss_in_pipeline_split): the last virtual stage builds one transformer layer fewer."""
    cp: int = 1
    """Context-parallel degree: each sample's sequence split over cp ranks in 2 x cp chunks (rank i holds chunks
    i and 2cp-1-i), attention computed across them (training/parallel/context.py)."""
    cp_comm: str = "ring"
    """How attention reaches the other cp ranks' keys and values: ring (passed around the cp ring, overlapping
    each block's attention) | all_gather (gathered once per layer)."""
    ep: int = 1
    """Expert-parallel degree: the experts of every MoE layer split over ep ranks carved out of the data-parallel
    ranks (ep divides dp); tokens reach their experts' ranks by all-to-all."""
    dp: int | None = None
    """Data-parallel degree; None derives it from the cluster's ranks / (tp x pp x cp)."""
    sp: bool = False
    """Sequence parallelism: norms and dropout on sequence shards (needs tp > 1)."""
    zero: int = 0
    """0: gradient all-reduce; 1: distributed optimizer (fp32 masters and Adam states sharded over dp); 2: the
    main grads sharded too (reduced per bucket during backward, only this rank's shard kept); 3: the parameters
    sharded too (each unit gathered before its forward and its backward, released after)."""
    offload: Offload = Offload.none
    """none | cpu (optimizer state and fp32 masters in host memory, the update runs there; on a CPU rank the
    state is in host memory already) | nvme (in files under offload_dir, read and written in blocks)."""
    offload_dir: str = ""
    """offload=nvme: a node-local directory for the state files (one subdirectory per rank, removed at exit)."""
    zero3_reshard_after_forward: bool = True
    """zero=3: release each unit's gathered parameters after its forward and gather them again for backward;
    false keeps them from forward to backward (less communication, more memory)."""
    fp8_all_gather: bool = False
    """train.precision=fp8 with zero=3 and fp8_recipe=tensorwise: gather the FP8 linears' weights in float8 (half
    the bytes of bf16), as torchao's FSDP2 float8 all-gather does: one scale per weight from its amax over every
    shard (one MAX all-reduce after each optimizer step), the gathered float8 weight the matmul's operand
    (docs/FP8.md). Other combinations are refused."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    global_batch: int = 8
    """Sequences per optimizer step over all ranks; = micro_batch x dp x accumulation."""
    schedule: Schedule = Schedule["1f1b"]
    """gpipe | 1f1b | interleaved_1f1b | zb_h1 (zero bubble, Qi et al. 2024: each backward split into the input-grad
    pass, sent on at once, and the weight-grad pass, run later to fill the bubble; 1f1b's peak activation memory;
    training/schedules/pipeline.py)."""
    microbatch_group_size: int = 0
    """schedule=interleaved_1f1b: micro-batches that go through one model chunk before the rank moves to its next
    chunk (Megatron-Core's microbatch_group_size_per_vp_stage); 0 = pp. Between pp and the micro-batches per step,
    the last group (micro-batches mod it) 0 or >= pp; larger groups add (v - 1) x (group - pp) chunk micro-batches
    of warm-up (activations held). The planner, the schedule builders and the engine take any such group (groups
    other than pp exchange by lock-step rounds: training/schedules/pipeline.py)."""
    recompute: Recompute = Recompute.none
    """none | selective (attention core) | full (whole layer)."""
    recompute_num_layers: int = 0
    """With recompute=full: only the first N layers of every pipeline chunk are recomputed (Megatron's block
    method), the others keep their activations; 0 = every layer."""
    allow_tp_across_nodes: bool = False
    """Permit tp > ranks per node (TP then crosses the slow interconnect)."""
    bucket_mb: float = 4.0
    """Size of a gradient communication bucket in MiB."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's data-parallel reduction asynchronously as soon as its grads are final, during backward;
    with zero=1 the updated shards' all-gather also runs into the next step's forward (each layer waits for its own
    parameters)."""
    overlap_p2p: bool = True
    """Pipeline: sends are waited for only at the end of the step (false: each exchange waits for its sends). On gloo
    (CPU) receives are also posted one exchange early; on NCCL they are not (an early receive would enter NCCL's
    per-pair stream ahead of exchanges the schedule still has to post: training/schedules/pipeline.py), so there only the
    send side overlaps."""


@dataclass
class PreflightConfig:
    """Expected hardware and OS values the preflight checks compare against."""

    mode: PreflightMode = PreflightMode.off
    """off | warn (report only) | gate (a failing node stops the attempt and is excluded)."""
    ib_hcas: list[str] = field(default_factory=list)
    """InfiniBand HCAs every node must have ACTIVE and LinkUp (e.g. mlx5_0); empty: none expected."""
    ib_rate_gbps: float = 0.0
    """Expected per-port IB rate in Gb/s (400 for NDR); 0 skips the rate check."""
    ib_sysfs_root: str = "/sys/class/infiniband"
    """Where the IB sysfs tree lives (tests point a node at a fixture)."""
    ib_sysfs_root_by_node: dict[str, str] = field(default_factory=dict)
    """Per-node override of ib_sysfs_root (fault injection on one node of the dev cluster)."""
    matmul_tflops: float = 0.0
    """Expected bf16 dense matmul TFLOP/s per GPU; 0 skips the check."""
    busbw_intra_gbps: float = 0.0
    """Expected all-reduce bus bandwidth inside a node in GB/s; 0 skips the check."""
    busbw_inter_gbps: float = 0.0
    """Expected all-reduce bus bandwidth across nodes in GB/s; 0 skips the check."""
    max_gpu_temp_c: float = 0.0
    """GPU temperature limit; 0 uses the GPU's own slowdown threshold."""
    max_used_gpu_memory_mb: float = 1024.0
    """GPU memory already used by other processes above which a GPU is suspicious."""
    collective_sizes_mb: list[float] = field(default_factory=lambda: [1.0, 8.0])
    """Message sizes of the collective bandwidth sweep."""
    driver_version: str = ""
    """Expected NVIDIA driver version (prefix match, e.g. 550.54); empty: only agreement across nodes is checked."""
    cuda_driver_version: str = ""
    """Expected CUDA version the driver supports (major.minor, e.g. 12.4); empty skips."""
    nccl_version: str = ""
    """Expected NCCL version (prefix match, e.g. 2.21); empty: only agreement across ranks is checked."""
    nvlinks_per_gpu: int = 0
    """NVLink links every GPU must have active (18 on H100 SXM); 0: report only, warn on a partly-down set."""
    min_rate_fraction: float = 0.8
    """A measured rate (matmul TFLOP/s, busbw) below this fraction of the expected one fails (busbw: warns)."""
    straggler_ratio: float = 0.8
    """A rank whose matmul TFLOP/s is below this fraction of the ranks' median is a straggler."""
    matmul_size: int = 0
    """Square matmul size n; 0: 8192 on GPU, 384 on CPU (CPU ranks share cores, keep it short)."""
    collective_iters: int = 5
    """Timed iterations per collective and size (after one warm-up)."""
    max_swappiness: int = 10
    """vm.swappiness above this warns."""
    min_socket_buffer_bytes: int = 67108864
    """net.core.rmem_max / wmem_max below this warn (64 MiB, ESnet's value for 10-100 Gb/s hosts)."""
    timeout_s: float = 120.0
    """Rendezvous and collective timeout of the preflight ranks."""
    min_read_ahead_kb: int = 1024
    """read_ahead_kb of the block devices under run.dir and the data below this warns (sequential checkpoint and
    shard reads in small requests; the kernel's default is 128); 0 skips the check."""
    host_memory_per_rank_gb: float = 4.0
    """Host memory (GiB) one rank needs besides checkpoint staging and offload (its process, CUDA context, pinned
    buffers, data loader): compared, times the node's ranks, with the job's cgroup memory limit."""
    requeue_reuse_min: float = 0.0
    """A Slurm attempt requeued after a stop with a checkpoint (preemption, time limit, exit_interval) does not
    check again the nodes whose last preflight passed at most this many minutes ago and that no failure has named
    since (launcher/slurm/preflight_reuse.py); 0 (default): every attempt checks every node."""


@dataclass
class ContainerConfig:
    """A container every Slurm rank runs in, through the pyxis plugin of srun (enroot underneath)."""

    image: str = ""
    """Image for srun --container-image: a registry reference (nvcr.io#nvidia/pytorch:24.05-py3) or a
    squashfs file; empty: no container."""
    mounts: list[str] = field(default_factory=list)
    """Bind mounts SRC:DST[:FLAGS] for srun --container-mounts (absolute paths); the run directory and
    this Python environment must be visible inside at the same paths."""


@dataclass
class ElasticConfig:
    """Slurm: shrink a resubmitted job to fewer nodes when its full count cannot be had (launcher/slurm/elastic.py)."""

    min_nodes: int = 0
    """Fewest nodes a job may shrink to after excluding failed nodes (data parallelism shrinks, the global batch
    stays, the checkpoint is resharded on load); a later requeue grows it back when nodes return. 0: never shrink.
    Every node count from this to cluster.nodes is validated before the first submission."""
    wait_min: float = 10.0
    """How long a resubmission waits for busy (not drained or down) nodes to free up before it shrinks, minutes;
    the ending job keeps its own healthy nodes meanwhile. Never beyond the job's time limit."""


@dataclass
class HealthConfig:
    """GPU and node health while training (training/observe/health.py): one NVML sampler thread per node."""

    enabled: bool = True
    """Sample NVML on each node (local rank 0) while training; CPU runs without cluster.health.nvml_double skip it."""
    interval_s: float = 5.0
    """Seconds between samples (utilisation, memory, temperature, power, throttle reasons, ECC and remap counters)."""
    action: HealthAction = HealthAction.warn
    """warn (a `health` event naming the node) | requeue (also checkpoint, then stop so the Slurm epilogue
    resubmits the job without that node: its ranks exit with EXIT_NODE_BAD)."""
    throttle_samples: int = 3
    """Consecutive samples with a hardware throttle reason (HW/thermal slowdown, power brake) that make throttling
    persistent."""
    min_throughput_fraction: float = 0.5
    """A node whose tokens/s (its ranks' compute time per step) falls below this fraction of its own baseline (the
    median of its first cluster.health.baseline_intervals log intervals) for throttle_samples intervals is
    unhealthy; 0 disables."""
    baseline_intervals: int = 5
    """Log intervals (after the first step) that make a node's throughput baseline."""
    nvml_double: str = ""
    """Tests and demos on machines without GPUs: a JSON file describing fake GPUs per node (counters may change
    while the run reads it; training/preflight/nvml_double.py), read by the health sampler and by the preflight's
    GPU checks (bench/gpu_preflight.sh --dry); empty: the real NVML."""
    min_utilization_pct: float = 95.0
    """A node whose mean GPU utilisation stays below this for throttle_samples samples gets a `low_utilization`
    event and a warning (the GPUs wait on data, communication or small kernels); 0 disables."""


@dataclass
class ClusterConfig:
    """Where the job runs."""

    name: str = "local"
    """Preset name, for display only."""
    kind: ClusterKind = ClusterKind.local
    """local (processes on this machine) | slurm (submitted through submitit)."""
    nodes: int = 1
    """Nodes of the job."""
    gpus_per_node: int = 4
    """Ranks per node (GPUs; on CPU: processes)."""
    device: Device = Device.cpu
    """cpu (gloo) | cuda (NCCL)."""
    gpu_memory_gb: float = 16.0
    """Usable memory of one accelerator in GiB (2^30 bytes, as nvidia-smi reports it: an H100 80 GB is 81,559 MiB
    = 79.65); on CPU: the share of RAM one rank may use."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one accelerator at the training precision, for MFU; 0: measure (CPU)."""
    peak_tflops_fp8: float = 0.0
    """Peak dense FP8 TFLOP/s of one accelerator (the datasheet's, without sparsity): train.precision=fp8 plans
    the FP8 linears' FLOPs at this rate and reports MFU against it beside peak_tflops; 0: unknown."""
    fp8_supported: bool | None = None
    """Whether the accelerators have FP8 tensor cores (CUDA compute capability 8.9 or newer: L4/L40, H100/H200,
    B200; an A100 has none): false refuses train.precision=fp8 before launch; null: not stated (the engine checks
    the GPU it runs on)."""
    partition: str = ""
    """Slurm partition."""
    account: str = ""
    """Slurm account."""
    qos: str = ""
    """Slurm QOS."""
    time_min: int = 60
    """Slurm time limit of one attempt, minutes."""
    signal_delay_s: int = 90
    """Seconds before the time limit that Slurm sends USR2; must exceed 30 s plus one checkpoint save."""
    max_retries: int = 3
    """Resubmissions after failures before the job stops."""
    node_mtbf_h: float = 0.0
    """Mean time between failures of one node, hours (the job's is this / nodes); 0: unknown. Sets the
    Young/Daly checkpoint interval of train.checkpoint_every_min=auto (launcher/plan/cadence.py)."""
    checkpoint_every_min: str = "0"
    """This cluster's default for train.checkpoint_every_min when that is empty: minutes, 0 (no time-based
    saves) or auto (the Young/Daly optimum from node_mtbf_h and the save time). The Slurm presets: auto."""
    checkpoint_write_gbps: float = 0.0
    """GB/s (1e9 bytes/s) at which the job's ranks together write a checkpoint, for the save time before
    the run has measured one; 0: 1 GB/s per node (an assumption, docs/COST_MODEL.md)."""
    restart_min: float = 10.0
    """Minutes from a failure until training runs again (requeue, scheduling, start-up, checkpoint load), for
    the checkpoint cadence; a run that has been requeued before measures its own (events.jsonl)."""
    exclude: str = ""
    """Nodes never to use (Slurm hostlist)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every rank (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_DEBUG, ...)."""
    secret_keys: list[str] = field(default_factory=lambda: ["KEY", "TOKEN", "SECRET", "PASSWORD"])
    """env keys containing any of these (case-insensitive) are secrets: their values never reach config.json,
    config.yaml, checkpoints, the sbatch script or the dry run; ranks read them from run.dir/secrets.json
    (mode 0600) or the job's environment (training/contract/rundir/secret_env.py)."""
    numa: NumaMode = NumaMode.auto
    """auto (bind each rank to its GPU's NUMA node) | off | explicit (use numa_map)."""
    numa_map: list[int] = field(default_factory=list)
    """NUMA node of each local rank when numa=explicit."""
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    """Extra sbatch options (key without dashes -> value)."""
    job_name: str = ""
    """Slurm job name (sbatch --job-name: what squeue and sacct show); empty: meshrun-<the run directory's name>
    (a sweep's job array: meshrun-<the sweep directory's name>)."""
    comment: str = ""
    """Slurm job comment (sbatch --comment, shown by squeue -o %k and sacct); empty: none. Plain words joined
    by - _ . , : / = + @ (no spaces: Slurm reads #SBATCH lines word by word)."""
    master_port: int = 0
    """Rendezvous port; 0 picks one (local: a free port; Slurm: derived from the job id)."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """Preflight health checks and their expected values."""
    cpus_per_task: int = 0
    """CPUs of each rank (sbatch --cpus-per-task); 0: the node's CPUs divided by the ranks per node, read
    from the partition's nodes (sinfo) when the job is submitted."""
    exclusive: bool = False
    """Whole nodes for the job, shared with no other job (the sbatch --exclusive flag)."""
    mem: str = ""
    """Memory per node (sbatch --mem, a Slurm size: 0 = all of it, 64G, 512000M); empty: the partition's
    default."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Container of the ranks (pyxis/enroot); its image empty: none."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Slurm: elastic shrink after node loss (min_nodes 0: off) and growth back when nodes return."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """GPU health sampling while training and what an unhealthy node triggers."""
    spare_nodes: int = 0
    """Slurm: idle nodes added to the allocation (sbatch --nodes = nodes + spare_nodes). When a rank's node is
    blamed for a failure, the training step restarts inside the same job on a spare instead of requeueing
    (launcher/slurm/in_job.py); with max_in_job_restarts 0, spares imply one in-job restart per spare."""
    max_in_job_restarts: int = 0
    """Slurm: failures recovered inside the running job (a new srun step, resumed from the latest complete
    checkpoint: on a spare when a node is blamed, else on the same nodes) before the job falls back to a
    resubmission excluding the bad nodes; 0: one per spare when cluster.spare_nodes > 0, else every failure
    resubmits (no in-job restart)."""
    in_job_restart_min: float = 1.0
    """Minutes from a failure until training runs again after an in-job restart (no queue wait), for the
    checkpoint cadence (checkpoint_every_min=auto) while spares remain; a run that has restarted in its job
    before measures its own."""
    warm_start: bool = True
    """Slurm, without a container image: one warm agent per node of the allocation (spares included) imports torch
    and the engine once, and every rank of every step (the first, and each in-job restart's) is forked from it
    instead of starting a Python and importing torch again (launcher/ranks/warm/slurm.py,
    training/run/warm_agent.py). Also local launches of two ranks or more: one warm agent per launch forks the
    ranks (ranks under numactl or nsys start cold; launcher/ranks/warm/local.py). false: every rank starts cold."""

    def in_job_restart_limit(self) -> int:
        """In-job restarts an allocation may make: max_in_job_restarts, or with it 0 and spares asked for, one per
        spare (asking for a spare means wanting in-job restarts: the spares would otherwise only wait idle)."""
        if self.max_in_job_restarts > 0:
            return self.max_in_job_restarts
        return max(self.spare_nodes, 0)


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 100
    """Optimizer steps of the whole run."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay (cosine, linear, wsd) and the floor of inverse_sqrt."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    decay_steps: int | None = None
    """Steps of decay after warm-up (cosine, linear, wsd); None: until train.steps."""
    lr_schedule: LrSchedule = LrSchedule.cosine
    """After the linear warm-up: cosine (to min_lr over decay_steps) | linear (to min_lr over decay_steps) |
    constant (lr) | wsd (warmup-stable-decay: lr, then linear to min_lr over the last decay_fraction of the
    decay horizon) | inverse_sqrt (lr x sqrt(max(1, warmup_steps) / (step + 1)), never below min_lr). A pure
    function of the step (training/contract/lr_schedule.py, docs/FORMULAS.md): resuming never changes it."""
    decay_fraction: float = 0.2
    """lr_schedule=wsd: the share of the decay horizon (decay_steps, else the steps after warm-up) spent
    decaying at its end; in [0, 1] (0: no decay, 1: linear decay over the whole horizon)."""
    optimizer: Optimizer = Optimizer.adamw
    """adamw (the only optimizer)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and norms)."""
    fused_adamw: bool | None = None
    """AdamW as one fused kernel over the flat shard: faster, but not bit-identical to torch.optim.AdamW
    (docs/PERFORMANCE.md). null (the default): true on cuda, false on cpu (resolved with the device, like
    precision=auto; config.json records what ran); true | false: as given on any device."""
    precision: Precision = Precision.auto
    """auto (bf16 on GPUs, fp32 on CPU) | fp32 | bf16 (fp32 main grads and masters) | fp16 (dynamic loss scaling) |
    fp8 (bf16 as stored and checkpointed, the linears' matmuls in float8 through torchao: docs/FP8.md)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """precision=fp8: tensorwise (one scale per tensor) | rowwise (one per row, power-of-2 scales): torchao's recipes."""
    fp8_skip: list[str] = field(default_factory=lambda: ["embedding", "output"])
    """precision=fp8: module kinds kept in bf16, of qkv, proj, fc1, fc2, experts, embedding, output (the
    embedding is a lookup and is never FP8)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    seed: int = 1234
    """Seed of initialisation, data order and dropout."""
    loss_scale_init: float = 65536.0
    """fp16: initial loss scale."""
    loss_scale_window: int = 1000
    """fp16: overflow-free steps before the scale doubles."""
    min_loss_scale: float = 1.0
    """fp16: the scale never falls below this."""
    checkpoint_every: int = 0
    """Save every N steps; 0: only at the end and when stopping early."""
    checkpoint_every_min: str = ""
    """Save every T minutes of wall clock: a number of minutes (0: never by time), auto (the Young/Daly
    optimum sqrt(2 x save time x job MTBF) from cluster.node_mtbf_h, launcher/plan/cadence.py), or empty:
    the cluster preset's cluster.checkpoint_every_min. The launcher resolves it (resolved.checkpoint_every_min)."""
    keep_last: int = 3
    """Complete checkpoints kept."""
    checkpointing: bool = True
    """false: the run writes no checkpoint at all (none by step or time, none at the end or at a stop signal, so a
    stopped run cannot resume) and never imports the save path; for throwaway measurement runs, such as
    recommend.calibrate's, whose step times must not include that import's background CPU. Needs
    checkpoint_every=0, exit_interval=0 and exit_after_min=0."""
    async_save: bool = False
    """Write checkpoints in the background after a copy to host memory."""
    checkpoint_replica_dir: str = ""
    """A second copy of every complete checkpoint (absolute, or relative to run.dir; another disk or file system):
    rank 0 copies each sealed checkpoint there in the background (verified, then renamed: never in place; keep_last
    of them), and a resume whose checkpoint in run.dir fails verification restores that step from the copy
    (the damaged one moves to checkpoints/abandoned/). Empty: no replica."""
    resume: str = "auto"
    """auto (latest complete checkpoint in run.dir) | none (fresh start) | a step number."""
    log_every: int = 1
    """Write metrics.jsonl every N steps."""
    exit_interval: int = 0
    """Save and stop this attempt when the step is a multiple of this; 0 disables."""
    exit_after_min: float = 0.0
    """Save and stop this attempt after this many minutes; 0 disables."""
    dist_timeout_s: float = 600.0
    """Collective timeout: a dead peer becomes an error after this long, never a hang. 600 s (10 minutes, torch's own
    default for NCCL) because a real cluster's first collectives legitimately take minutes: NCCL's communicator
    set-up at thousands of ranks, a slow checkpoint load before the first step. Lower it on small jobs to learn of a
    dead peer sooner."""
    progress: bool = True
    """Progress bar on rank 0."""
    init_from: str = ""
    """A Hugging Face model directory (GPT2LMHeadModel or LlamaForCausalLM: config.json + safetensors) to start
    from; the model config comes from its config.json. Read only on a fresh start (no checkpoint in run.dir yet)."""
    eval_every: int = 0
    """Loss on the held-out data every N steps and after the last (metrics `eval_loss`); 0 disables."""
    eval_iters: int = 2
    """Global batches of held-out data per evaluation (the same ones every time, so evaluations compare)."""
    profile_steps: list[int] = field(default_factory=list)
    """[a, b]: torch.profiler traces steps a..b (inclusive) on every rank, one Chrome trace JSON per rank in
    run.dir/profile/ (open in chrome://tracing or Perfetto); empty: no profiling."""
    nvtx: bool = False
    """NVTX ranges over each step, model chunk forward, layer forward and backward, the optimizer step and the
    engine's collectives (training/observe/nvtx.py), for Nsight Systems; on CPU the ranges are counted into
    run.dir/profile/nvtx_rank<R>.json instead."""
    nsys: bool = False
    """GPU: run the ranks of train.nsys_ranks under `nsys profile` with the capture range on train.profile_steps
    (cudaProfilerStart/Stop), one report per rank in run.dir/profile/nsys_rank<R>.nsys-rep; needs nsys on the
    nodes and train.profile_steps."""
    nsys_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that train.nsys wraps (each writes its own report)."""
    memory_snapshot_step: int = 0
    """GPU: after this step dump a CUDA memory snapshot per rank to run.dir/profile/ (pytorch.org/memory_viz);
    CPU: a note that there is none; 0 disables."""
    straggler_margin: float = 0.2
    """A rank whose compute time per step exceeds the ranks' median by this fraction is slow; 0 disables the
    check (it gathers one number per rank per log interval)."""
    straggler_intervals: int = 3
    """Consecutive slow log intervals that make a rank a straggler (a `straggler` event with rank and node)."""
    nan_probe: bool = True
    """When the loss goes non-finite, replay the failing step's micro-batches with forward hooks and name the
    first layer and rank that produced a non-finite value (event `nonfinite`, and on stderr)."""
    progress_every_s: float = 30.0
    """Without a terminal (Slurm logs, a pipe): one progress line every this many seconds (and the first and last
    step); on a terminal the bar is redrawn in place every step."""
    tensorboard: bool = True
    """Rank 0 writes TensorBoard event files to run.dir/tensorboard/ (loss, eval loss, lr, grad norm, loss scale,
    tokens/s, MFU, memory); a resumed run purges the steps after its checkpoint, so each step appears once."""
    wandb: bool = False
    """Also log to Weights & Biases (rank 0; needs `pip install wandb`, never required). The run id is kept in
    run.dir/wandb.json, so every requeue and resume continues the same W&B run."""
    wandb_project: str = "meshrun"
    """train.wandb=true: the W&B project."""
    compile: bool = False
    """Compile each transformer layer with torch.compile (inductor; CPU needs a C++ compiler): per layer, so
    pipeline stages, recompute and the tensor-parallel layers keep their module boundaries. The first step
    carries the compile time (metrics `compile_s`, once); losses match eager within docs/PERFORMANCE.md's
    tolerance."""


@dataclass
class DataConfig:
    """Training data."""

    kind: DataKind = DataKind.text
    """synthetic (random tokens from the seed) | text (files tokenized to bytes) | indexed (Megatron-compatible
    datasets written by `meshrun action=prepare`, memory-mapped, blended by data.weights)."""
    paths: list[str] = field(default_factory=list)
    """Text files or directories (*.py, *.txt, *.md); empty: the Python standard library's sources."""
    max_bytes: int = 8_000_000
    """Bytes of text read at most (the corpus is cached as one memory-mapped file in run.dir)."""
    prefixes: list[str] = field(default_factory=list)
    """data=indexed: dataset prefixes DIR/NAME (NAME.bin + NAME.idx, and NAME.json from prepare)."""
    weights: list[float] = field(default_factory=list)
    """data=indexed: blend weight per prefix (normalised); empty: each dataset's share of the tokens."""
    valid_prefixes: list[str] = field(default_factory=list)
    """data=indexed: held-out datasets for train.eval_every; empty: each prefix's validation split from prepare."""
    tokenizer_sha256: str = ""
    """data=indexed: the sha256 of the tokenizer the first dataset was prepared with, recorded by the run's first
    launch (leave it empty). A later launch, export or generate refuses a dataset or tokenizer with another."""


@dataclass
class RunConfig:
    """Where a run writes."""

    dir: str = "runs/default"
    """Run directory: config, plan, metrics, events, checkpoints; the same dir resumes."""


@dataclass
class ExportConfig:
    """`meshrun action=export`: a checkpoint of run.dir as a Hugging Face model directory."""

    output: str = ""
    """Directory to write (must not exist yet): config.json, safetensors weights, tokenizer files."""
    step: int | None = None
    """Checkpoint step to export; None: the latest complete one."""
    dtype: ExportDtype = ExportDtype.auto
    """auto (the dtype the run trained its weights in) | fp32 (the fp32 master copies when the run kept them) |
    bf16 | fp16."""
    max_shard_mb: float = 5000.0
    """Largest safetensors file in MiB; a larger model is split into model-0000i-of-0000n.safetensors files
    listed by model.safetensors.index.json."""


@dataclass
class GenerateConfig:
    """`meshrun action=generate`: continue a prompt with a checkpoint of run.dir, on one process."""

    prompt_tokens: list[int] = field(default_factory=list)
    """The prompt as token ids."""
    prompt: str = ""
    """The prompt as text, encoded with the run's tokenizer (data=indexed with NAME.tokenizer.json); instead of
    prompt_tokens."""
    prompt_file: str = ""
    """A UTF-8 text file whose whole content is the prompt (instead of prompt and prompt_tokens): text with
    brackets, commas, quotes or newlines needs no Hydra quoting this way."""
    max_new_tokens: int = 32
    """Tokens to generate (prompt plus new tokens must fit model.seq_length)."""
    greedy: bool = True
    """Take the most likely token each step; false samples with temperature, top_k, top_p and seed."""
    temperature: float = 1.0
    """Sampling: logits are divided by this (> 0)."""
    top_k: int = 0
    """Sampling: only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Sampling: only the most likely tokens whose probabilities sum to p (nucleus); 1 keeps all."""
    seed: int = 0
    """Sampling: seed of the token draws."""
    step: int | None = None
    """Checkpoint step; None: the latest complete one."""
    stop_tokens: list[int] = field(default_factory=list)
    """Stop once one of these token ids is generated (it is included in `tokens`)."""


@dataclass
class RecommendConfig:
    """`meshrun action=recommend`: rank every valid layout of the model on the cluster by predicted step time."""

    top: int = 10
    """Layouts printed (and written to recommend.json as candidates, with the fastest that do not fit)."""
    calibrate: bool = False
    """Run the top candidates for a few steps here (local CPU processes, synthetic data, each in
    run.dir/calibrate/NN) and re-rank them by measured throughput, with the Spearman rank correlation."""
    calibrate_count: int = 4
    """Candidates the calibration runs (at least 2 for a rank correlation)."""
    calibrate_steps: int = 8
    """Steps of each calibration run; the first is left out of the measurement (warm-up)."""
    calibrate_passes: int = 3
    """Passes over the chosen candidates, every other one in reverse order, each running
    calibrate_steps / calibrate_passes steps (at least 3) of every candidate; a candidate's measured step time is
    the lowest of its passes' medians. Several windows apart in time: outside load that holds a whole pass misses
    at least one of them; 1: one run per candidate (quicker, for an idle machine)."""
    calibrate_min_gap: float = 0.1
    """Calibrate candidates whose predicted step times differ by at least this fraction from the next faster
    one chosen: layouts predicted within a few percent cannot be told apart by a short run on a shared machine."""
    probe: bool = True
    """On CPU clusters, measure this machine's layer compute rate and gloo collective latency and bandwidth in a
    subprocess (python -m training.observe.cost_probe) before ranking; false: the cluster config's rates only."""
    max_micro_batch: int = 16
    """Largest micro-batch size searched."""
    min_headroom_gb: float = 0.0
    """GiB (2^30 bytes) a recommended layout must leave free per GPU beyond its planned memory (allocator
    fragmentation, NCCL buffers, the CUDA context: what the plan does not count); 0: fitting is enough."""


@dataclass
class ResolvedConfig:
    """What the launcher resolved for this launch and wrote into config.json, for the ranks (not set by users)."""

    checkpoint_every_min: float | None = None
    """The minutes train.checkpoint_every_min resolved to for this launch (auto: the optimum then;
    launcher/plan/cadence.py); the engine saves by this. None: train.checkpoint_every_min as a number."""


@dataclass
class Config:
    """The whole job, as every rank reads it from run.dir/config.json. The command line's own options (the groups
    only the launcher's actions read: prepare, keys, status, runs, logs, cancel) are launcher/cli/options.py's
    AppConfig, which extends this one."""

    action: Action = Action.train
    """What to run; the launcher's action table (launcher/cli/actions.py) runs it, and `meshrun --help` and
    `meshrun action=keys` list each action with its summary from that table:"""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dry_run: bool = False
    """Slurm: print the sbatch script and srun line, submit nothing."""
    wait: bool = False
    """Slurm: follow the job and stream rank 0's progress; in a sweep, wait until every point has ended
    (the summary then shows each point's final state)."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """action=export: where to write the Hugging Face directory and from which checkpoint."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """action=generate: prompt, length and sampling of the continuation."""
    recommend: RecommendConfig = field(default_factory=RecommendConfig)
    """action=recommend: how many layouts to print, and the calibration runs; parallel=auto's search limits
    (max_micro_batch, min_headroom_gb), which a Slurm job's resize re-plans by from config.json."""
    resolved: ResolvedConfig = field(default_factory=ResolvedConfig)
    """Values the launcher resolves and writes into config.json for the ranks; never set by users."""

    def __post_init__(self) -> None:
        # precision=auto means what the device does best; resolved here, the one place every Config passes
        # (Hydra's schema, config.json on the ranks, tests), so the planner and the engine only ever see a
        # concrete precision and config.json records what really ran.
        if self.train.precision == "auto":
            self.train.precision = Precision.bf16 if self.cluster.device == "cuda" else Precision.fp32
        # fused_adamw=null likewise: the fused kernel where the unfused passes are memory-bound launches (GPUs).
        self.train.fused_adamw = resolve_fused_adamw(self.train.fused_adamw, str(self.cluster.device))


def resolve_fused_adamw(value: bool | None, device: str) -> bool:
    """train.fused_adamw as the engine runs it: null (unset) means true on cuda and false on cpu (where the
    unfused update is torch.optim.AdamW's, bit for bit); an explicit true or false is kept on any device."""
    if value is None:
        return device == "cuda"
    return bool(value)


def _nested(cls: type) -> dict[str, type]:
    """cls's fields whose type is itself a config dataclass, by name (from the annotations, never a second list)."""
    found = _NESTED.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _NESTED[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if _is_class(hints[f.name])}
    return found


def _is_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


_NESTED: dict[type, dict[str, type]] = {}


def build(cls: type[T], data: dict[str, Any]) -> T:
    """An instance of the config dataclass cls from plain dicts, nested groups included; unknown keys are an error."""
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cast(Any, cls))}
    nested = _nested(cls)
    for key, value in data.items():
        if key not in names:
            raise KeyError(f"unknown config key {cls.__name__}.{key}")
        sub = nested.get(key)
        kwargs[key] = build(sub, value) if sub is not None and value is not None else value
    return cls(**kwargs)


# What config.json files written by earlier versions hold and this one does not: the command line's option groups
# (launcher/cli/options.py owns them now) and the tests' knobs (training/run/pacing.py; the Trainer's
# keep_host_memory). Read and dropped, so a run written then still resumes.
_RETIRED_GROUPS = ("prepare", "keys", "status", "runs", "logs", "cancel")
_RETIRED_TRAIN_KEYS = ("min_step_s", "host_memory_keep")


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """config.json as this version reads it: retired groups and keys dropped, train.checkpoint_every_min_resolved
    (where earlier launchers wrote it) under resolved."""
    train = data.get("train")
    old_train = isinstance(train, dict) and any(
        k in train for k in ("checkpoint_every_min_resolved", *_RETIRED_TRAIN_KEYS)
    )
    if not old_train and not any(k in data for k in _RETIRED_GROUPS):
        return data
    data = {k: v for k, v in data.items() if k not in _RETIRED_GROUPS}
    if isinstance(train, dict) and old_train:
        train = {k: v for k, v in train.items() if k not in _RETIRED_TRAIN_KEYS}
        data["train"] = train
        if "checkpoint_every_min_resolved" in train:
            minutes = train.pop("checkpoint_every_min_resolved")
            data["resolved"] = {"checkpoint_every_min": minutes, **(data.get("resolved") or {})}
    return data
    data = {k: v for k, v in data.items() if k not in _RETIRED_GROUPS}
    train = data.get("train")
    if isinstance(train, dict) and "checkpoint_every_min_resolved" in train:
        train = dict(train)
        minutes = train.pop("checkpoint_every_min_resolved")
        data["train"] = train
        data["resolved"] = {"checkpoint_every_min": minutes, **(data.get("resolved") or {})}
    return data


def checkpoint_minutes(cfg: Config) -> float:
    """Minutes between time-based saves: the launcher's resolution, else train.checkpoint_every_min (empty: the
    cluster's default) as a number. An unresolved auto is an error: only the launcher knows the save time."""
    t = cfg.train
    if cfg.resolved.checkpoint_every_min is not None:
        return float(cfg.resolved.checkpoint_every_min)
    value = str(t.checkpoint_every_min).strip() or str(cfg.cluster.checkpoint_every_min).strip() or "0"
    if value == "auto":
        raise ValueError(
            "train.checkpoint_every_min=auto was not resolved: launch through meshrun, which writes "
            "resolved.checkpoint_every_min into config.json (launcher/plan/cadence.py)"
        )
    return float(value)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from plain dicts (config.json, also one an earlier version wrote); unknown keys are an
    error."""
    return build(Config, _upgraded(data))


def _plain(pairs) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in pairs}


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Config's fields as plain dicts, lists, numbers and strings (choice fields as their string value): what
    config.json holds. A launcher's AppConfig gives its Config part only (the ranks read no command-line option)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = dataclasses.asdict(value, dict_factory=_plain)
        else:
            out[f.name] = value.value if isinstance(value, Enum) else value
    return out


def load_config(path: str) -> Config:
    with open(path) as f:
        return config_from_dict(json.load(f))


def derived_dp(cfg: Config) -> int:
    """dp as given, or the cluster's ranks divided by tp x pp x cp (0 when that does not divide)."""
    if cfg.parallel.dp is not None:
        return cfg.parallel.dp
    ranks = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    mp = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    return ranks // mp if mp > 0 and ranks % mp == 0 else 0
