"""`Components`: the parts of one run, built from its `RunSetup` in a fixed order, and the run's
state (what a checkpoint holds) read from and written into them.

The order matters for reproducibility and is the trainer's of before: the device and the process
group, the mesh, the output directory's lock, the global seed, the data (rank 0 tokenizes first,
the others wait on the store, without a timeout), the model (initialised from the seeded global
RNG), the frozen reference (DPO's, GRPO's), the objective, the optimizer, the step function. What
differs between kinds of training is read from the kind's record (kinds/record.py): its data and
objective builders, its reference, its share of the FLOPs; nothing here tests a kind's name.
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
from titan_tpu.components.runtime import DTYPES, init_distributed, main_process_first
from titan_tpu.config import Config, grad_accum_from_tokens
from titan_tpu.device import Backend, get_backend, jax_backend
from titan_tpu.device_cpu import check_cpu_compute_dtype
from titan_tpu.errors import RunError
from titan_tpu.files import default_cache_dir
from titan_tpu.graph.compile_cache import use_compile_cache
from titan_tpu.graph.spmd import mesh_axis_sizes
from titan_tpu.kinds.record import DataRequest, TrainingKind, builds_reference_copy, reference_flops
from titan_tpu.model_contract import TrainableModel
from titan_tpu.models.lora import is_adapter_key
from titan_tpu.models.spec import build
from titan_tpu.parallel.mesh import ParallelDims
from titan_tpu.parallel.simple_fsdp import MixedPrecision, default_mixed_precision
from titan_tpu.run_setup import RunSetup
from titan_tpu.train.checkpoint import (
    Checkpointer,
    _atomic_write_text,
    check_model_identity,
    load,
    rng_state,
    set_rng_state,
)
from titan_tpu.train.local_tier import LocalTier, default_local_dir
from titan_tpu.train.optim import AdamW
from titan_tpu.train.run_lock import RunLock

__all__ = ["Components"]

RUN_ID_FILE = "run_id"  # in output_dir: the run's id, which keys its local checkpoint tier


class Components:
    """The assembled run (module docstring). Attributes: cfg, setup, spec, model_args, backend,
    rank, world_size, is_main, parallel_dims (the mesh's sizes, resolved once: parallel/mesh.py), mesh,
    expert_mesh, batch_split (the ranks that share a batch in this job) and data_split (the global
    batch's rows: the data-parallel ranks, or the replica groups), run_dir, run_lock,
    document_mask, tokenizer, train_loader, val_loader, model, objective, optimizer, step_fn,
    compile_stats, checkpointer, local_tier (None unless checkpoint.grace_seconds or local_interval),
    warmup_steps, flops_per_token (the policy's and its reference's), flops_note, kind (the record),
    reference (the frozen reference model, None without one or under LoRA's adapters-off base),
    extras (what the kind's own loop needs: kinds/record.py DataParts.extras)."""

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
        self.parallel_dims = ParallelDims.from_config(p, world_size=self.world_size)
        self.mesh = self.parallel_dims.build_mesh(self.backend.device.type)
        self.expert_mesh = self.parallel_dims.build_expert_mesh(self.backend.device.type)
        # The ranks this job's collectives (the loss's sums, the gradients) span.
        self.batch_split = self.parallel_dims.batch_split(self.rank)
        # Who reads which rows of the global batch: the data-parallel ranks, or with replica groups
        # (fault_tolerance) the groups, each one process (train/replica_ft.py says why).
        ft = cfg.fault_tolerance
        if ft.enabled and self.world_size > 1:
            raise ValueError(f"fault_tolerance.enabled runs one process per replica group; this group has "
                             f"{self.world_size} ranks: start each group with one process (titan-tpu train, not "
                             "torchrun) and fault_tolerance.replicas groups")
        self.data_split = (self.batch_split.across_groups(group=ft.replica_id, groups=ft.replicas) if ft.enabled
                           else self.batch_split)
        if t.global_batch_tokens:  # accumulation from the global batch, now that the mesh is known
            split = self.data_split
            t.grad_accum_steps = grad_accum_from_tokens(t, split.dp_size, ranks_per_dp=split.ranks_per_dp)
            self.log(f"training.global_batch_tokens = {t.global_batch_tokens}: {t.grad_accum_steps} micro-batches of "
                     f"{t.batch_size} x {t.seq_len} tokens per step on each of {split.dp_size} data-parallel ranks")
        self.run_lock = self._lock_output_dir()
        torch.manual_seed(t.seed)
        self.spec = setup.spec  # what the run asks about the model (models/spec.py)
        self.base_weights = setup.base_weights  # recorded in checkpoints: the base a LoRA export names
        self.model_args = self.spec.args
        self.step_fn = None  # made once the model, objective and optimizer exist
        self._data()
        self.model = self.build_model()
        self.reference = self._frozen_reference()
        self.objective = kind.objective(cfg, self.reference)
        # The trained parameters: all of them, or under LoRA the adapters (the base is frozen).
        trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = AdamW.from_config(trained, cfg.optimizer, layer_stacked=self.model.stacked_parameter_names())
        # compile_stats: capture/compile seconds, logged with the first row
        self.step_fn, self.compile_stats = make_step(cfg, self.model, self.optimizer, backend=self.backend,
                                                     world_size=self.world_size, dp_size=self.batch_split.dp_size,
                                                     documents=self.document_mask, log=self.log,
                                                     objective=self.objective,
                                                     mesh_axes=mesh_axis_sizes(self.mesh, self.parallel_dims),
                                                     compile_cache=self.compile_cache,
                                                     example_batch=self.example_batch)
        self.checkpointer = Checkpointer.from_config(cfg.checkpoint, self.run_dir, log=self.log)
        c = cfg.checkpoint
        self.local_tier = None
        if c.enabled and (c.grace_seconds > 0 or c.local_interval > 0):
            # Under the run's id: a run started afresh in the same output_dir never takes another's tier.
            local_dir = Path(c.local_dir) if c.local_dir else default_local_dir(self.run_dir)
            self.local_tier = LocalTier(local_dir / self._run_id(), log=self.log)
        self.warmup_steps = setup.warmup_steps
        # A vision-language model's image rows: the tower's and projector's work on them counts too.
        images = getattr(self.example_batch, "images", None)
        policy_flops, self.flops_note = self.spec.flops_per_token(self.model, t.seq_len, images=images)
        # MFU counts the work done per second: the frozen reference's forwards too (DPO's, GRPO's).
        self.flops_per_token = policy_flops + reference_flops(kind, cfg, policy_flops)

    def log(self, message: str) -> None:
        if self._log is not None:
            self._log(message)
        elif self.is_main:
            print(message, flush=True)

    # ------------------------------------------------------------------------------------------
    # the parts

    def _data(self) -> None:
        """document_mask, tokenizer, train_loader, val_loader, extras: the kind's data (kinds/), with
        the loss kernel its labels need. Rank 0 tokenizes (or finds the cache) first; the others then
        read the cache (or fill their host's own), waiting on the store meanwhile, with no timeout
        (runtime.py)."""
        cfg = self.cfg
        split = self.data_split
        request = DataRequest(cfg=cfg, sources=self.setup.sources, tokenizer_path=self.setup.tokenizer_path,
                              vocab_size=self.model_args.vocab_size,
                              cache_dir=Path(cfg.data.cache_dir or default_cache_dir()), data_rank=split.dp_rank,
                              data_size=split.dp_size, kernel_device=self.backend.kernel_device_type, log=self.log,
                              image_model_dir=self.spec.image_model_dir())
        with main_process_first(log=self.log, what="the other ranks to open (or tokenize) the data"):
            parts = self.kind.data(request)
        cfg.kernels = parts.kernels
        self.document_mask = parts.document_mask
        self.tokenizer, self.train_loader, self.val_loader = parts.tokenizer, parts.train_loader, parts.val_loader
        self.extras = parts.extras
        self.example_batch = parts.example_batch

    def build_model(self, cfg: Config | None = None) -> TrainableModel:
        """The spec's model (models/spec.py `build`) as `cfg` (default the run's) asks for it:
        materialised and initialised piece by piece (sharded when there is a mesh): fp32 master
        parameters on one device as on many, computed in model.dtype, gradients reduced in
        parallelism.reduce_dtype when sharded (docs/mixed_precision.md)."""
        cfg = cfg or self.cfg
        return build(self.spec, cfg, device=self.backend.device, seed=cfg.training.seed, mesh=self.mesh,
                     parallel_dims=self.parallel_dims, expert_mesh=self.expert_mesh, mp=self.mixed_precision,
                     documents=self.document_mask, reshard_after_forward=self._reshard_after_forward(), log=self.log)

    @torch.no_grad()
    def _frozen_reference(self) -> torch.nn.Module | None:
        """The frozen reference the kind scores against (kinds/record.py `reference`): the run's
        starting weights ("initial") or a checkpoint or Hugging Face directory. None without one, or
        where the trained model with its adapters off is it (LoRA from the starting weights): no
        second copy is built."""
        cfg, reference = self.cfg, self.kind.reference(self.cfg)
        if not builds_reference_copy(self.kind, cfg):
            return None
        initial = reference == "initial"
        start = cfg.checkpoint.initial_load_path if initial else reference
        # The full model, as the run builds its own (without adapters: a reference is never trained).
        model = self.build_model(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False)))
        if start:
            self.load_initial_weights(start, model=model)
        model.requires_grad_(False)
        model.eval()
        self.log(f"{self.kind.reference_role} {'the starting weights' if initial else start}, a frozen copy")
        return model

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

    def _reshard_after_forward(self) -> bool:
        """parallelism.reshard_after_forward as this run applies it: auto is decided by the planner
        on rank 0 (planner.reshard_decision, which `titan-tpu compile` asks too: re-shard only where
        keeping the gathered block weights would not fit) and shared, so every rank runs the same collectives. Where the
        planner has no terms for the run (an hf model, an unnamed GPU) auto re-shards."""
        value = self.cfg.parallelism.reshard_after_forward
        if value != "auto" or self.mesh is None:
            return value == "true"
        if self.parallel_dims.pp > 1:  # no buckets under pipeline stages: nothing to re-shard
            return False
        if getattr(self, "_reshard_decision", None) is not None:  # a second model (DPO's reference) gets the same
            return self._reshard_decision
        decision = [None, None]  # (re-shard, why), filled on rank 0
        if self.is_main:
            from titan_tpu.plan.planner import reshard_decision

            decision = list(reshard_decision(self.setup, world_size=self.world_size))
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        reshard, why = decision
        self.log(f"parallelism.reshard_after_forward auto: {str(reshard).lower()} ({why})")
        self._reshard_decision = reshard
        return reshard

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.cfg.model.dtype == "auto":
            return default_mixed_precision(self.backend.compute_device_type).param_dtype
        return DTYPES[self.cfg.model.dtype]

    @property
    def mixed_precision(self) -> MixedPrecision:
        # Under XLA (a TPU, the JAX path) one collective per tensor: XLA combines them (MixedPrecision.per_tensor).
        return MixedPrecision(param_dtype=self.compute_dtype, reduce_dtype=DTYPES[self.cfg.parallelism.reduce_dtype],
                              per_tensor=self.backend.collective_per_tensor)

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
        t = self.cfg.training
        dp_size = self.data_split.dp_size
        return {"tokens": t.batch_size * t.seq_len * dp_size * t.grad_accum_steps, "world_size": self.world_size,
                "dp_size": dp_size, "grad_accum_steps": t.grad_accum_steps, "batch_size": t.batch_size}

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
        if getattr(self.model, "pipeline", None) is not None:
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

    @torch.no_grad()
    def load_initial_weights(self, path: str | Path, model: torch.nn.Module | None = None) -> None:
        """Start from the weights of a checkpoint or a Hugging Face directory (fine-tuning); into
        `model` (default the trained one: DPO's reference loads the same weights)."""
        from titan_tpu.convert import resolve_checkpoint

        model = self.model if model is None else model
        path = Path(path)
        if (path / "config.json").is_file():  # a Hugging Face directory: the spec knows its layout
            self.spec.load_hf_weights(model, path)
        else:  # a training checkpoint: DCP loads (and shards) it
            # The base weights: a checkpoint of a full run has no adapters (LoRA's start at init).
            base = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
            load(resolve_checkpoint(path), {"model": base})
        if self.step_fn is not None:  # a DPO reference is loaded before the step exists
            self.step_fn.state_from_host()
        self.log(f"initial weights loaded from {path}")
