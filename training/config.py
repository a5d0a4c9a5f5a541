"""The one configuration contract of meshrun.

Plain dataclasses (no torch, no Hydra): the launcher registers them with Hydra's ConfigStore so
that a misspelt key or a wrong type is an error, resolves them, and hands the resolved values to
every rank as ``run.dir/config.json``; ranks rebuild them with :func:`config_from_dict`.
Each field's docstring is the user's documentation of that key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional


class Choice(str, Enum):
    """A field with a fixed set of values. Hydra's schema rejects anything else at composition time
    (OmegaConf matches a command-line string against the member names, which equal the values).
    Members are strings: they compare equal to, print as and serialise to their value, so code
    and config.json keep working with plain strings."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choice(name: str, values: str) -> type:
    # The functional form: names such as "1f1b" are not Python identifiers.
    return Choice(name, [(v, v) for v in values.split()], module=__name__, qualname=name)


Norm = _choice("Norm", "layernorm rmsnorm")
Activation = _choice("Activation", "gelu swiglu")
Attention = _choice("Attention", "flash math")
Position = _choice("Position", "learned rope")
Schedule = _choice("Schedule", "gpipe 1f1b interleaved_1f1b")
Recompute = _choice("Recompute", "none selective full")
Precision = _choice("Precision", "auto fp32 bf16 fp16")
Optimizer = _choice("Optimizer", "adamw")
ClusterKind = _choice("ClusterKind", "local slurm")
Device = _choice("Device", "cpu cuda")
NumaMode = _choice("NumaMode", "auto off explicit")
PreflightMode = _choice("PreflightMode", "off warn gate")
DataKind = _choice("DataKind", "synthetic text")
Action = _choice("Action", "train plan status preflight keys")

# Every choice field, by its command-line key: validation and `meshrun action=keys` read it.
CHOICE_FIELDS: Dict[str, type] = {
    "model.norm": Norm, "model.activation": Activation, "model.attention": Attention,
    "model.position": Position, "parallel.schedule": Schedule, "parallel.recompute": Recompute,
    "train.precision": Precision, "train.optimizer": Optimizer, "cluster.kind": ClusterKind,
    "cluster.device": Device, "cluster.numa": NumaMode, "cluster.preflight.mode": PreflightMode,
    "data.kind": DataKind, "action": Action,
}


def choices(key: str) -> tuple:
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
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None means one per head (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
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

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass
class ParallelConfig:
    """How the model and the batch are split over ranks: world = tp x pp x cp x dp, tp fastest."""

    tp: int = 1
    """Tensor-parallel degree (kept inside a node)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual stages (model chunks) per pipeline rank; > 1 only with schedule=interleaved_1f1b."""
    cp: int = 1
    """Context-parallel degree (sequence split for attention); cp > 1 is planned and validated, training refuses it."""
    dp: Optional[int] = None
    """Data-parallel degree; None derives it from the cluster's ranks / (tp x pp x cp)."""
    sp: bool = False
    """Sequence parallelism: norms and dropout on sequence shards (needs tp > 1)."""
    zero: int = 0
    """0: gradient all-reduce; 1: distributed optimizer (fp32 masters and Adam states sharded over dp)."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    global_batch: int = 8
    """Sequences per optimizer step over all ranks; = micro_batch x dp x accumulation."""
    schedule: Schedule = Schedule["1f1b"]
    """gpipe | 1f1b | interleaved_1f1b."""
    recompute: Recompute = Recompute.none
    """none | selective (attention core) | full (whole layer)."""
    allow_tp_across_nodes: bool = False
    """Permit tp > ranks per node (TP then crosses the slow interconnect)."""
    bucket_mb: float = 4.0
    """Size of a gradient communication bucket in MiB."""


@dataclass
class PreflightConfig:
    """Expected hardware and OS values the preflight checks compare against."""

    mode: PreflightMode = PreflightMode.off
    """off | warn (report only) | gate (a failing node stops the attempt and is excluded)."""
    ib_hcas: List[str] = field(default_factory=list)
    """InfiniBand HCAs every node must have ACTIVE and LinkUp (e.g. mlx5_0); empty: none expected."""
    ib_rate_gbps: float = 0.0
    """Expected per-port IB rate in Gb/s (400 for NDR); 0 skips the rate check."""
    ib_sysfs_root: str = "/sys/class/infiniband"
    """Where the IB sysfs tree lives (tests point a node at a fixture)."""
    ib_sysfs_root_by_node: Dict[str, str] = field(default_factory=dict)
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
    collective_sizes_mb: List[float] = field(default_factory=lambda: [1.0, 8.0])
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


@dataclass
class ContainerConfig:
    """A container every Slurm rank runs in, through the pyxis plugin of srun (enroot underneath)."""

    image: str = ""
    """Image for srun --container-image: a registry reference (nvcr.io#nvidia/pytorch:24.05-py3) or a
    squashfs file; empty: no container."""
    mounts: List[str] = field(default_factory=list)
    """Bind mounts SRC:DST[:FLAGS] for srun --container-mounts (absolute paths); the run directory and
    this Python environment must be visible inside at the same paths."""


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
    """Memory of one accelerator in GB (1e9 bytes); on CPU: the share of RAM one rank may use."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one accelerator at the training precision, for MFU; 0: measure (CPU)."""
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
    exclude: str = ""
    """Nodes never to use (Slurm hostlist)."""
    env: Dict[str, str] = field(default_factory=dict)
    """Environment for every rank (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_DEBUG, ...)."""
    numa: NumaMode = NumaMode.auto
    """auto (bind each rank to its GPU's NUMA node) | off | explicit (use numa_map)."""
    numa_map: List[int] = field(default_factory=list)
    """NUMA node of each local rank when numa=explicit."""
    sbatch_extra: Dict[str, str] = field(default_factory=dict)
    """Extra sbatch options (key without dashes -> value)."""
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


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 100
    """Optimizer steps of the whole run."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    decay_steps: Optional[int] = None
    """Steps of cosine decay after warm-up; None: until train.steps."""
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
    precision: Precision = Precision.auto
    """auto (bf16 on GPUs, fp32 on CPU) | fp32 | bf16 (fp32 main grads and masters) | fp16 (dynamic loss scaling)."""
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
    checkpoint_every_min: float = 0.0
    """Save every T minutes of wall clock; 0 disables (clusters: 60-120)."""
    keep_last: int = 3
    """Complete checkpoints kept."""
    async_save: bool = False
    """Write checkpoints in the background after a copy to host memory."""
    resume: str = "auto"
    """auto (latest complete checkpoint in run.dir) | none (fresh start) | a step number."""
    log_every: int = 1
    """Write metrics.jsonl every N steps."""
    exit_interval: int = 0
    """Save and stop this attempt when the step is a multiple of this; 0 disables."""
    exit_after_min: float = 0.0
    """Save and stop this attempt after this many minutes; 0 disables."""
    dist_timeout_s: float = 120.0
    """Collective timeout: a dead peer becomes an error after this long, never a hang."""
    progress: bool = True
    """Progress bar on rank 0."""


@dataclass
class DataConfig:
    """Training data."""

    kind: DataKind = DataKind.text
    """synthetic (random tokens from the seed) | text (files tokenized to bytes)."""
    paths: List[str] = field(default_factory=list)
    """Text files or directories (*.py, *.txt, *.md); empty: the Python standard library's sources."""
    max_bytes: int = 8_000_000
    """Bytes of text read at most (the corpus is cached as one memory-mapped file in run.dir)."""


@dataclass
class RunConfig:
    """Where a run writes."""

    dir: str = "runs/default"
    """Run directory: config, plan, metrics, events, checkpoints; the same dir resumes."""


@dataclass
class KeysConfig:
    """What `meshrun action=keys` prints."""

    group: str = ""
    """Only this group's keys (model, parallel, cluster, train, data, run); empty: every key."""


@dataclass
class Config:
    """The whole job."""

    action: Action = Action.train
    """train (validate, plan, launch) | plan (validate and plan only) | status | preflight | keys (print every key)."""
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
    keys: KeysConfig = field(default_factory=KeysConfig)
    """action=keys: which keys to print."""

    def __post_init__(self) -> None:
        # precision=auto means what the device does best; resolved here, the one place every Config passes
        # (Hydra's schema, config.json on the ranks, tests), so the planner and the engine only ever see a
        # concrete precision and config.json records what really ran.
        if self.train.precision == "auto":
            self.train.precision = Precision.bf16 if self.cluster.device == "cuda" else Precision.fp32


def _build(cls, data: Any):
    if not dataclasses.is_dataclass(cls) or data is None:
        return data
    kwargs = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise KeyError(f"unknown config key {cls.__name__}.{key}")
        sub = _DATACLASS_FIELDS.get((cls, key))
        kwargs[key] = _build(sub, value) if sub else value
    return cls(**kwargs)


_DATACLASS_FIELDS = {
    (Config, "model"): ModelConfig,
    (Config, "parallel"): ParallelConfig,
    (Config, "cluster"): ClusterConfig,
    (Config, "train"): TrainConfig,
    (Config, "data"): DataConfig,
    (Config, "run"): RunConfig,
    (Config, "keys"): KeysConfig,
    (ClusterConfig, "preflight"): PreflightConfig,
    (ClusterConfig, "container"): ContainerConfig,
}


def config_from_dict(data: Dict[str, Any]) -> Config:
    """Rebuild a Config from plain dicts (config.json); unknown keys are an error."""
    return _build(Config, data)


def _plain(pairs) -> Dict[str, Any]:
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in pairs}


def config_to_dict(cfg: Config) -> Dict[str, Any]:
    """Plain dicts, lists, numbers and strings (choice fields as their string value)."""
    return dataclasses.asdict(cfg, dict_factory=_plain)


def load_config(path: str) -> Config:
    with open(path) as f:
        return config_from_dict(json.load(f))


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        json.dump(config_to_dict(cfg), f, indent=2, sort_keys=True)


def derived_dp(cfg: Config) -> int:
    """dp as given, or the cluster's ranks divided by tp x pp x cp (0 when that does not divide)."""
    if cfg.parallel.dp is not None:
        return cfg.parallel.dp
    ranks = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    mp = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    return ranks // mp if mp > 0 and ranks % mp == 0 else 0
