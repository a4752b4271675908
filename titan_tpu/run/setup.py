"""Run setup: a read config checked as a whole, once, and what the run's components need from it.

config.py is the schema every layer reads: sections, TOML, overrides and each section's own
checks. What spans sections or needs a component to answer (the model spec's flavors and limits,
the learning-rate schedule, the metric trackers, the device) is checked here, each check asked of
the part that owns it, and the answers are kept so nobody resolves them again:

    setup = prepare_run(build_config(recipe, overrides))
    setup.spec       # models/spec.py: what the run asks about the model (args, label, build, files)
    setup.sources    # the data sources ([[data.sources]] or the one data.source)
    setup.warmup_steps

The trainer, `titan-tpu plan`, eval, prepare-data and calibration start from `prepare_run`; every
mistake is still one ValueError that names the key and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_tpu.config import Config, check, data_sources, grad_accum_from_tokens
from titan_tpu.data.sources import SourceConfig
from titan_tpu.files import is_hf_model_dir
from titan_tpu.kinds import check_kind
from titan_tpu.models.spec import model_spec
from titan_tpu.models.spec_base import ModelSpec
from titan_tpu.parallel.mesh import BatchSplit, ParallelDims


@dataclass
class RunSetup:
    cfg: Config
    spec: ModelSpec  # the [model] section resolved (models/spec.py)
    sources: list[SourceConfig]  # data_sources(cfg)
    warmup_steps: int  # lr_scheduler.warmup_steps clamped to training.steps

    @classmethod
    def resolved(cls, cfg: Config) -> RunSetup:
        """The setup of a config already checked (`prepare_run` ran on it, or on the config it is a
        variant of: a planner's what-if): its model spec resolved, nothing checked again."""
        return cls(cfg=cfg, spec=model_spec(cfg.model), sources=data_sources(cfg),
                   warmup_steps=effective_warmup_steps(cfg))

    @property
    def tokenizer_path(self) -> str | None:
        """data.tokenizer_path, else the model's own (an HF directory's tokenizer.json), else the one
        that came with the weights the run starts from (checkpoint.initial_load_path: an HF directory,
        with its chat template, or a training run's directory), else None (train a BPE). Pretrained
        weights without a tokenizer are a one-line error: a BPE trained here would not match them."""
        own = self.spec.tokenizer_path(self.cfg)
        start = self.cfg.checkpoint.initial_load_path
        if own or not start:
            return own
        found = initial_weights_tokenizer(start)
        if found is None:
            raise ValueError(f"checkpoint.initial_load_path {start} holds no tokenizer.json: set data.tokenizer_path "
                             "to the tokenizer those weights were trained with (a tokenizer.json or its HF directory)")
        return found

    @property
    def base_weights(self) -> dict[str, str] | None:
        """Where the run's starting weights come from, for its checkpoints (a LoRA export records the
        base it adapts): {"hf_dir": DIR} for a Hugging Face directory (checkpoint.initial_load_path,
        or model.hf_config with weights), {"checkpoint": PATH} for a training checkpoint, None for a
        random initialisation. Absolute paths."""
        start = self.cfg.checkpoint.initial_load_path
        if start:
            path = Path(start).expanduser().absolute()
            return {"hf_dir": str(path)} if is_hf_model_dir(path) else {"checkpoint": str(path)}
        own = self.spec.own_weights_path()
        return {"hf_dir": str(own.absolute())} if own is not None else None


def initial_weights_tokenizer(path: str) -> str | None:
    """The tokenizer that comes with starting weights: an HF directory holding a tokenizer.json (the
    directory, so its chat template is found too), or the run directory of a training checkpoint
    (a step, its checkpoints/ or the run directory itself; the trainer keeps the tokenizer there).
    None when there is none; a path that does not exist is a one-line error."""
    start = Path(path).expanduser()
    if not start.exists():
        raise FileNotFoundError(f"checkpoint.initial_load_path {path} does not exist (looked for "
                                f"{str(start.absolute())!r}); give a Hugging Face directory or a training checkpoint")
    if is_hf_model_dir(start):
        return str(start) if (start / "tokenizer.json").is_file() else None
    from titan_tpu.convert import resolve_checkpoint

    resolve_checkpoint(start)  # a directory without a checkpoint: its own one-line error, before the tokenizer's
    run_dirs = [start, start.parent if start.name == "checkpoints" else None,
                start.parent.parent if start.parent.name == "checkpoints" else None]
    return next((str(d) for d in run_dirs if d is not None and (d / "tokenizer.json").is_file()), None)


def data_split(cfg: Config, dims: ParallelDims, rank: int = 0) -> BatchSplit:
    """Who reads which rows of the global batch, for global rank `rank`: the data-parallel ranks of
    the mesh, or with replica groups (fault_tolerance) the groups, each one job reading its own rows
    (train/replica_ft.py says why)."""
    split = dims.batch_split(rank)
    ft = cfg.fault_tolerance
    return split.across_groups(group=ft.replica_id, groups=ft.replicas) if ft.enabled else split


def accumulation(cfg: Config, dims: ParallelDims) -> int:
    """Micro-batches per optimizer step on the mesh `dims`: training.grad_accum_steps, or derived from
    training.global_batch_tokens over the rows' split (`data_split`), as config.py
    `grad_accum_from_tokens` says (a one-line error where the mesh cannot keep the global batch)."""
    split = data_split(cfg, dims)
    return grad_accum_from_tokens(cfg.training, split.dp_size, ranks_per_dp=split.ranks_per_dp)


def effective_warmup_steps(cfg: Config) -> int:
    """lr_scheduler.warmup_steps, clamped to training.steps (a warmup never outlasts the run)."""
    return min(cfg.lr_scheduler.warmup_steps, cfg.training.steps)


def prepare_run(cfg: Config) -> RunSetup:
    """Check `cfg` (config.py's section checks, then across sections) and resolve what the run's
    components read: raises one-line ValueErrors. Call it once per run: it does not change `cfg`."""
    from titan_tpu.device import check_tpu_compile_backend
    from titan_tpu.device_cpu import check_cpu_compute_dtype
    from titan_tpu.train.optim import validate_lr_schedule
    from titan_tpu.train.trackers import check_tracker_names

    check(cfg)  # a config built in code, not read by build_config, is checked too
    spec = model_spec(cfg.model)  # raises with the valid flavors and on MoE options of dense models
    model_args = spec.args
    t, p = cfg.training, cfg.parallelism
    if p.ep > 1:
        spec.check_expert_parallel(p.ep)
    spec.check(cfg)
    if t.global_batch_tokens and p.dp_shard != -1:  # with -1 the ranks are known at launch
        accumulation(cfg, ParallelDims.from_config(p, world_size=None, runnable=False))  # its error now
    if cfg.compile.backend == "tpu":
        check_tpu_compile_backend(t.device)
    if cfg.compile.backend == "jax" and t.mode == "graph":  # eager mode runs torch's ops on training.device
        _check_jax_path(cfg)
    _check_lora(cfg)
    _check_fp8_experts(cfg)
    check_tracker_names(cfg.metrics.trackers)
    s = cfg.lr_scheduler
    # A warmup longer than the run (a quick --training.steps 2 with a recipe's warmup of 10) is clamped
    # by the trainer, with a note in its log.
    warmup_steps = effective_warmup_steps(cfg)
    validate_lr_schedule(base_lr=cfg.optimizer.lr, warmup_steps=warmup_steps, total_steps=t.steps,
                         decay_ratio=s.decay_ratio, decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio)
    if t.seq_len > model_args.max_seq_len:
        raise ValueError(f"training.seq_len = {t.seq_len} exceeds the max_seq_len = {model_args.max_seq_len} of "
                         f"{spec.label}; lower training.seq_len")
    if not 0.0 < cfg.data.val_fraction < 1.0 and cfg.validation.enabled:
        raise ValueError(f"data.val_fraction = {cfg.data.val_fraction} must be in (0, 1) "
                         "when validation.enabled = true")
    sources = data_sources(cfg)
    if cfg.kernels.loss == "tokamax" and any(source.format == "chat" for source in sources):
        # The one loss kernel without an ignore index; a traced step could not even check the labels.
        raise ValueError("kernels.loss = tokamax cannot skip the untrained tokens of format = chat (no ignore index); "
                         "use --kernels.loss chunked")
    check_kind(cfg, sources)  # what the kind of training needs (kinds/)
    _check_fault_tolerance(cfg)
    _check_evaluation(cfg)
    _check_pipeline(cfg, spec)
    if t.device == "cpu":  # with auto, the trainer checks once it knows the device
        check_cpu_compute_dtype(cfg.model.dtype)
    return RunSetup(cfg=cfg, spec=spec, sources=sources, warmup_steps=warmup_steps)


def _check_jax_path(cfg: Config) -> None:
    """What compile.backend jax runs in graph mode (graph/jax_step.py): the captured step as one
    program, on a TPU or this CPU; JAX itself is checked when the run starts (device.py jax_backend)."""
    t = cfg.training
    if t.device not in ("tpu", "cpu", "auto"):
        raise ValueError(f"compile.backend jax runs on a TPU or this CPU; training.device is {t.device}: set it to tpu "
                         "or cpu, or use --compile.backend inductor on a GPU")
    if cfg.compile.split != "none":
        raise ValueError(f"compile.split = {cfg.compile.split}: compile.backend jax hands XLA the whole step as one "
                         "program (XLA schedules its collectives); set compile.split none")


def _check_fp8_experts(cfg: Config) -> None:
    """fp8.experts converts the native MoE's experts (models/fp8.py); the Transformers backend runs
    transformers' own experts, whose matmuls it cannot reach."""
    if cfg.fp8.enabled and cfg.fp8.experts and cfg.model.name == "hf":
        raise ValueError("fp8.experts converts a native MoE model's experts; the Transformers backend runs "
                         "transformers' own: set fp8.experts false (its linears still run in fp8)")


def _check_lora(cfg: Config) -> None:
    """The options LoRA cannot run with (its own ranges: config.py; the layer checks come with the
    model: models/lora.py)."""
    lora = cfg.lora
    if not lora.enabled:
        return
    if cfg.parallelism.tp > 1:
        raise ValueError(f"lora.enabled needs parallelism.tp = 1 (got {cfg.parallelism.tp}): the adapters of a split "
                         "layer are not split yet; use data parallelism")
    if lora.dropout > 0 and cfg.training.mode == "graph":
        raise ValueError(f"lora.dropout = {lora.dropout} needs training.mode = eager (the captured step has no "
                         "dropout); set lora.dropout 0")


def _check_fault_tolerance(cfg: Config) -> None:
    """What replica groups need (docs/fault_tolerance.md; the ranks of a group: components/build.py)."""
    if not cfg.fault_tolerance.enabled:
        return
    if cfg.training.mode != "eager":
        raise ValueError("fault_tolerance.enabled averages gradients between backward and the optimizer, outside the "
                         "captured step: set --training.mode eager")
    if cfg.parallelism.dp_replicate > 1:
        raise ValueError(f"parallelism.dp_replicate = {cfg.parallelism.dp_replicate} replicates inside one job; with "
                         "fault_tolerance.enabled the replica groups are separate jobs (fault_tolerance.replicas): set "
                         "parallelism.dp_replicate 1")


def _check_evaluation(cfg: Config) -> None:
    """[evaluation] tasks: lm-eval installed, and a mesh whose ranks each score whole requests (the
    data-parallel axes; tp, cp and ep split one request's forward across ranks)."""
    if not cfg.evaluation.tasks:
        return
    from titan_tpu.extras import require_lm_eval

    require_lm_eval("evaluation.tasks")
    p = cfg.parallelism
    split = {key: getattr(p, key) for key in ("tp", "cp", "ep", "pp") if getattr(p, key) > 1}
    if split:
        got = ", ".join(f"parallelism.{key} = {size}" for key, size in split.items())
        raise ValueError(f"evaluation.tasks scores on the data-parallel ranks alone and this run has {got}; score its "
                         "checkpoints with `titan-tpu eval --tasks` instead, or set them to 1")
    if cfg.fault_tolerance.enabled:
        raise ValueError("evaluation.tasks does not run with replica groups (fault_tolerance.enabled) yet; score the "
                         "checkpoints with `titan-tpu eval --tasks` instead")


def _check_pipeline(cfg: Config, spec: ModelSpec) -> None:
    """parallelism.pp > 1 (parallel/pipeline.py): a native dense model's one scanned stack, next-token
    training without LoRA, and a schedule that divides the batch (layers that do not divide into its
    chunks are padded: parallel/pipeline.py); one line each."""
    p, t = cfg.parallelism, cfg.training
    if p.pp_microbatches < 0 or p.pp_repeats < 1:
        raise ValueError(f"parallelism.pp_microbatches = {p.pp_microbatches} must be >= 0 (0: pp of them) and "
                         f"parallelism.pp_repeats = {p.pp_repeats} >= 1")
    if p.pp <= 1:
        return
    from titan_tpu.parallel.pipeline import PipelineSchedule

    if spec.kind != "native":
        raise ValueError("parallelism.pp > 1 splits a native model's scanned layer stack into stages; the Transformers "
                         "backend (model.name hf) runs the model's own module tree, which has no stack to split: use "
                         "pp 1 (or the native family of the model)")
    args = spec.args
    if getattr(args, "mtp_num_layers", 0):
        raise ValueError(f"parallelism.pp > 1 with multi-token prediction is not built yet ({spec.label}'s MTP depths "
                         "read the last stage's hidden states and the embedding outside the stages' chain): use pp 1")
    from titan_tpu.parallel.pipeline import pipelined_layers

    ahead = args.n_layers - pipelined_layers(args)
    if any(args.is_moe_layer(i) for i in range(ahead)):
        raise ValueError(f"parallelism.pp > 1 splits a model's last run of identical layers and runs the dense layers "
                         f"ahead of it on every stage; {spec.label}'s first {ahead} layers hold MoE layers: use pp 1")
    if not cfg.model.scan_layers:
        raise ValueError("parallelism.pp > 1 splits the scanned layer stack into stages: set --model.scan_layers true")
    if cfg.lora.enabled:
        raise ValueError("parallelism.pp > 1 with lora.enabled is not built yet (the stages' chains start from the "
                         "embedding, which LoRA freezes): use pp 1 for LoRA runs")
    schedule = PipelineSchedule.from_config(p, n_layers=pipelined_layers(args))
    if t.batch_size % schedule.micro_batches:
        raise ValueError(f"training.batch_size = {t.batch_size} rows do not split into parallelism.pp_microbatches = "
                         f"{schedule.micro_batches} equal micro-batches; make the batch a multiple of it")
