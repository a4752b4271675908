"""The pre-training and SFT loop.

One optimizer step is described once, by the step contract (train/step.py)::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens, terms, expert_load)

``EagerStep`` implements it with ordinary autograd; the Graph Trainer (graph/compile.py
``GraphStep``) provides another implementation of the same contract, and the run's objective
(train/objective.py) says what the loss is, so the loop around them (data, schedule, validation,
metrics, checkpoints, signals) is shared. The run's parts are built before the loop by
components/build.py (`Components`); this module only drives them. Other loops (loops/dpo.py) reuse
this one and change what differs.

Under ``torchrun`` every rank runs this same loop. Parameters are SimpleFSDP DTensors (see
``parallel/simple_fsdp.py``), each data-parallel rank reads its own rows of the global batch, and
loss, token counts and validation are reduced across ranks; only rank 0 logs and prints.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from titan_tpu.components.build import Components
from titan_tpu.config import Config
from titan_tpu.data.batch import Batch, as_batch
from titan_tpu.data.tokenizer import tokenizer_files
from titan_tpu.run_setup import prepare_run
from titan_tpu.train.checkpoint import CheckpointSaveError, checkpoint_step
from titan_tpu.train.goodput import GoodputLedger, describe, start_time
from titan_tpu.train.local_tier import LocalTierError
from titan_tpu.train.metrics import MetricsLogger
from titan_tpu.train.optim import lr_at
from titan_tpu.train.profiling import DATA_REGION, StepProfiler
from titan_tpu.train.signals import GracefulShutdown
from titan_tpu.train.step import IGNORE_INDEX, StepResult, all_reduce_sum
from titan_tpu.train.trackers import build_trackers

__all__ = ["Trainer"]


class Trainer:
    """The loop over a run's `Components` (built here from the config, or handed in)."""

    def __init__(self, cfg: Config, *, components: Components | None = None):
        if type(self) is Trainer and cfg.training.objective != "next_token":
            raise ValueError(f"training.objective = {cfg.training.objective} runs its own loop: start it with "
                             "titan_tpu.loops.trainer_for(cfg) (or titan-tpu train)")
        self.cfg = cfg
        self.created_at = time.time()  # goodput: where this run's start-up begins (train/goodput.py)
        # The config checked across its sections and the spec resolved once; then the run's parts.
        self.components = components or Components(prepare_run(cfg))
        self.step = 0
        self.data_seconds = 0.0  # time spent waiting for batches, all steps of this process
        self.logger: MetricsLogger | None = None  # rank 0's, while train() runs
        self.tracker_state: dict[str, str] = {}  # from the checkpoint: the trackers' run ids
        self.save_failures = 0  # checkpoint saves that failed under checkpoint.on_save_error = warn
        self.goodput: GoodputLedger | None = None  # rank 0's, while train() runs
        self.last_save_seconds: float | None = None  # the last persistent save's time in this process
        self.local_tier_seconds: float | None = None  # the grace budget's check at the start: one local-tier write

    def __getattr__(self, name: str):
        # The run's parts read as the loop's own (trainer.model, trainer.step_fn, trainer.backend):
        # what the loop drives is built by Components; this loop only adds its counters.
        if name == "components":
            raise AttributeError(name)
        return getattr(self.components, name)

    def log(self, message: str) -> None:
        self.components.log(message)

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
        changed = _what_changed(rest.get("global_batch"), self.global_batch())
        if changed:
            self.log(changed)

    def maybe_resume(self) -> bool:
        """Load the newest complete tier (local or persistent); True when it was the local one, which
        the caller then writes to the persistent tier."""
        if not self.cfg.checkpoint.resume:
            return False
        latest = self.checkpointer.agreed_latest()  # collective: rank 0's view of the checkpoint directory
        local = self.local_tier.newest() if self.local_tier is not None else None  # collective
        persistent_step = checkpoint_step(latest) if latest is not None else 0
        if local is not None and local[0] > persistent_step:
            self.load_checkpoint(local[1], local=True)
            self.log(f"resumed from the local tier {local[1]} at step {self.step}, newer than the persistent "
                     f"checkpoint ({latest.name if latest else 'none'}); writing it to the persistent tier now")
            return True
        if latest is not None:
            self.load_checkpoint(latest)
            self.log(f"resumed from {latest} at step {self.step}")
        elif self.cfg.checkpoint.initial_load_path:
            self.load_initial_weights(self.cfg.checkpoint.initial_load_path)
        return False

    def save_checkpoint(self) -> Path | None:
        """Save this step's checkpoint; None if it failed under checkpoint.on_save_error = warn."""
        return self._checkpoint_io(lambda: self.checkpointer.save(self.step, self.state_dict()))

    def save_local_tier(self, *, or_warn: bool = True) -> float | None:
        """Write this step's local tier (every rank); returns its seconds (the slowest rank's), or
        None when it failed, which is a warning (the persistent tier still works) unless not or_warn."""
        start = time.perf_counter()
        try:
            return self.local_tier.save(self.step, self.state_dict())
        except LocalTierError as e:
            if not or_warn:
                raise
            self.log(f"warning: {e}; training goes on")
            return None
        finally:
            if self.goodput is not None:
                self.goodput.add("checkpoint_save", time.perf_counter() - start)

    def _check_grace_budget(self) -> None:
        """Write the local tier once at the start, timed: a budget shorter than that is refused."""
        grace = self.cfg.checkpoint.grace_seconds
        seconds = self.save_local_tier(or_warn=False)
        if seconds > grace:
            raise ValueError(f"checkpoint.grace_seconds = {grace:g} is too short for even the local tier: writing it "
                             f"takes {seconds:.2f} s here ({self.local_tier.dir}), before the step in flight ends; "
                             f"set it to at least {math.ceil(2 * seconds + 1)} or point checkpoint.local_dir at faster "
                             "storage")
        self.log(f"grace budget {grace:g} s: the local tier takes {seconds:.2f} s ({self.local_tier.dir})")
        self.local_tier_seconds = seconds

    def _check_step_in_flight(self, step_seconds: float) -> None:
        """After this process's second step (the first one's warm-up aside): a SIGTERM waits for the
        step in flight before the local tier, so the budget must hold both; a warning, not a refusal
        (a step's time varies)."""
        grace, need = self.cfg.checkpoint.grace_seconds, step_seconds + self.local_tier_seconds
        if need > grace:
            self.log(f"warning: checkpoint.grace_seconds = {grace:g} may not hold an emergency save: a SIGTERM waits "
                     f"for the step in flight ({step_seconds:.2f} s here), then writes the local tier "
                     f"({self.local_tier_seconds:.2f} s); set it to at least {math.ceil(2 * need + 1)}")

    def emergency_save(self, since_signal: float) -> None:
        """SIGTERM under checkpoint.grace_seconds: the local tier, then the persistent checkpoint if
        what is left of the budget holds the last one's time (or none was timed yet), else it is
        written at the next start. One line says where the budget went."""
        grace = self.cfg.checkpoint.grace_seconds
        waited = _agreed_max(since_signal)  # the step in flight, on the slowest rank
        local = self.save_local_tier()  # None: it failed (a warning); the persistent save is then tried
        left = grace - waited - (local or 0.0)
        previous = self.last_save_seconds
        if local is not None and previous is not None and previous > left:
            persistent = (f"persistent checkpoint deferred to the next start (the last one took {previous:.1f} s, "
                          f"{max(left, 0):.1f} s were left)")
            total = waited + local
        else:
            local = local or 0.0
            start = time.perf_counter()
            self._timed("checkpoint_save", self._save_persistent_now)
            seconds = time.perf_counter() - start
            persistent = f"persistent checkpoint in {seconds:.1f} s"
            total = waited + local + seconds
        verdict = "within" if total <= grace else "OVER"
        self.log(f"emergency save at step {self.step}: {total:.1f} s of the {grace:g} s grace budget ({verdict}): the "
                 f"step in flight {waited:.1f} s, local tier {local:.2f} s, {persistent}")

    def _save_persistent_now(self) -> None:
        """A persistent checkpoint of this step, written through (an async one included)."""
        self._checkpoint_io(self.checkpointer.wait)
        self.save_checkpoint()
        self._checkpoint_io(self.checkpointer.wait)

    # ------------------------------------------------------------------------------------------
    # replica groups (fault_tolerance; train/replica_ft.py)

    def _start_replica_ft(self):
        """Join the replica groups' lighthouse (None without fault_tolerance): from here on this
        group heartbeats, so it is called right before the loop, once the model is resumed and built."""
        f = self.cfg.fault_tolerance
        if not f.enabled:
            return None
        from titan_tpu.train.replica_ft import ReplicaFT, check_lighthouse

        host, port = f.lighthouse_address()
        check_lighthouse(host, port, f.timeout_seconds, replicas=f.replicas)
        ft = ReplicaFT(host, port, f.replica_id, state_fn=lambda: self.state_dict(),
                       load_fn=self._take_peer_state, timeout=f.timeout_seconds, connect_timeout=f.timeout_seconds)
        self.step_fn.grad_sync = ft.average
        self.log(f"replica group {f.replica_id} of {f.replicas} (lighthouse {f.lighthouse}): gradients averaged over "
                 f"the live groups each step; this group reads its 1/{f.replicas} share of each global batch")
        return ft

    def _take_peer_state(self, state: dict) -> None:
        """Recovery: a healthy peer's state (this group was behind it) replaces this group's."""
        self.components.install_state(state)
        self.step = state["step"]

    def _replica_quorum(self, ft) -> None:
        """Before a step: agree on the quorum with the live groups; a group behind them takes their
        state. Time spent on a quorum change counts as restart in goodput (start-up for the first
        process's first quorum)."""
        ft.step = self.step
        changes, start = ft.stats.quorum_changes, time.perf_counter()
        ft.start_step()
        if ft.stats.quorum_changes != changes and self.goodput is not None:
            first = changes == 0 and not self.goodput.earlier
            self.goodput.add("startup" if first else "restart", time.perf_counter() - start)
        self._data_before_step = self.train_loader.state_dict()

    def _drop_step(self, seconds: float) -> None:
        """A step whose gradient average failed (a peer died mid-step): nothing was applied, so the
        step and its batch are taken again in the next quorum."""
        self.train_loader.load_state_dict(self._data_before_step)
        self.step -= 1
        if self.goodput is not None:
            self.goodput.lost_step(seconds)
        self.log(f"step {self.step + 1} not applied: a replica group left during it; taken again in the next quorum")

    def _timed(self, bucket: str, fn):
        """fn(), its seconds counted in goodput's `bucket` (rank 0)."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            if self.goodput is not None:
                self.goodput.add(bucket, time.perf_counter() - start)

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

    def _micro_batches(self) -> list[Batch]:
        device = self.backend.device
        start = time.perf_counter()
        with record_function(DATA_REGION):
            batches = [as_batch(self.train_loader.next_batch()).to(device, non_blocking=True)
                       for _ in range(self.cfg.training.grad_accum_steps)]
        self.data_seconds += time.perf_counter() - start
        return batches

    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        """What the step's objective adds to a metrics row (loops/dpo.py: the rewards)."""
        return next_token_metrics(result)

    def train_step(self) -> StepResult:
        self.step += 1
        return self.step_fn(self._micro_batches(), self.lr(self.step))

    @torch.no_grad()
    def validate(self) -> float:
        """The mean cross-entropy per trained token over the held-out batches on all ranks."""
        assert self.val_loader is not None
        # fp32, not fp64: TPUs have no fast fp64, and a few batches' sums fit fp32 well enough.
        totals = torch.zeros(2, device=self.backend.device)  # loss sum, tokens
        for batch in self.val_loader.val_batches(self.cfg.validation.steps):
            batch = as_batch(batch).to(self.backend.device)
            totals[0] += self.step_fn.evaluate(batch)[0]  # the summed cross-entropy (a count of 1)
            totals[1] += (batch.labels_BS != IGNORE_INDEX).sum()
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
        load_start = time.perf_counter()
        from_local_tier = self.maybe_resume()
        load_seconds = time.perf_counter() - load_start
        if self.is_main:
            self.goodput = GoodputLedger(self.run_dir, step=self.step, start=start_time(self.created_at))
            self.goodput.add("checkpoint_load", load_seconds)
            self.goodput.add("compile", sum(self.compile_stats.values()))
        if from_local_tier:  # the persistent tier catches up before training goes on
            self._timed("checkpoint_save", self.save_checkpoint)
        if self.local_tier is not None and cfg.checkpoint.grace_seconds > 0:
            self._check_grace_budget()
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
        replica_ft = self._start_replica_ft()  # first: a lighthouse that does not answer leaves nothing open
        logger = self.logger = self._open_logger() if self.is_main else None
        profiler = self._profiler()
        with GracefulShutdown() as shutdown:
            # Throughput counts only time spent in training steps (each ends in a host sync when its
            # loss is read), not validation or checkpointing.
            window_tokens, window_seconds, window_steps, window_start_data = 0, 0.0, 0, self.data_seconds
            steps_here = 0  # steps taken by this process
            self.backend.reset_peak_memory()
            if self.goodput is not None:
                self.goodput.begin_loop()
            while self.step < cfg.training.steps:
                if replica_ft is not None:
                    self._replica_quorum(replica_ft)
                if profiler is not None:
                    profiler.before_step(self.step + 1)
                start, data_before = time.perf_counter(), self.data_seconds
                result = self.train_step()
                seconds = time.perf_counter() - start
                if not result.committed:
                    self._drop_step(seconds)
                    continue
                steps_here += 1
                if steps_here == 2 and self.local_tier_seconds is not None:
                    self._check_step_in_flight(seconds)
                window_seconds += seconds
                if self.goodput is not None:
                    self.goodput.step(self.step, seconds=seconds, data_seconds=self.data_seconds - data_before)
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
                    row.update(self.objective_metrics(result))
                    row.update(self.train_loader.metrics())  # mixtures: token share and epochs per source
                    row.update(self.backend.memory_stats())
                    row.update(self.compile_stats)
                    if replica_ft is not None:  # the replica groups in the gradient average of this step
                        row["replica_groups"] = replica_ft.members
                    self.compile_stats = {}  # once per process
                    if self.goodput is not None:  # the ledger first: a kill between the two loses no step
                        self.goodput.flush()
                        row["goodput"] = self.goodput.totals()["goodput"]
                    if logger is not None:
                        logger.log(self.step, row)
                    window_tokens, window_seconds, window_steps, window_start_data = 0, 0.0, 0, self.data_seconds
                if self.val_loader is not None and (self.step % cfg.validation.freq == 0 or done):
                    last_val = self._timed("validation", self.validate)
                    if logger is not None:
                        logger.log(self.step, {"val_loss": last_val})
                stop = shutdown.should_stop()  # agreed by all ranks, so all of them save together
                c = cfg.checkpoint
                if stop and self.local_tier is not None and c.grace_seconds > 0:
                    self.emergency_save(shutdown.seconds_since_signal())
                elif c.enabled and (self.step % c.interval == 0 or done or stop):
                    if c.async_save:  # the previous async save's failure, if any, first
                        self._timed("checkpoint_save", lambda: self._checkpoint_io(self.checkpointer.wait))
                    save_start = time.perf_counter()
                    self._timed("checkpoint_save", self.save_checkpoint)
                    self.last_save_seconds = None if c.async_save else time.perf_counter() - save_start
                elif c.local_interval and self.step % c.local_interval == 0:
                    self.save_local_tier()
                if stop:
                    stopped_by = shutdown.signal_name or "a signal on another rank"
                    break
        if replica_ft is not None:
            replica_ft.close()
        # An async save must land before the process ends.
        self._timed("checkpoint_save", lambda: self._checkpoint_io(self.checkpointer.close))
        if self.local_tier is not None and stopped_by is None:  # finished: the persistent tier holds the end
            self.local_tier.clear()
        if profiler is not None:
            profiler.close()
        goodput = None
        if self.goodput is not None:
            self.goodput.flush()
            goodput = self.goodput.totals()
            self.goodput = None
        if logger is not None:
            logger.close()
            self.logger = None
        if self.run_lock is not None:
            self.run_lock.release()

        latest = self.checkpointer.latest() if cfg.checkpoint.enabled else None
        summary = {"step": self.step, "metrics": str(self.run_dir / "metrics.jsonl"),
                   "checkpoint": str(latest) if latest else None, "val_loss": last_val, "stopped_by": stopped_by,
                   "save_failures": self.save_failures, "goodput": goodput}
        if stopped_by:
            self.log(f"stopped by {stopped_by} after step {self.step}; restart the same command to resume")
        if goodput is not None:
            self.log(describe(goodput))
        self.log(f"done: step {self.step}; metrics: {summary['metrics']}; checkpoint: {summary['checkpoint']}")
        return summary


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


def _agreed_max(value: float) -> float:
    """The largest `value` of all ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def next_token_metrics(result: StepResult) -> dict[str, float]:
    """The next-token objective's terms in a metrics row: the MoE balancing loss and load spread
    (MoE models), the multi-token-prediction loss, unweighted (MTP models)."""
    row = _moe_metrics(result)
    if result.mtp_loss is not None:
        row["mtp_loss"] = result.mtp_loss
    return row


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
