"""`Loop`: what every kind of training's loop shares, over a run's assembled parts.

One optimizer step is described once, by the step contract (train/step.py)::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens, terms, expert_load)

``EagerStep`` implements it with ordinary autograd; the Graph Trainer (graph/compile.py
``GraphStep``) provides another implementation of the same contract, and the run's objective
(train/objective.py) says what the loss is. The parts are built before the loop, by
components/build.py (`Components`), and handed to it (loops/__init__.py `assemble`); a loop only
drives them: the data, the schedule, validation, metrics rows (loops/metrics_row.py), checkpoints
(loops/saving.py), replica groups (loops/replica_groups.py) and signals.

A kind's loop (loops/pretrain.py, preference.py, grpo.py) says what differs: its metrics terms and,
for GRPO, how a step gets its batch; validation is the objective's (`validation_sums`).

Under ``torchrun`` every rank runs the same loop. Parameters are SimpleFSDP DTensors (see
``parallel/simple_fsdp.py``), each data-parallel rank reads its own rows of the global batch, and
loss, token counts and validation are reduced across ranks; only rank 0 logs and prints.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from titan_tpu.components.build import Components
from titan_tpu.data.batch import Batch, as_batch
from titan_tpu.data.tokenizer import tokenizer_files
from titan_tpu.evaluation.during_training import TaskEvaluation
from titan_tpu.loops.metrics_row import MetricsWindow, metrics_row
from titan_tpu.loops.replica_groups import ReplicaGroups
from titan_tpu.loops.routing import Routing, balancing_advice
from titan_tpu.loops.saving import Saving
from titan_tpu.models.common.scan import padding_params
from titan_tpu.train.goodput import GoodputLedger, describe, start_time
from titan_tpu.train.metrics import MetricsLogger
from titan_tpu.train.optim import lr_at
from titan_tpu.train.profiling import DATA_REGION, StepProfiler
from titan_tpu.train.signals import GracefulShutdown
from titan_tpu.train.step import StepResult, all_reduce_sum
from titan_tpu.train.trackers import build_trackers

__all__ = ["Loop"]


class Loop:
    """The loop over a run's `Components`; a kind's loop subclasses it (module docstring)."""

    def __init__(self, components: Components):
        self.components = components
        self.cfg = components.cfg
        self.step = 0
        self.data_seconds = 0.0  # time spent waiting for batches, all steps of this process
        self.logger: MetricsLogger | None = None  # rank 0's, while train() runs
        self.tracker_state: dict[str, str] = {}  # from the checkpoint: the trackers' run ids
        self.goodput: GoodputLedger | None = None  # rank 0's, while train() runs
        self.saving = Saving(self)
        self.compile_stats = dict(components.compile_stats)  # capture and compile seconds, with the first row
        self.evaluation: TaskEvaluation | None = None  # the [evaluation] tasks, loaded before the first step
        # An MoE model's routing in the metrics rows, and its warning (loops/routing.py).
        self.routing = Routing(blocks=components.model.expert_load_layers(),
                               warn_above=self.cfg.metrics.expert_load_warning, advice=balancing_advice(self.cfg.model))

    def log(self, message: str) -> None:
        self.components.log(message)

    # ------------------------------------------------------------------------------------------
    # what a kind's loop says

    # The objective's terms the console line shows beyond the standard ones (train/metrics.py);
    # None shows every term. All of them go to metrics.jsonl and the trackers either way.
    console_keys: tuple[str, ...] | None = None

    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        """What the step's objective adds to a metrics row."""
        raise NotImplementedError

    @torch.no_grad()
    def validate(self) -> float:
        """The objective's validation loss over the held-out batches on all ranks, defined as its step
        loss is (train/objective.py `validation_sums`, `validation_loss`)."""
        parts = self.components
        assert parts.val_loader is not None
        objective, device = parts.objective, parts.backend.device
        # fp32, not fp64: TPUs have no fast fp64, and a few batches' sums fit fp32 well enough.
        sums = torch.zeros(0, device=device)
        for batch in parts.val_loader.val_batches(self.cfg.validation.steps):
            batch = as_batch(batch).to(device)
            part = objective.validation_sums(batch, parts.step_fn.evaluate(batch)).to(device)
            sums = part if not sums.numel() else sums + part
        all_reduce_sum(sums)
        return objective.validation_loss(sums).item()

    def train_step(self) -> StepResult:
        self.step += 1
        return self.components.step_fn(self._micro_batches(), self.lr(self.step))

    # ------------------------------------------------------------------------------------------
    # state

    def state_dict(self) -> dict:
        trackers = self.logger.state_dict() if self.logger is not None else self.tracker_state
        return self.components.state_dict(step=self.step, trackers=trackers)

    def load_checkpoint(self, path: Path, *, local: bool = False) -> None:
        """Resume everything from a checkpoint (local: a local tier), resharding it onto this run's
        ranks if needed."""
        rest = self.components.load_checkpoint(path, local=local)
        self.step = rest["step"]
        self.tracker_state = rest.get("trackers") or {}
        changed = _what_changed(rest.get("global_batch"), self.components.global_batch())
        if changed:
            self.log(changed)

    # ------------------------------------------------------------------------------------------
    # the pieces of a step

    def lr(self, step: int) -> float:
        s, t = self.cfg.lr_scheduler, self.cfg.training
        return lr_at(step, base_lr=self.cfg.optimizer.lr, warmup_steps=self.components.warmup_steps,
                     total_steps=t.steps, decay_ratio=s.decay_ratio, decay_type=s.decay_type,
                     min_lr_ratio=s.min_lr_ratio)

    def _micro_batches(self) -> list[Batch]:
        device = self.components.backend.device
        start = time.perf_counter()
        with record_function(DATA_REGION):
            batches = [as_batch(self.components.train_loader.next_batch()).to(device, non_blocking=True)
                       for _ in range(self.components.run.grad_accum_steps)]
        self.data_seconds += time.perf_counter() - start
        return batches

    def timed(self, bucket: str, fn):
        """fn(), its seconds counted in goodput's `bucket` (rank 0)."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.count_time(bucket, time.perf_counter() - start)

    def count_time(self, bucket: str, seconds: float) -> None:
        if self.goodput is not None:
            self.goodput.add(bucket, seconds)

    # ------------------------------------------------------------------------------------------
    # the loop

    def train(self) -> dict:
        """Run to ``training.steps`` (or until SIGTERM/SIGINT); returns a summary with the paths of
        the run's outputs."""
        try:
            self._start()
            replica_groups = ReplicaGroups.join(self)  # first: a lighthouse that does not answer leaves nothing open
            self.logger = self._open_logger() if self.components.is_main else None
            profiler = self._profiler()
            with GracefulShutdown() as shutdown:
                stopped_by, last_val = self._steps(shutdown, replica_groups, profiler)
        except BaseException:
            self.components.release_lock()  # an error that ends the run is no killed run for the next start
            raise
        return self._finish(stopped_by=stopped_by, last_val=last_val, replica_groups=replica_groups,
                            profiler=profiler)

    def _start(self) -> None:
        """Before the first step: the run's directory, the resume, the goodput ledger, the grace
        budget, and one line on the model, the mesh and the MFU peak."""
        parts, cfg = self.components, self.cfg
        if parts.is_main:
            self._write_run_files()
        load_start = time.perf_counter()
        from_local_tier = self.saving.maybe_resume()
        load_seconds = time.perf_counter() - load_start
        if parts.is_main:
            self.goodput = GoodputLedger(parts.run_dir, step=self.step, start=start_time(parts.created_at))
            self.goodput.add("checkpoint_load", load_seconds)
            self.goodput.add("compile", sum(self.compile_stats.values()))
        if from_local_tier:  # the persistent tier catches up before training goes on
            self.timed("checkpoint_save", self.saving.save_checkpoint)
        if parts.local_tier is not None and cfg.checkpoint.grace_seconds > 0:
            self.saving.check_grace_budget()
        if cfg.evaluation.tasks:
            self.evaluation = TaskEvaluation(parts)
        parts.backend.peak_flops(parts.compute_dtype)  # measured (CPU) before the loop, named in the line below
        if parts.warmup_steps < cfg.lr_scheduler.warmup_steps:
            self.log(f"note: lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is longer than training.steps "
                     f"= {cfg.training.steps}; warming up over {parts.warmup_steps} steps instead")
        self.log(_model_line(parts))

    def _write_run_files(self) -> None:
        """config.json and the tokenizer's files (its chat template too) in the run's directory: they
        travel with the run, e.g. into an HF export."""
        parts = self.components
        parts.run_dir.mkdir(parents=True, exist_ok=True)
        (parts.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        if parts.tokenizer.path is not None:
            for source in tokenizer_files(parts.tokenizer.path):
                target = parts.run_dir / ("tokenizer.json" if source == parts.tokenizer.path else source.name)
                if source.resolve() != target.resolve():
                    shutil.copyfile(source, target)

    def _steps(self, shutdown: GracefulShutdown, replica_groups: ReplicaGroups | None,
               profiler: StepProfiler | None) -> tuple[str | None, float | None]:
        """The steps to training.steps or a signal: (what stopped them, the last validation loss)."""
        cfg, parts = self.cfg, self.components
        window = MetricsWindow(data_start=self.data_seconds)
        last_val, steps_here = None, 0  # steps_here: taken by this process
        parts.backend.reset_peak_memory()
        if self.goodput is not None:
            self.goodput.begin_loop()
        while self.step < cfg.training.steps:
            if replica_groups is not None:
                replica_groups.quorum()
            if profiler is not None:
                profiler.before_step(self.step + 1)
            start, data_before = time.perf_counter(), self.data_seconds
            result = self.train_step()
            seconds = time.perf_counter() - start
            if not result.committed:
                replica_groups.drop_step(seconds)
                continue
            steps_here += 1
            if steps_here == 2:
                self.saving.check_step_in_flight(seconds)
            if self.goodput is not None:
                self.goodput.step(self.step, seconds=seconds, data_seconds=self.data_seconds - data_before)
            window.add(result, seconds)
            if profiler is not None:
                profiler.after_step(self.step)
            done = self.step == cfg.training.steps
            if self.step % cfg.metrics.log_freq == 0 or done or self.step == 1:
                self._log_row(result, window, replica_groups)
                window = MetricsWindow(data_start=self.data_seconds)
            if parts.val_loader is not None and (self.step % cfg.validation.freq == 0 or done):
                last_val = self.timed("validation", self.validate)
                if self.logger is not None:
                    self.logger.log(self.step, {"val_loss": last_val})
            if self.evaluation is not None and self.evaluation.due(self.step, done=done):
                scores = self.timed("validation", lambda: self.evaluation.run(self.step))
                if self.logger is not None and scores:
                    self.logger.log(self.step, scores)
            stop = shutdown.should_stop()  # agreed by all ranks, so all of them save together
            self.saving.after_step(done=done, stop=stop, since_signal=shutdown.seconds_since_signal() if stop else 0.0)
            if stop:
                return shutdown.signal_name or "a signal on another rank", last_val
        return None, last_val

    def _log_row(self, result: StepResult, window: MetricsWindow, replica_groups: ReplicaGroups | None) -> None:
        row = metrics_row(self, result, window)
        row.update(self.compile_stats)
        if replica_groups is not None:  # the replica groups in the gradient average of this step
            row["replica_groups"] = replica_groups.members
        self.compile_stats = {}  # once per process
        if self.goodput is not None:  # the ledger first: a kill between the two loses no step
            self.goodput.flush()
            row["goodput"] = self.goodput.totals()["goodput"]
        if self.logger is not None:
            self.logger.log(self.step, row)

    def _finish(self, *, stopped_by: str | None, last_val: float | None, replica_groups: ReplicaGroups | None,
                profiler: StepProfiler | None) -> dict:
        """After the last step: everything the loop opened closed, and the run's summary."""
        parts, cfg = self.components, self.cfg
        if replica_groups is not None:
            replica_groups.close()
        self.saving.close(finished=stopped_by is None)
        if profiler is not None:
            profiler.close()
        goodput = None
        if self.goodput is not None:
            self.goodput.flush()
            goodput = self.goodput.totals()
            self.goodput = None
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        parts.release_lock()
        latest = parts.checkpointer.latest() if cfg.checkpoint.enabled else None
        summary = {"step": self.step, "metrics": str(parts.run_dir / "metrics.jsonl"),
                   "checkpoint": str(latest) if latest else None, "val_loss": last_val, "stopped_by": stopped_by,
                   "save_failures": self.saving.failures, "goodput": goodput}
        if stopped_by:
            self.log(f"stopped by {stopped_by} after step {self.step}; restart the same command to resume")
        if goodput is not None:
            self.log(describe(goodput))
        self.log(f"done: step {self.step}; metrics: {summary['metrics']}; checkpoint: {summary['checkpoint']}")
        return summary

    def _open_logger(self) -> MetricsLogger:
        """Rank 0's metrics: metrics.jsonl, the console and the trackers, continuing the trackers'
        runs of the checkpoint this run resumed from (the W&B run id)."""
        m = self.cfg.metrics
        names = [name for name in m.trackers if m.tensorboard or name != "tensorboard"]
        trackers = build_trackers(names, run_dir=self.components.run_dir, state=self.tracker_state,
                                  project=m.wandb_project, name=self.cfg.job.name, config=self.cfg.to_dict())
        return MetricsLogger(output_dir=self.components.run_dir, tensorboard=False, console=m.console,
                             total_steps=self.cfg.training.steps, trackers=trackers, resumed_step=self.step,
                             console_keys=self.console_keys)

    def _profiler(self) -> StepProfiler | None:
        p, parts = self.cfg.profiling, self.components
        if not p.enabled:
            return None
        return StepProfiler(start_step=p.start_step, active_steps=p.active_steps,
                            trace_dir=Path(p.trace_dir) if p.trace_dir else parts.run_dir / "profile", rank=parts.rank,
                            device_type=parts.backend.device.type, memory_snapshot=p.memory_snapshot, log=self.log)


def _model_line(parts: Components) -> str:
    """The model, its FLOPs per token, the mesh and the MFU peak, in one line before the first step."""
    dims, t = parts.parallel_dims, parts.cfg.training
    return (f"model {parts.spec.label}: {_num_params(parts.model):,} params{_trained_words(parts)}, "
            f"{parts.flops_per_token / 1e6:.1f} MFLOP/token at seq_len {t.seq_len}"
            f"{f' ({parts.flops_note})' if parts.flops_note else ''}; "
            f"{parts.world_size} rank(s), data parallel: {dims.mode}"
            f"{f', expert parallel: {dims.ep}' if dims.ep > 1 else ''}"
            f"{f', tensor parallel: {dims.tp}' if dims.tp > 1 else ''}"
            f"{f', context parallel: {dims.cp}' if dims.cp > 1 else ''}"
            f"{_pipeline_words(parts.run.pipeline)}; "
            f"MFU peak per device: {parts.backend.peak_description(parts.compute_dtype)}")


def _trained_words(parts: Components) -> str:
    """The model line's words for the parameters that train where not all of them do: LoRA's adapters
    (their rank and alpha), a vision-language model's frozen tower."""
    trained = sum(p.numel() for p in parts.model.parameters() if p.requires_grad) - padding_params(parts.model)
    if trained == _num_params(parts.model):
        return ""
    lora = parts.cfg.lora
    adapters = f", LoRA rank {lora.rank} alpha {lora.alpha:g}" if lora.enabled else ""
    return f" ({trained:,} of them train{adapters})"


def _pipeline_words(schedule) -> str:
    """The model line's words for pipeline stages (parallel/pipeline.py), "" without them."""
    if schedule is None:
        return ""
    circular = f", {schedule.repeats} chunks per stage" if schedule.repeats > 1 else ""
    padded = (f", {schedule.n_layers} layers padded to {schedule.rows} rows ({schedule.padding} identity rows, "
              f"{schedule.padding / schedule.rows:.1%} of a stage's work)" if schedule.padding else "")
    return f", pipeline: {schedule.stages} stages x {schedule.micro_batches} micro-batches{circular}{padded}"


def _what_changed(saved: dict | None, now: dict) -> str:
    """One line on a resume on another mesh: ranks, accumulation, the global batch (kept or not)."""
    if not saved or (saved["world_size"], saved["dp_size"], saved["grad_accum_steps"], saved["batch_size"]) == \
            (now["world_size"], now["dp_size"], now["grad_accum_steps"], now["batch_size"]):
        return ""
    kept = (f"the global batch stays {now['tokens']:,} tokens per step" if saved["tokens"] == now["tokens"] else
            f"warning: the global batch changes from {saved['tokens']:,} to {now['tokens']:,} tokens per step (set "
            f"training.global_batch_tokens = {saved['tokens']} to keep it)")
    return (f"resumed on another mesh: {saved['world_size']} -> {now['world_size']} ranks, data-parallel "
            f"{saved['dp_size']} -> {now['dp_size']}, micro-batches per step {saved['grad_accum_steps']} -> "
            f"{now['grad_accum_steps']} of {now['batch_size']} sequences; {kept}; the data position and the "
            "learning-rate schedule continue from the checkpoint's step")


def _num_params(model) -> int:
    """Parameter count of the whole model, also when parameters are sharded DTensors; a pipelined
    stack's padding rows (parallel/pipeline.py) are none of the model's."""
    return sum(p.numel() for p in model.parameters()) - padding_params(model)
