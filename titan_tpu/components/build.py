"""`Components`: the parts of one run, built from its `RunSetup` in a fixed order, and the run's
state (what a checkpoint holds) read from and written into them.

The order matters for reproducibility and is the trainer's of before: the device and the process
group, the run resolved for this world (components/resolve.py: the mesh, the accumulation, the
dtypes, the kernels, the re-shard choice, the pipeline schedule, read by every part below), the
output directory's lock, the global seed, the data (rank 0 tokenizes first, the others wait on the
store, without a timeout), then one rank's program (components/program.py: the model, initialised
from the seeded global RNG, the frozen reference, the objective, the optimizer; the code `titan-tpu
compile` assembles with too) and the step function. What differs between kinds of training is read
from the kind's record (kinds/record.py); nothing here tests a kind's name.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from titan_tpu.components.make_step import make_step
from titan_tpu.components.program import assemble_program, data_request, describe_run, flops_per_token, load_weights
from titan_tpu.components.resolve import resolve
from titan_tpu.components.runtime import init_distributed, main_process_first
from titan_tpu.components.world import Place
from titan_tpu.device import Backend, get_backend, jax_backend
from titan_tpu.device_cpu import check_cpu_compute_dtype
from titan_tpu.errors import RunError
from titan_tpu.files import default_cache_dir
from titan_tpu.graph.compile_cache import use_compile_cache
from titan_tpu.kinds.record import TrainingKind
from titan_tpu.parallel.simple_fsdp import MixedPrecision
from titan_tpu.run.resolved import Target
from titan_tpu.run.setup import RunSetup
from titan_tpu.train.checkpoint import (
    Checkpointer,
    _atomic_write_text,
    check_model_identity,
    load,
    rng_state,
    set_rng_state,
)
from titan_tpu.train.local_tier import LocalTier, default_local_dir
from titan_tpu.train.run_lock import RunLock

__all__ = ["Components"]

RUN_ID_FILE = "run_id"  # in output_dir: the run's id, which keys its local checkpoint tier


class Components:
    """The assembled run (module docstring). Attributes: cfg, setup, run (the run resolved for this
    world: run/resolved.py), spec, model_args, backend, rank, world_size, is_main, place (this rank's
    meshes and device: components/world.py), parallel_dims, mesh, expert_mesh, batch_split (the ranks
    that share a batch in this job) and data_split (the global batch's rows: the data-parallel ranks,
    or the replica groups), run_dir, run_lock, tokenizer, train_loader, val_loader, model, reference
    (the frozen reference model, None without one or under LoRA's adapters-off base), objective,
    optimizer, step_fn, compile_stats, checkpointer, local_tier (None unless checkpoint.grace_seconds or
    local_interval), warmup_steps, flops_per_token (the policy's and its reference's), flops_note,
    kind (the record), extras (what the kind's own loop needs: kinds/record.py DataParts.extras)."""

    def __init__(self, setup: RunSetup, kind: TrainingKind, *, log: Callable[[str], None] | None = None):
        self.created_at = time.time()  # goodput: where this run's start-up begins (train/goodput.py)
        cfg = self.cfg = setup.cfg
        self.setup = setup
        self.kind = kind
        self._log = log
        self.run_dir = cfg.run_dir
        t, p = cfg.training, cfg.parallelism
        if p.slices > 1:  # planned and compiled (titan-tpu plan / compile), not launched
            raise ValueError(f"parallelism.slices = {p.slices}: the trainer does not start a multi-slice run yet "
                             "(libtpu's multislice runtime is not wired into the launch); plan and compile it with "
                             "titan-tpu plan / compile, or train on one slice with parallelism.slices 1")
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        # compile.backend jax in graph mode: JAX's runtime runs the step, the torch side lives on the host CPU.
        jax_path = cfg.compile.backend == "jax" and t.mode == "graph"
        self.backend: Backend = jax_backend(t.device) if jax_path else get_backend(t.device)
        if self.backend.compute_device_type == "cpu":  # training.device auto that became the CPU (config checks cpu)
            check_cpu_compute_dtype(cfg.model.dtype)
        # Before the device starts: the compilers read their persistent cache's directory as they start.
        self.compile_cache = (use_compile_cache(cfg.compile.cache_dir, backend=cfg.compile.backend,
                                                enabled=cfg.compile.cache) if t.mode == "graph" else None)
        self.rank, self.world_size = init_distributed(self.backend)
        self.is_main = self.rank == 0
        ft = cfg.fault_tolerance
        if ft.enabled and self.world_size > 1:
            raise ValueError(f"fault_tolerance.enabled runs one process per replica group; this group has "
                             f"{self.world_size} ranks: start each group with one process (titan-tpu train, not "
                             "torchrun) and fault_tolerance.replicas groups")
        # The run resolved for this world, once: what every part below reads (run/resolved.py).
        self.run = run = resolve(setup, Target.of_backend(self.backend, self.world_size))
        self._log_resolution()
        # A kernel that cannot run on this device is a one-line error now, not at the first step.
        run.kernels.check_device(self.backend.kernel_device_type, documents=run.documents)
        self.parallel_dims = run.dims
        self.place = Place.of(run, rank=self.rank, device=self.backend.device)
        self.mesh, self.expert_mesh = self.place.mesh, self.place.expert_mesh
        self.batch_split = run.batch_split(self.rank)  # the ranks this job's collectives (the loss's sums) span
        self.data_split = run.data_split(self.rank)
        self.run_lock = self._lock_output_dir()
        try:
            self._build_parts(setup)
        except BaseException:
            self.release_lock()  # a one-line error (bad data, a kernel) is no killed run for the next start
            raise

    def _build_parts(self, setup: RunSetup) -> None:
        """The parts after the lock: the seed, the data, this rank's program, the step, the checkpointer."""
        cfg, t, run = self.cfg, self.cfg.training, self.run
        torch.manual_seed(t.seed)
        self.spec = setup.spec  # what the run asks about the model (models/spec.py)
        self.base_weights = setup.base_weights  # recorded in checkpoints: the base a LoRA export names
        self.model_args = self.spec.args
        self.step_fn = None  # made once the program exists
        data_example = self._data()
        program = assemble_program(run, self.place, example_batch=data_example, log=self.log)
        self.model, self.reference = program.model, program.reference
        self.objective, self.optimizer = program.objective, program.optimizer
        # compile_stats: capture/compile seconds, logged with the first row
        self.step_fn, self.compile_stats = make_step(run, program, self.place, backend=self.backend, log=self.log,
                                                     compile_cache=self.compile_cache)
        self.checkpointer = Checkpointer.from_config(cfg.checkpoint, self.run_dir, log=self.log)
        c = cfg.checkpoint
        self.local_tier = None
        if c.enabled and (c.grace_seconds > 0 or c.local_interval > 0):
            # Under the run's id: a run started afresh in the same output_dir never takes another's tier.
            local_dir = Path(c.local_dir) if c.local_dir else default_local_dir(self.run_dir)
            self.local_tier = LocalTier(local_dir / self._run_id(), log=self.log)
        self.warmup_steps = setup.warmup_steps
        # A vision-language model's image rows: the tower's and projector's work on them counts too.
        self.flops_per_token, self.flops_note = flops_per_token(run, self.model,
                                                                images=getattr(data_example, "images", None))

    def release_lock(self) -> None:
        """Let go of output_dir's lock (rank 0's), cleanly: the next start finds no holder to report."""
        if self.run_lock is not None:
            self.run_lock.release()

    def log(self, message: str) -> None:
        if self._log is not None:
            self._log(message)
        elif self.is_main:
            print(message, flush=True)

    def _log_resolution(self) -> None:
        """The device, and what the resolution decided that a user asked for as auto or as a global batch,
        one line each."""
        run, t, backend = self.run, self.cfg.training, self.backend
        where = f"{backend.jax_platform} through JAX" if backend.jax_platform else str(backend.device)
        self.log(f"device: {where} ({backend.chosen_because})")
        if t.global_batch_tokens:
            split = run.data_split()
            self.log(f"training.global_batch_tokens = {t.global_batch_tokens}: {run.grad_accum_steps} micro-batches "
                     f"of {t.batch_size} x {t.seq_len} tokens per step on each of {split.dp_size} data-parallel ranks")
        if self.cfg.parallelism.reshard_after_forward == "auto" and self.world_size > 1:
            self.log(f"parallelism.reshard_after_forward auto: {str(run.reshard_after_forward).lower()} "
                     f"({run.reshard.why})")
        self.log(describe_run(run))

    # ------------------------------------------------------------------------------------------
    # the parts

    def _data(self):
        """tokenizer, train_loader, val_loader, extras: the kind's data (kinds/); returns the data's own
        example batch where it has one (images), else None. Rank 0 tokenizes (or finds the cache)
        first; the others then read the cache (or fill their host's own), waiting on the store
        meanwhile, with no timeout (runtime.py)."""
        request = data_request(self.run, rank=self.rank, cache_dir=Path(self.cfg.data.cache_dir or default_cache_dir()),
                               log=self.log)
        with main_process_first(log=self.log, what="the other ranks to open (or tokenize) the data"):
            parts = self.kind.data(request)
        self.tokenizer, self.train_loader, self.val_loader = parts.tokenizer, parts.train_loader, parts.val_loader
        self.extras = parts.extras
        return parts.example_batch

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

    def _run_id(self) -> str:
        """The id of the run in output_dir (<output_dir>/run_id, made by its first start), the same on
        every rank."""
        shared = [None]
        if self.is_main:
            path = self.run_dir / RUN_ID_FILE
            if not path.is_file():
                self.run_dir.mkdir(parents=True, exist_ok=True)
                _atomic_write_text(path, uuid.uuid4().hex[:16] + "\n")
            shared[0] = path.read_text().strip()
        if dist.is_initialized():
            dist.broadcast_object_list(shared, src=0)
        return shared[0]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.run.compute_dtype

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self.run.mixed_precision

    # ------------------------------------------------------------------------------------------
    # the run's state

    def _optimizer_state_per_layer(self, sd: dict | None = None) -> dict:
        # Moments by parameter name in the checkpoint's per-layer layout (views into the stacked
        # moments under scan_layers), like model.state_dict(): scanned and unrolled runs resume
        # from each other's checkpoints.
        sd = self.optimizer.state_dict() if sd is None else sd
        return {**sd, "exp_avg": self.model.to_per_layer(sd["exp_avg"]),
                "exp_avg_sq": self.model.to_per_layer(sd["exp_avg_sq"])}

    def state_dict(self, *, step: int, trackers: dict) -> dict:
        self.step_fn.state_to_host()  # a step that keeps the state on its device writes it back first
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self._optimizer_state_per_layer(),
            "data": self.train_loader.state_dict(),
            "rng": rng_state(),
            "model_name": self.spec.name,
            "model_args": dataclasses.asdict(self.model_args),
            "trackers": trackers,
            # What convert needs to export the adapters (peft) or merge them (HF).
            "lora": dataclasses.asdict(self.cfg.lora) if self.cfg.lora.enabled else None,
            "base_weights": self.base_weights,
            "global_batch": self.global_batch(),
        }

    def global_batch(self) -> dict:
        """What one optimizer step takes, recorded in checkpoints: a resume on another mesh says what changed."""
        run = self.run
        return {"tokens": run.global_batch_tokens, "world_size": self.world_size, "dp_size": run.data_split().dp_size,
                "grad_accum_steps": run.grad_accum_steps, "batch_size": self.cfg.training.batch_size}

    def load_checkpoint(self, path: Path, *, local: bool = False) -> dict:
        """Resume everything from a checkpoint (local: a tier of train/local_tier.py), resharding it
        onto this run's ranks if needed; returns the rest of what it held (step, trackers)."""
        moments = self.optimizer.state_dict()  # the per-layer views below point into these
        state = {"model": self.model.state_dict(), "optimizer": self._optimizer_state_per_layer(moments),
                 "model_name": self.spec.name, "model_args": dataclasses.asdict(self.model_args)}
        if local:
            rest = self.local_tier.load(path, state)
            check_model_identity(path, rest, model_name=self.spec.name, model_args=dataclasses.asdict(self.model_args))
        else:
            rest = load(path, state)  # fills the model's and optimizer's tensors in place
        if self.run.pipeline is not None:
            # A pipeline stage's rows were filled in place and cannot be stacked from its views alone.
            state["optimizer"] = {**state["optimizer"], "exp_avg": moments["exp_avg"],
                                  "exp_avg_sq": moments["exp_avg_sq"]}
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self._load_optimizer_per_layer(state["optimizer"])
        self.step_fn.state_from_host()
        self.train_loader.load_state_dict(rest["data"])
        if rest["rng"] is not None:  # None when the checkpoint came from another number of ranks
            set_rng_state(rest["rng"])
        return rest

    def _load_optimizer_per_layer(self, loaded: dict) -> None:
        self.optimizer.load_state_dict({**loaded, "exp_avg": self.model.from_per_layer(loaded["exp_avg"]),
                                        "exp_avg_sq": self.model.from_per_layer(loaded["exp_avg_sq"])})

    @torch.no_grad()
    def install_state(self, state: dict) -> None:
        """A peer's `state_dict` in memory (replica fault tolerance's recovery; one process, no
        resharding): model, optimizer, data position and RNG; the caller takes its step."""
        self.model.load_state_dict(state["model"])
        self._load_optimizer_per_layer(state["optimizer"])
        self.step_fn.state_from_host()
        self.train_loader.load_state_dict(state["data"])
        set_rng_state(state["rng"])

    def load_initial_weights(self, path: str | Path) -> None:
        """Start from the weights of a checkpoint or a Hugging Face directory (fine-tuning)."""
        load_weights(self.run, self.model, path, log=self.log)
        self.step_fn.state_from_host()
