"""The training loop.

One optimizer step is described once, by the step contract (train/step.py)::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens)

``EagerStep`` implements it with ordinary autograd; the Graph Trainer (graph/compile.py
``GraphStep``) provides another implementation of the same contract, so the loop around it
(data, schedule, validation, metrics, checkpoints, signals) is shared; train/make_step.py picks
one from the config. What the trainer needs to know about the model (build, FLOPs, tokenizer,
weights from an HF directory) it asks the model spec (models/spec.py), never the model's name.

Under ``torchrun`` every rank runs this same loop. Parameters are SimpleFSDP DTensors (see
``parallel/simple_fsdp.py``), each data-parallel rank reads its own rows of the global batch, and
loss, token counts and validation are reduced across ranks; only rank 0 logs and prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from titan_tpu.config import Config, grad_accum_from_tokens
from titan_tpu.data.tokenizer import tokenizer_files
from titan_tpu.device import Backend, check_cpu_compute_dtype, get_backend
from titan_tpu.errors import RunError
from titan_tpu.model_contract import TrainableModel
from titan_tpu.models.lora import is_adapter_key
from titan_tpu.models.spec import build
from titan_tpu.parallel.gloo import use_single_thread_gloo
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, default_mixed_precision
from titan_tpu.run_setup import prepare_run
from titan_tpu.train.checkpoint import Checkpointer, CheckpointSaveError, load, rng_state, set_rng_state
from titan_tpu.train.make_step import make_step
from titan_tpu.train.metrics import MetricsLogger
from titan_tpu.train.optim import AdamW, lr_at
from titan_tpu.train.profiling import DATA_REGION, StepProfiler
from titan_tpu.train.run_lock import RunLock
from titan_tpu.train.signals import GracefulShutdown
from titan_tpu.train.step import IGNORE_INDEX, StepResult, all_reduce_sum, batch_loss
from titan_tpu.train.trackers import build_trackers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TITAN_TPU_CACHE") or Path.home() / ".cache" / "titan_tpu")


def init_distributed(backend: Backend) -> tuple[int, int]:
    """(rank, world size); joins the process group when launched by torchrun with WORLD_SIZE > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        use_single_thread_gloo()  # every gloo group, this one or later ones (docs/known-issues.md, 1d)
        dist.init_process_group(backend=backend.process_group_backend)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the body first (tokenizing, filling a cache), then the other ranks run it
    (finding the cache); every rank leaves together. A plain block on one process."""
    distributed = dist.is_initialized()
    is_main = not distributed or dist.get_rank() == 0
    if distributed and not is_main:
        dist.barrier()  # rank 0's turn
    yield
    if distributed and is_main:
        dist.barrier()  # the others' turn
    if distributed:
        dist.barrier()


class Trainer:
    def __init__(self, cfg: Config):
        from titan_tpu.data.build import build_loaders, prepare_data, uses_document_mask

        self.cfg = cfg
        setup = prepare_run(cfg)  # the config checked across its sections; the spec resolved once
        self.run_dir = cfg.run_dir
        t, p = cfg.training, cfg.parallelism
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.backend: Backend = get_backend(t.device)
        if self.backend.name == "cpu":  # training.device auto that became the CPU (config checks cpu)
            check_cpu_compute_dtype(cfg.model.dtype)
        self.rank, self.world_size = init_distributed(self.backend)
        self.is_main = self.rank == 0
        self.parallel_dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
                                          world_size=self.world_size, ep=p.ep, tp=p.tp, cp=p.cp)
        self.mesh = self.parallel_dims.build_mesh(self.backend.device.type)
        self.expert_mesh = self.parallel_dims.build_expert_mesh(self.backend.device.type)
        dp_rank, self.dp_size = dp_rank_and_size(self.mesh)
        if t.global_batch_tokens:  # accumulation from the global batch, now that the mesh is known
            t.grad_accum_steps = grad_accum_from_tokens(t, self.dp_size)
            self.log(f"training.global_batch_tokens = {t.global_batch_tokens}: {t.grad_accum_steps} micro-batches of "
                     f"{t.batch_size} x {t.seq_len} tokens per step on each of {self.dp_size} data-parallel ranks")
        self.run_lock = self._lock_output_dir()
        torch.manual_seed(t.seed)
        # A kernel that cannot run on this device is a one-line error now, not at the first step.
        sources = setup.sources
        self.document_mask = uses_document_mask(cfg.data, sources)
        if any(s.format == "chat" for s in sources):  # labels IGNORE_INDEX outside the assistant's turns
            cfg.kernels = cfg.kernels.for_ignored_labels(self.backend.device.type)
        cfg.kernels.check_device(self.backend.device.type, documents=self.document_mask)

        self.spec = setup.spec  # what the trainer asks about the model (models/spec.py)
        self.base_weights = setup.base_weights  # recorded in checkpoints: the base a LoRA export names
        self.model_args = self.spec.args
        # Rank 0 tokenizes (or finds the cache) first; the others then only read the cache.
        with main_process_first():
            prepared = prepare_data(cfg.data, sources, vocab_size=self.model_args.vocab_size,
                                    tokenizer_path=setup.tokenizer_path,
                                    cache_dir=cfg.data.cache_dir or default_cache_dir(), log=self.log)
        self.tokenizer = prepared.tokenizer
        self.train_loader, self.val_loader = build_loaders(
            cfg.data, prepared, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed, dp_rank=dp_rank,
            dp_size=self.dp_size, validation=cfg.validation.enabled, log=self.log)

        self.model = self._build_model()
        # The trained parameters: all of them, or under LoRA the adapters (the base is frozen).
        trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = AdamW.from_config(trained, cfg.optimizer,
                                           layer_stacked=self.model.stacked_parameter_names())
        # compile_stats: capture/compile seconds, logged with the first row
        self.step_fn, self.compile_stats = make_step(cfg, self.model, self.optimizer, backend=self.backend,
                                                     world_size=self.world_size, dp_size=self.dp_size,
                                                     documents=self.document_mask, log=self.log)
        self.step = 0
        self.data_seconds = 0.0  # time spent waiting for batches, all steps of this process
        self.logger: MetricsLogger | None = None  # rank 0's, while train() runs
        self.tracker_state: dict[str, str] = {}  # from the checkpoint: the trackers' run ids
        self.checkpointer = Checkpointer.from_config(cfg.checkpoint, self.run_dir, log=self.log)
        self.warmup_steps = setup.warmup_steps
        self.save_failures = 0  # checkpoint saves that failed under checkpoint.on_save_error = warn
        self.flops_per_token, self.flops_note = self.spec.flops_per_token(self.model, t.seq_len)

    def _lock_output_dir(self) -> RunLock | None:
        """Rank 0 locks output_dir for the run's life (train/run_lock.py); every rank stops if it is taken."""
        lock, error = None, None
        if self.is_main:
            try:
                lock = RunLock(self.run_dir, log=self.log).acquire()
            except RunError as e:
                error = e
        if dist.is_initialized():
            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            raise error
        return lock

    def _build_model(self) -> TrainableModel:
        """The spec's model (models/spec.py `build`): materialised and initialised piece by piece
        (sharded when there is a mesh): fp32 master parameters on one device as on many,
        computed in model.dtype, gradients reduced in parallelism.reduce_dtype when sharded
        (docs/mixed_precision.md)."""
        return build(self.spec, self.cfg, device=self.backend.device, seed=self.cfg.training.seed, mesh=self.mesh,
                     parallel_dims=self.parallel_dims, expert_mesh=self.expert_mesh, mp=self.mixed_precision,
                     documents=self.document_mask, reshard_after_forward=self._reshard_after_forward(), log=self.log)

    def _reshard_after_forward(self) -> bool:
        """parallelism.reshard_after_forward as this run applies it: auto is decided by the planner
        on rank 0 (planner.with_reshard_resolved: re-shard only where keeping the gathered block
        weights would not fit) and shared, so every rank runs the same collectives. Where the
        planner has no terms for the run (an hf model, an unnamed GPU) auto re-shards."""
        value = self.cfg.parallelism.reshard_after_forward
        if value != "auto" or self.mesh is None:
            return value == "true"
        decision = [None, None]  # (re-shard, why), filled on rank 0
        if self.is_main:
            from titan_tpu.plan.planner import default_hardware, with_reshard_resolved

            try:
                hardware, _ = default_hardware(self.cfg, measure=False)
                chips = max(self.world_size // hardware.devices_per_chip, 1)
                resolved = with_reshard_resolved(self.cfg, hardware, chips=chips, measure=False)
                decision = [resolved.parallelism.reshard_after_forward == "true",
                            "the plan that keeps them does not fit" if resolved.parallelism.reshard_after_forward
                            == "true" else "the plan that keeps them fits"]
            except ValueError as e:
                decision = [True, f"the planner cannot plan this run ({str(e).split(';')[0]})"]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        reshard, why = decision
        self.log(f"parallelism.reshard_after_forward auto: {str(reshard).lower()} ({why})")
        return reshard

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.cfg.model.dtype == "auto":
            return default_mixed_precision(self.backend.device.type).param_dtype
        return DTYPES[self.cfg.model.dtype]

    @property
    def mixed_precision(self) -> MixedPrecision:
        return MixedPrecision(param_dtype=self.compute_dtype, reduce_dtype=DTYPES[self.cfg.parallelism.reduce_dtype])

    def log(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    # ------------------------------------------------------------------------------------------
    # state

    def _optimizer_state_per_layer(self) -> dict:
        # Moments by parameter name in the checkpoint's per-layer layout (views into the stacked
        # moments under scan_layers), like model.state_dict(): scanned and unrolled runs resume
        # from each other's checkpoints.
        sd = self.optimizer.state_dict()
        return {**sd, "exp_avg": self.model.to_per_layer(sd["exp_avg"]),
                "exp_avg_sq": self.model.to_per_layer(sd["exp_avg_sq"])}

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self._optimizer_state_per_layer(),
            "data": self.train_loader.state_dict(),
            "rng": rng_state(),
            "model_name": self.spec.name,
            "model_args": dataclasses.asdict(self.model_args),
            "trackers": self.logger.state_dict() if self.logger is not None else self.tracker_state,
            # What convert needs to export the adapters (peft) or merge them (HF).
            "lora": dataclasses.asdict(self.cfg.lora) if self.cfg.lora.enabled else None,
            "base_weights": self.base_weights,
        }

    def load_checkpoint(self, path: Path) -> None:
        """Resume everything from a checkpoint, resharding it onto this run's ranks if needed."""
        state = {"model": self.model.state_dict(), "optimizer": self._optimizer_state_per_layer(),
                 "model_name": self.spec.name, "model_args": dataclasses.asdict(self.model_args)}
        rest = load(path, state)  # fills the model's and optimizer's tensors in place
        loaded = state["optimizer"]
        self.optimizer.load_state_dict({**loaded, "exp_avg": self.model.from_per_layer(loaded["exp_avg"]),
                                        "exp_avg_sq": self.model.from_per_layer(loaded["exp_avg_sq"])})
        self.train_loader.load_state_dict(rest["data"])
        if rest["rng"] is not None:  # None when the checkpoint came from another number of ranks
            set_rng_state(rest["rng"])
        self.step = rest["step"]
        self.tracker_state = rest.get("trackers") or {}

    def maybe_resume(self) -> None:
        if not self.cfg.checkpoint.resume:
            return
        latest = self.checkpointer.latest()
        if latest is not None:
            self.load_checkpoint(latest)
            self.log(f"resumed from {latest} at step {self.step}")
        elif self.cfg.checkpoint.initial_load_path:
            self.load_initial_weights(self.cfg.checkpoint.initial_load_path)

    @torch.no_grad()
    def load_initial_weights(self, path: str | Path) -> None:
        """Start from the weights of a checkpoint or a Hugging Face directory (fine-tuning)."""
        from titan_tpu.convert import resolve_checkpoint

        path = Path(path)
        if (path / "config.json").is_file():  # a Hugging Face directory: the spec knows its layout
            self.spec.load_hf_weights(self.model, path)
        else:  # a training checkpoint: DCP loads (and shards) it
            # The base weights: a checkpoint of a full run has no adapters (LoRA's start at init).
            base = {k: v for k, v in self.model.state_dict().items() if not is_adapter_key(k)}
            load(resolve_checkpoint(path), {"model": base})
        self.log(f"initial weights loaded from {path}")

    def save_checkpoint(self) -> Path | None:
        """Save this step's checkpoint; None if it failed under checkpoint.on_save_error = warn."""
        return self._checkpoint_io(lambda: self.checkpointer.save(self.step, self.state_dict()))

    def _checkpoint_io(self, fn):
        """Run a checkpointer call; a failed save stops the run (raises) or, under on_save_error =
        warn, is logged and training goes on (the next interval tries again)."""
        try:
            return fn()
        except CheckpointSaveError as e:
            if self.cfg.checkpoint.on_save_error == "stop":
                raise
            self.save_failures += 1
            self.log(f"warning: {e}; training goes on (checkpoint.on_save_error = warn) and the next save is "
                     f"tried at step {self._next_save_step()}")
            return None

    def _next_save_step(self) -> int:
        interval, steps = self.cfg.checkpoint.interval, self.cfg.training.steps
        return min((self.step // interval + 1) * interval, steps) if self.step < steps else steps

    # ------------------------------------------------------------------------------------------
    # loop

    def lr(self, step: int) -> float:
        s, t = self.cfg.lr_scheduler, self.cfg.training
        return lr_at(step, base_lr=self.cfg.optimizer.lr, warmup_steps=self.warmup_steps, total_steps=t.steps,
                     decay_ratio=s.decay_ratio, decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio)

    def _micro_batches(self) -> list[tuple[torch.Tensor, ...]]:
        device = self.backend.device
        start = time.perf_counter()
        with record_function(DATA_REGION):
            batches = [tuple(t.to(device, non_blocking=True) for t in self.train_loader.next_batch())
                       for _ in range(self.cfg.training.grad_accum_steps)]
        self.data_seconds += time.perf_counter() - start
        return batches

    def train_step(self) -> StepResult:
        self.step += 1
        return self.step_fn(self._micro_batches(), self.lr(self.step))

    @torch.no_grad()
    def validate(self) -> float:
        assert self.val_loader is not None
        self.model.eval()
        # fp32, not fp64: TPUs have no fast fp64, and a few batches' sums fit fp32 well enough.
        totals = torch.zeros(2, device=self.backend.device)  # loss sum, tokens
        for batch in self.val_loader.val_batches(self.cfg.validation.steps):
            batch = tuple(t.to(self.backend.device) for t in batch)
            totals[0] += batch_loss(self.model, batch).ce_sum
            totals[1] += (batch[1] != IGNORE_INDEX).sum()
        self.model.train()
        all_reduce_sum(totals)
        return (totals[0] / totals[1]).item()

    def _open_logger(self) -> MetricsLogger:
        """Rank 0's metrics: metrics.jsonl, the console and the trackers, continuing the trackers'
        runs of the checkpoint this run resumed from (the W&B run id)."""
        m = self.cfg.metrics
        names = [name for name in m.trackers if m.tensorboard or name != "tensorboard"]
        trackers = build_trackers(names, run_dir=self.run_dir, state=self.tracker_state, project=m.wandb_project,
                                  name=self.cfg.job.name, config=self.cfg.to_dict())
        return MetricsLogger(output_dir=self.run_dir, tensorboard=False, console=m.console,
                             total_steps=self.cfg.training.steps, trackers=trackers, resumed_step=self.step)

    def _profiler(self) -> StepProfiler | None:
        p = self.cfg.profiling
        if not p.enabled:
            return None
        return StepProfiler(start_step=p.start_step, active_steps=p.active_steps,
                            trace_dir=Path(p.trace_dir) if p.trace_dir else self.run_dir / "profile", rank=self.rank,
                            device_type=self.backend.device.type, memory_snapshot=p.memory_snapshot, log=self.log)

    def train(self) -> dict:
        """Run to ``training.steps`` (or until SIGTERM/SIGINT); returns a summary with the paths of
        the run's outputs."""
        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            if self.tokenizer.path is not None:  # travels with the run (its chat template too), e.g. into an HF export
                for source in tokenizer_files(self.tokenizer.path):
                    target = self.run_dir / ("tokenizer.json" if source == self.tokenizer.path else source.name)
                    if source.resolve() != target.resolve():
                        shutil.copyfile(source, target)
        self.maybe_resume()
        self.backend.peak_flops(self.compute_dtype)  # measured (CPU) before the loop, named in the line below
        if self.warmup_steps < cfg.lr_scheduler.warmup_steps:
            self.log(f"note: lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is longer than training.steps "
                     f"= {cfg.training.steps}; warming up over {self.warmup_steps} steps instead")
        self.log(f"model {self.spec.label}: {_num_params(self.model):,} params, "
                 f"{self.flops_per_token / 1e6:.1f} MFLOP/token at seq_len {cfg.training.seq_len}"
                 f"{f' ({self.flops_note})' if self.flops_note else ''}; "
                 f"{self.world_size} rank(s), data parallel: {self.parallel_dims.mode}"
                 f"{f', expert parallel: {self.parallel_dims.ep}' if self.parallel_dims.ep > 1 else ''}"
                 f"{f', tensor parallel: {self.parallel_dims.tp}' if self.parallel_dims.tp > 1 else ''}"
                 f"{f', context parallel: {self.parallel_dims.cp}' if self.parallel_dims.cp > 1 else ''}; "
                 f"MFU peak per device: {self.backend.peak_description(self.compute_dtype)}")

        last_val, stopped_by = None, None
        logger = self.logger = self._open_logger() if self.is_main else None
        profiler = self._profiler()
        with GracefulShutdown() as shutdown:
            # Throughput counts only time spent in training steps (each ends in a host sync when its
            # loss is read), not validation or checkpointing.
            window_tokens, window_seconds, window_steps, window_start_data = 0, 0.0, 0, self.data_seconds
            self.backend.reset_peak_memory()
            while self.step < cfg.training.steps:
                if profiler is not None:
                    profiler.before_step(self.step + 1)
                start = time.perf_counter()
                result = self.train_step()
                window_seconds += time.perf_counter() - start
                window_tokens += result.num_tokens
                window_steps += 1
                if profiler is not None:
                    profiler.after_step(self.step)
                done = self.step == cfg.training.steps
                if self.step % cfg.metrics.log_freq == 0 or done or self.step == 1:
                    tokens_per_s = window_tokens / window_seconds  # all ranks together
                    flops_per_device = tokens_per_s * self.flops_per_token / self.world_size
                    # Rank 0 alone may measure the CPU peak again (device.py Backend.mfu); None: unreliable.
                    mfu, note = self.backend.mfu(flops_per_device, self.compute_dtype) if self.is_main else (None, "")
                    if note:
                        self.log(note)
                    row = {"loss": result.loss, "lr": self.lr(self.step), "grad_norm": result.grad_norm,
                           "tokens_per_s": tokens_per_s, "tflops": flops_per_device / 1e12, "mfu": mfu,
                           "data_s": (self.data_seconds - window_start_data) / window_steps,
                           "step_s": window_seconds / window_steps, "time": time.time()}
                    row.update(_moe_metrics(result))
                    if result.mtp_loss is not None:  # multi-token prediction, unweighted
                        row["mtp_loss"] = result.mtp_loss
                    row.update(self.train_loader.metrics())  # mixtures: token share and epochs per source
                    row.update(self.backend.memory_stats())
                    row.update(self.compile_stats)
                    self.compile_stats = {}  # once per process
                    if logger is not None:
                        logger.log(self.step, row)
                    window_tokens, window_seconds, window_steps, window_start_data = 0, 0.0, 0, self.data_seconds
                if self.val_loader is not None and (self.step % cfg.validation.freq == 0 or done):
                    last_val = self.validate()
                    if logger is not None:
                        logger.log(self.step, {"val_loss": last_val})
                stop = shutdown.should_stop()  # agreed by all ranks, so all of them save together
                if cfg.checkpoint.enabled and (self.step % cfg.checkpoint.interval == 0 or done or stop):
                    if self.cfg.checkpoint.async_save:  # the previous async save's failure, if any, first
                        self._checkpoint_io(self.checkpointer.wait)
                    self.save_checkpoint()
                if stop:
                    stopped_by = shutdown.signal_name or "a signal on another rank"
                    break
        self._checkpoint_io(self.checkpointer.close)  # an async save must land before the process ends
        if profiler is not None:
            profiler.close()
        if logger is not None:
            logger.close()
            self.logger = None
        if self.run_lock is not None:
            self.run_lock.release()

        latest = self.checkpointer.latest() if cfg.checkpoint.enabled else None
        summary = {"step": self.step, "metrics": str(self.run_dir / "metrics.jsonl"),
                   "checkpoint": str(latest) if latest else None, "val_loss": last_val, "stopped_by": stopped_by,
                   "save_failures": self.save_failures}
        if stopped_by:
            self.log(f"stopped by {stopped_by} after step {self.step}; restart the same command to resume")
        self.log(f"done: step {self.step}; metrics: {summary['metrics']}; checkpoint: {summary['checkpoint']}")
        return summary


def _moe_metrics(result: StepResult) -> dict[str, float]:
    """Balancing loss and how evenly the experts were loaded in the step: max and min over layers
    and experts of tokens per expert / the mean (1.0 is perfectly even); {} for dense models."""
    if result.expert_load is None:
        return {}
    load_LE = result.expert_load.float()
    relative_LE = load_LE / load_LE.mean(dim=1, keepdim=True).clamp(min=1e-9)
    return {"aux_loss": result.aux_loss, "expert_load_max": relative_LE.max().item(),
            "expert_load_min": relative_LE.min().item()}


def _num_params(model: torch.nn.Module) -> int:
    """Parameter count of the whole model, also when parameters are sharded DTensors."""
    return sum(p.numel() for p in model.parameters())
