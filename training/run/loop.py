"""The training loop every rank runs: micro-batch schedule, optimizer step, metrics, stop/checkpoint hooks.

Structure:
- a *schedule* owns the micro-batch loop: `forward_backward(micro_batches) -> local mean loss`
  (training/schedules/: `make_schedule` picks the one for the layout);
- the optimizer owns the dp reduction, clipping and the update (training/optim/);
- `Trainer.run` owns steps: data position, LR, logging, the stop flag and checkpoint call sites.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from training.checkpoint import CheckpointManager
from training.contract.config import Config
from training.contract.exit_codes import EXIT_OK, EXIT_STOPPED
from training.contract.layout_rules import layout_violations, raise_errors
from training.contract.lr_schedule import lr_at, schedule_problems
from training.contract.precision import param_dtype
from training.contract.rundir.paths import RunPaths
from training.data import BatchSampler, DataError, build_corpus, make_eval_source, make_source, validate_data_config
from training.model.moe import reset_moe_stats
from training.observe import startup
from training.observe.busy_timer import BusyTimer
from training.observe.observer import Observer, StepRecord
from training.optim import DistributedOptimizer, StepResult
from training.parallel import collectives as comm
from training.run import signals
from training.run.observers import Totals, build_observers
from training.run.pacing import pace_step_s
from training.run.stop import StopRule, install_signals
from training.schedules import make_schedule

PACE_SLICE_S = 0.1
"""Step pacing (training/run/pacing.py) waits in slices of this length: how late a stop signal that arrives during the
wait is seen."""


@dataclass
class TrainState:
    """Where the run is; saved in checkpoints so a resumed run continues exactly."""

    step: int = 0
    """Optimizer steps completed."""
    consumed_samples: int = 0
    """Samples of the global stream consumed (the data position; independent of dp)."""


# ---- helpers --------------------------------------------------------------------------------------
PEAK_PROBE_N = {"cuda": 8192, "cpu": 512}
"""Square matmul size of the peak measurement: on GPUs one that saturates the tensor cores (at 512^3 one
matmul lasts a few microseconds and launch latency, not the device, sets the rate); on CPU a small one."""


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 0) -> float:
    """FLOP/s of a square matmul on this rank (the 'peak' for MFU when cluster.peak_tflops is 0): the
    preflight's probe (training/preflight/matmul.py: a warm-up call, then ~0.2 s of timed calls), best of
    three. n = 0: PEAK_PROBE_N of the device type."""
    from training.preflight.matmul import measure_tflops

    n = n or PEAK_PROBE_N.get(device.type, PEAK_PROBE_N["cuda"])
    iters = 4 if device.type == "cpu" else 0  # CPU: a fixed few (every Trainer measures); GPU: ~0.2 s each
    best = max(measure_tflops(str(device), n, iters=iters, dtype=dtype)["tflops"] for _ in range(3))
    return best * 1e12


def model_flops_per_step(run_dir: str) -> float | None:
    """plan.json's model_flops_per_step (the planner's one formula: launcher/plan/model_size.py), or None
    without a plan: the run then reports no MFU rather than a second, rougher formula's."""
    try:
        with open(RunPaths(run_dir).plan) as f:
            value = json.load(f).get("model_flops_per_step")
    except (OSError, ValueError):
        return None
    return float(value) if value else None


def peak_reserved_bytes(device: torch.device) -> int:
    """Peak bytes the CUDA caching allocator reserved on this rank; on CPU, peak_memory_bytes."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return peak_memory_bytes(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# ---- checkpoint call sites ------------------------------------------------------------------------
def make_checkpointer(cfg: Config, run_dir: str, mesh) -> CheckpointManager:
    """Saves, resumes, and decides (agreed over all ranks) when this attempt stops early."""
    return CheckpointManager(run_dir, mesh, cfg)


# ---- the trainer ----------------------------------------------------------------------------------
@dataclass
class Summary:
    """The closing summary of a run (printed by rank 0, written to run_dir/summary.json)."""

    steps: int
    tokens_per_s: float
    """Mean over the steps after the first (the first includes warm-up)."""
    mfu: float | None
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)
    skipped_steps: int = 0
    exit_code: int = 0
    peak_reserved_bytes_per_rank: list[int] = field(default_factory=list)
    """The CUDA caching allocator's peak reserved bytes per rank after the first step (what the GPU really
    gave the allocator: allocated plus its fragmentation; bench/gpu_check.sh compares it with the plan); on
    CPU the same figure as peak_memory_bytes_per_rank."""
    mfu_fp8: float | None = None
    """train.precision=fp8 with cluster.peak_tflops_fp8 set: the mean MFU against the FP8 peak (`mfu` stays
    against the bf16 one, cluster.peak_tflops or the measured rate); None otherwise."""


class Trainer:
    """Builds model, optimizer and data for this rank and runs the steps."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str,
        mesh,
        chunks: list[torch.nn.Module] | None = None,
        checkpointing: bool = True,
        keep_host_memory: bool = True,
    ):
        self.cfg, self.run_dir, self.mesh = cfg, run_dir, mesh
        self.is_logger = mesh.rank == 0
        self.pace_s = pace_step_s()  # tests' and benchmarks' step pacing (MESHRUN_PACE_STEP_S), never a user key
        self._check_layout()
        # CPU runs: freed heap memory stays mapped for the next step (training/run/host_memory.py); not a user key,
        # changes no result; off only where the engine runs inside another process (the rehearsal, its tests).
        if keep_host_memory:  # before the model's and the optimizer's allocations
            from training.run.host_memory import keep_freed_host_memory

            keep_freed_host_memory(torch.device(mesh.device))
        if cfg.train.memory_snapshot_step > 0:  # the allocator's history from before the model's allocations
            from training.observe.profile import start_memory_history

            start_memory_history(cfg, mesh.device)
        validate_data_config(cfg)
        torch.manual_seed(cfg.train.seed)
        if chunks is None:
            from training.model.gpt import build_gpt

            chunks = build_gpt(cfg, mesh, param_dtype(cfg.train.precision))
            if cfg.train.init_from:
                from training.hf.init_from import maybe_init_from

                # Before the optimizer exists: it copies the weights into its fp32 masters.
                maybe_init_from(cfg, run_dir, mesh, chunks)
        self.chunks = chunks
        self.compile_clock, self.compiled_layers = None, 0
        if cfg.train.compile:  # before the optimizer and the schedule see the layers (training/model/compile_layers.py)
            from training.model.compile_layers import CompileClock, compile_layers

            self.compile_clock = CompileClock()
            self.compiled_layers = compile_layers(chunks)
        params = [(n, p) for c in chunks for n, p in c.named_parameters()]
        self.optimizer = DistributedOptimizer(params, cfg, mesh)
        # zero=1: each layer waits for its own updated parameters when its forward starts (train_step's
        # defer_param_gather; optim/param_gather.py).
        self.optimizer.watch_modules(chunks)
        self.schedule = make_schedule(cfg, mesh, chunks, self.optimizer)
        self.sampler = BatchSampler(
            self._source(), cfg.parallel.global_batch, cfg.parallel.micro_batch, mesh.dp, mesh.dp_rank
        )
        # Held-out data (train.eval_every): the same global batches at every evaluation, split over dp like training's.
        self.eval_sampler = None
        if cfg.train.eval_every > 0:
            self.eval_sampler = BatchSampler(
                self._rank0_first(make_eval_source, "the held-out data"),
                cfg.parallel.global_batch,
                cfg.parallel.micro_batch,
                mesh.dp,
                mesh.dp_rank,
            )
        self.eval_losses: list[tuple[int, float]] = []
        self.state = TrainState()
        self.checkpointer = make_checkpointer(cfg, run_dir, mesh) if checkpointing else None
        self.stop_rule = StopRule(cfg, run_dir, mesh, self.checkpointer)
        if checkpointing:  # a stop during the rest of the start-up is a checkpoint at the first boundary
            install_signals()
        self.tokens_per_step = cfg.parallel.global_batch * cfg.model.seq_length
        self.flops_per_step = model_flops_per_step(run_dir)
        self.peak_flops = self._peak_flops()

    def _check_layout(self) -> None:
        """The launcher's layout rules (training/contract/layout_rules.py) on the layout this rank really runs:
        LayoutError on a broken one; warnings (e.g. sp with tp = 1: sequence parallelism off) said once."""
        par = self.cfg.parallel
        cfg = dataclasses.replace(
            self.cfg,
            parallel=dataclasses.replace(par, tp=self.mesh.tp, pp=self.mesh.pp, cp=self.mesh.cp, ep=self.mesh.ep),
        )
        for warning in raise_errors(layout_violations(cfg, self.mesh.dp)):
            if self.is_logger:
                print(f"warning: {warning}", file=sys.stderr)
        problems = schedule_problems(self.cfg.train)
        if problems:
            from training.contract.layout_rules import LayoutError

            raise LayoutError("; ".join(f"{key} {message} (fix: {fix})" for key, message, fix in problems))

    def _source(self):
        corpus, error = None, None
        if self.cfg.data.kind == "text":
            # One rank builds the cached corpus file; the others wait, then map the same file.
            if self.mesh.rank == 0:
                try:
                    corpus = build_corpus(self.cfg, self.run_dir)
                except DataError as exc:
                    error = exc
            # Instead of a plain barrier: every rank learns of rank 0's data error and exits 2 with it,
            # rather than waiting out the collective timeout and exiting as a failure.
            if self._any_rank(error is not None):
                raise error or DataError("rank 0 could not build the text corpus; its log names the fix")
            if corpus is None:
                corpus = build_corpus(self.cfg, self.run_dir)  # finds rank 0's file
        if self.cfg.data.kind == "indexed":
            return self._rank0_first(
                lambda cfg, may_describe: make_source(cfg, self.run_dir, None, may_describe), "the indexed datasets"
            )
        return make_source(self.cfg, self.run_dir, corpus)

    def _rank0_first(self, make, what: str):
        """make(cfg, may_describe) on rank 0 first (it may scan a dataset once and cache its description beside
        it), then on the others (constant time, no writes); rank 0's DataError reaches every rank at once."""
        source, error = None, None
        if self.mesh.rank == 0:
            try:
                source = make(self.cfg, True)
            except DataError as exc:
                error = exc
        if self._any_rank(error is not None):
            raise error or DataError(f"rank 0 could not open {what}; its log names the fix")
        return source if source is not None else make(self.cfg, False)

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (a barrier that also carries one bit)."""
        if not (comm.is_initialized() and comm.world_size() > 1):
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.mesh.device)
        comm.all_reduce_op(t, op=comm.ReduceOp.MAX)
        return bool(comm.value(t, on_meta=0))

    def _peak_flops(self) -> float:
        """Peak FLOP/s of the whole job: cluster.peak_tflops per rank, or this machine's measured matmul rate."""
        if self.cfg.cluster.peak_tflops > 0:
            per_rank = self.cfg.cluster.peak_tflops * 1e12
        else:
            dtype = torch.float32 if self.mesh.device.type == "cpu" else param_dtype(self.cfg.train.precision)
            per_rank = measure_peak_flops(self.mesh.device, dtype)
        return per_rank * self.mesh.world_size

    def _global_loss(self, local: torch.Tensor) -> float:
        """Mean loss over the global batch: mean over dp of the last stage's loss, known on every rank."""
        value = local.detach().float().reshape(1).clone()
        if not self.mesh.is_last_stage:
            value.zero_()
        if self.mesh.dp > 1:
            comm.all_reduce_op(value, group=self.mesh.dp_group)
            value /= self.mesh.dp
        if self.mesh.cp > 1:  # every cp rank holds as many tokens: the mean of their means
            comm.all_reduce_op(value, group=self.mesh.cp_group)
            value /= self.mesh.cp
        if self.mesh.pp > 1:
            comm.all_reduce_op(value, group=self.mesh.pp_group)
        return comm.value(value, on_meta=1.0)

    # -- checkpoint call sites --
    def _extra_state(self) -> dict[str, Any]:
        # micro_step keys each chunk's dropout masks: restoring it keeps dropout bit-exact across a resume.
        return {
            "consumed_samples": self.state.consumed_samples,
            "micro_steps": [int(getattr(c, "micro_step", 0)) for c in self.chunks],
        }

    def _resume(self) -> None:
        ck = self.checkpointer
        if ck is None:
            return
        extra = self._extra_state()
        resumed = ck.maybe_resume(self.chunks, self.optimizer, extra)
        if resumed is not None:
            step, consumed = resumed
            if len(extra.get("micro_steps", [])) == len(self.chunks):  # same chunking: same dropout stream
                for chunk, micro_step in zip(self.chunks, extra["micro_steps"]):
                    chunk.micro_step = int(micro_step)
            self.state = TrainState(int(step), int(consumed))
            if self.is_logger:
                print(f"resumed at step {step} (consumed_samples {consumed})", file=sys.stderr)
        if self.is_logger:
            # A launch's explicit train.resume is spent: the next attempt resumes from `latest`.
            from training.contract.rundir.events import current_attempt, current_job_id
            from training.contract.rundir.resume_request import mark_consumed

            mark_consumed(self.run_dir, self.state.step, current_attempt(), current_job_id())

    def _boundary(self) -> str:
        """After a step: save when due (or at the end, or when stopping); returns the stop reason or ""."""
        step, last = self.state.step, self.state.step >= self.cfg.train.steps
        ck = self.checkpointer
        if ck is None:  # train.checkpointing=false: nothing to save, but a stop signal still ends the run here
            return "" if last else (self.stop_rule.decide(step)[1] or "")
        due, reason = self.stop_rule.decide(step)
        if due or reason or last:
            ck.save(
                step,
                self.chunks,
                self.optimizer,
                self._extra_state(),
                reason=reason or ("final" if last else "interval"),
            )
        if reason or last:
            ck.wait()
        return reason or ""

    def _pace(self, step_start: float) -> None:
        """Step pacing (training/run/pacing.py): wait out the rest of the step before its boundary, in short slices,
        so that a stop signal ends the wait (the boundary right after saves and stops as it would without the wait).
        The wait is outside the step timer: step_time_s, tokens/s and MFU are the step's own."""
        until = step_start + self.pace_s
        while signals.received() is None:
            left = until - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(left, PACE_SLICE_S))

    def _stop_for_health(self, watch, nodes: list[str]) -> int:
        """A complete checkpoint, then the exit code that excludes the unhealthy nodes (observe/straggler.py)."""
        if self.checkpointer is not None:
            self.checkpointer.save(self.state.step, self.chunks, self.optimizer, self._extra_state(), reason="health")
            self.checkpointer.wait()
        return watch.stop_code(nodes)

    # -- the loop --
    def train_step(
        self, micro: list[tuple[torch.Tensor, torch.Tensor]] | None = None, defer_param_gather: bool = False
    ) -> tuple[float, StepResult, float]:
        """One optimizer step over the global batch (`micro`: this step's micro-batches when the caller
        assembled them ahead, as `run` does outside its step timer); returns (global loss, step result, lr).
        defer_param_gather (zero=1): the updated shards' all-gather may still run when this returns, and
        completes during the next forward (`run` passes it; the optimizer's state_dict waits for it)."""
        lr = lr_at(self.state.step, self.cfg.train)
        if micro is None:
            micro = self.sampler.micro_batches(self.state.consumed_samples)
        # Knowing the micro-batch count lets each dp bucket's reduction start during backward.
        self.optimizer.zero_grad(len(micro))
        if self.cfg.model.num_experts > 0:
            reset_moe_stats(self.chunks)  # this step's routing figures (moe_metrics)
        for c in self.chunks:
            c.train()
        before = [int(getattr(c, "micro_step", 0)) for c in self.chunks]  # the NaN probe replays these masks
        if self.checkpointer is not None and self.cfg.parallel.zero >= 3:
            # zero=3 releases parameter storage during the forward: an async save's host copy must be done.
            self.checkpointer.wait_staged()
        busy = BusyTimer(self.mesh.device)  # CUDA: events on the compute stream (perf_counter returns early)
        busy.start()
        local = self.schedule.forward_backward(micro)
        busy.stop()
        # This rank's own work, without the optimizer's reduction: what the straggler check compares.
        self.compute_s = busy.seconds()
        loss = self._global_loss(local)
        if not math.isfinite(loss) and self.cfg.train.nan_probe:
            from training.observe.nan_probe import probe_nonfinite

            probe_nonfinite(self, micro, before, loss)  # every rank: the loss is global
        if self.checkpointer is not None:  # an async save's host copy must be complete before the step
            self.checkpointer.wait_staged()  # changes the parameters and the optimizer state
        result = self.optimizer.step(lr, loss_finite=math.isfinite(loss), defer_param_gather=defer_param_gather)
        # The data position advances even on a skipped step (the batch was consumed), like Megatron.
        self.state.step += 1
        self.state.consumed_samples += self.cfg.parallel.global_batch
        return loss, result, lr

    def evaluate(self) -> float:
        """Mean loss over train.eval_iters global batches of held-out data (no grads, dropout off); every rank
        takes part and gets the value. Touches no state of the run, so resume stays exact."""
        m = self.cfg.train.eval_iters
        for c in self.chunks:
            c.eval()
        total = 0.0
        try:
            for k in range(m):
                micro = self.eval_sampler.micro_batches(k * self.cfg.parallel.global_batch)
                total += self._global_loss(self.schedule.forward_only(micro))
        finally:
            for c in self.chunks:
                c.train()
        return total / m

    def eval_due(self, step: int) -> bool:
        """train.eval_every measures the held-out loss after `step` (every N steps, and after the last step)."""
        every = self.cfg.train.eval_every
        return self.eval_sampler is not None and (step % every == 0 or step == self.cfg.train.steps)

    def run(self) -> int:
        """Train from the resumed step to train.steps or to a stop; returns the exit code (EXIT_OK, EXIT_STOPPED,
        or the health watch's)."""
        if self.checkpointer is None:
            # Without a checkpointer a stop still ends the run (_boundary). Here, not when the trainer is built:
            # a process that only builds one (bench/saved_bytes.py) keeps SIGTERM's default.
            install_signals()
        self._resume()
        startup.mark("resumed")  # also on a fresh start: the checkpoint lookup found nothing to load
        totals = Totals(self.cfg.train.steps)
        observers, watch = build_observers(self, totals)
        startup.mark("observers")
        exit_code, first = EXIT_OK, True
        while self.state.step < self.cfg.train.steps:
            # Batch assembly is the data loader's work, ahead of the step (outside the step timer).
            micro = self.sampler.micro_batches(self.state.consumed_samples)
            startup.mark("first_batch")  # a no-op after the first step
            started, record = self._observed_step(micro, observers, first)
            first = False
            for observer in observers:
                observer.after_step(record.step, record)
            unhealthy = watch.requeue_nodes if self.state.step < self.cfg.train.steps else []
            if unhealthy:  # cluster.health.action=requeue: checkpoint, then leave so the node is excluded
                exit_code = self._stop_for_health(watch, unhealthy)
                break
            self._pace(started)
            if self._boundary():
                exit_code = EXIT_STOPPED  # a complete checkpoint was written: the launcher may requeue
                break
        self._finish(observers)
        self.losses = totals.losses
        self.summary = self._summarise(totals, exit_code)
        return exit_code

    def _observed_step(self, micro, observers: list[Observer], first: bool) -> tuple[float, StepRecord]:
        """One training step between the observers' before_step and its record; timed with the device
        synchronised on both sides. Returns the step's start (perf_counter) and the record."""
        cuda = self.mesh.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        for observer in observers:
            observer.before_step(self.state.step + 1)
        t0 = time.perf_counter()
        loss, res, lr = self.train_step(micro, defer_param_gather=True)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if first and cuda:
            # The first step allocates the optimizer state and the allocator's caches: its transient peak
            # is no training step's, and the activations check compares the steady one.
            torch.cuda.reset_peak_memory_stats(self.mesh.device)
        return t0, self._record(loss, res, lr, dt, first)

    def _record(self, loss: float, res: StepResult, lr: float, dt: float, first: bool) -> StepRecord:
        step = self.state.step
        # This attempt's first step compiled the layers (forward and backward): said once.
        compile_s = self.compile_clock.seconds if self.compile_clock is not None and first else None
        eval_due = self.eval_due(step)
        # The same on every rank: the step, the agreed skip, the evaluation and the first step decide it.
        logged = step % max(1, self.cfg.train.log_every) == 0 or res.skipped or eval_due or compile_s is not None
        flops, peak = self.flops_per_step, self.peak_flops
        return StepRecord(
            step=step,
            loss=loss,
            grad_norm=res.grad_norm,
            lr=lr,
            step_time_s=dt,
            tokens_per_s=self.tokens_per_step / dt,
            consumed_samples=self.state.consumed_samples,
            compute_s=self.compute_s,
            first=first,
            logged=bool(logged),
            eval_due=eval_due,
            mfu=flops / dt / peak if flops and peak > 0 else None,
            loss_scale=res.loss_scale,
            skipped=res.reason if res.skipped else None,
            compile_s=compile_s,
            schedule=self.schedule.metrics() if logged and self.is_logger else {},
        )

    def _finish(self, observers: list[Observer]) -> None:
        if self.compile_clock is not None:
            self.compile_clock.close()
        signals.ignore()  # the final checkpoint is complete: a late Slurm signal must not kill this rank
        # Whoever reads the model after the run sees the last update (zero=3: its shards are the weights;
        # optimizer.finish_param_gather gathers them for a reader of the whole model).
        self.optimizer.finish_deferred_gather()
        for observer in reversed(observers):  # the last built first (TensorBoard's last events reach the file)
            observer.close()

    def _summarise(self, totals: Totals, exit_code: int) -> Summary:
        peak = torch.tensor(
            [peak_memory_bytes(self.mesh.device), peak_reserved_bytes(self.mesh.device)],
            dtype=torch.int64,
            device=self.mesh.device,
        )
        if comm.is_initialized() and comm.world_size() > 1:
            out = [torch.zeros_like(peak) for _ in range(comm.world_size())]
            comm.all_gather(out, peak)
        else:
            out = [peak]
        per_rank = [int(x[0].item()) for x in out]
        s = Summary(
            self.state.step,
            sum(totals.rates) / len(totals.rates) if totals.rates else 0.0,
            sum(totals.mfus) / len(totals.mfus) if totals.mfus else None,
            per_rank,
            totals.skipped,
            exit_code,
            [int(x[1].item()) for x in out],
        )
        fp8_peak = getattr(self.cfg.cluster, "peak_tflops_fp8", 0.0) * 1e12 * self.mesh.world_size
        if str(self.cfg.train.precision) == "fp8" and fp8_peak > 0 and s.mfu is not None:
            s.mfu_fp8 = s.mfu * self.peak_flops / fp8_peak
        if self.is_logger:
            mem = self.optimizer.memory_report()
            mfu_txt = f"{100 * s.mfu:.2f}%" if s.mfu is not None else "n/a"
            if s.mfu_fp8 is not None:  # both labelled: the bf16 peak's and the FP8 peak's
                mfu_txt = f"{mfu_txt} of the bf16 peak, {100 * s.mfu_fp8:.2f}% of the FP8 peak"
            print(
                f"summary: {s.steps} steps, {s.tokens_per_s:,.0f} tokens/s, MFU {mfu_txt} "
                f"(peak {self.peak_flops / 1e12:.3f} TFLOP/s over {self.mesh.world_size} ranks), "
                f"skipped {totals.skipped}",
                file=sys.stderr,
            )
            print("peak memory per rank (MiB): " + ", ".join(f"{b / 2**20:.0f}" for b in per_rank), file=sys.stderr)
            print(
                f"rank 0 model states (bytes): weights {mem['weights']}, grads {mem['grads']}, "
                f"optimizer {mem['optimizer']}",
                file=sys.stderr,
            )
            if "host_offload" in mem:  # parallel.offload: where the optimizer state went
                print(
                    f"rank 0 offloaded optimizer state (bytes): host {mem['host_offload']}, nvme {mem['nvme_offload']}",
                    file=sys.stderr,
                )
            from training.contract.rundir.files import write_atomic  # never through a link

            write_atomic(RunPaths(self.run_dir).summary, json.dumps(asdict(s), indent=2))
        return s
