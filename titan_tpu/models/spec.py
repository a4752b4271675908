"""The model spec: what the rest of the project asks about the configured model, answered once.

`model_spec(cfg.model)` resolves the [model] section into one object that knows the model's
args, how messages name it, how to build it on the meta device (parallelized on a mesh or not),
its FLOPs per token, its own tokenizer and where its HF weights come from. The trainer, the
config checks and the planner ask the spec; they never ask which kind of model runs.

This module is the dispatch: the one place that picks a kind (`model_spec` from a [model]
section, `checkpoint_spec` from a checkpoint's record, `spec_for_hf_dir` from a Hugging Face
directory), and `build`, the one way every caller (trainer, eval, verify, hf-sweep, the planner's
calibration) turns a spec into a model.

Two kinds implement the interface (`ModelSpec`, models/spec_base.py):

* `NativeSpec` (this file): llama3, qwen3, qwen3_moe, our `Transformer` with a flavor of the
  registry's table; HF directories are read through the native <-> HF adapter (models/hub/).
* `HFSpec` (models/hf/spec.py): ``model.name = hf``, any transformers causal LM.

What a built model then offers the trainer, SimpleFSDP and graph capture is the model contract,
`titan_tpu.model_contract.TrainableModel`, which both model classes satisfy.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.spec_base import Log, ModelSpec, moe_options_changed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_tpu.config import Config, ModelConfig
    from titan_tpu.data.batch import ImageInputs
    from titan_tpu.kernels import KernelConfig
    from titan_tpu.model_contract import TrainableModel
    from titan_tpu.models.hub.sources import TensorSource
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.pipeline import PipelineSchedule
    from titan_tpu.parallel.simple_fsdp import MixedPrecision


def model_spec(model: ModelConfig) -> ModelSpec:
    """The spec of a [model] section; raises a one-line ValueError on options that do not apply
    to the model (MoE options of a dense model, hf_config of a native one) or an unknown flavor."""
    if model.name == "hf":
        from titan_tpu.models.hf.spec import hf_spec

        return hf_spec(model)
    return native_spec(model)


def checkpoint_spec(model_name: str, model_args: dict) -> ModelSpec:
    """The spec of a checkpoint's model, from the name and args it records (no config needed:
    titan-tpu convert)."""
    if model_name == "hf":
        from titan_tpu.models.hf.spec import HFSpec

        return HFSpec.of_args(model_args)
    args = TransformerArgs(**model_args)  # rope_scaling may stay a dict: __post_init__ converts it
    return NativeSpec(name=model_name, args=args, label=model_name)


def spec_for_hf_dir(hf_dir: str | Path, *, native_only: bool = False, overrides: str = "") -> ModelSpec:
    """The spec of a Hugging Face directory's model: native where the adapter reads its config
    (Llama, Qwen3, Qwen3-MoE without unsupported features), else the Transformers backend on the
    directory (with model.hf_overrides). `native_only`: the adapter's one-line error instead of the
    fallback."""
    from titan_tpu.models.hub.adapter import model_args_from_hf_config

    try:
        name, args = model_args_from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    except (ValueError, KeyError, TypeError):
        if native_only:
            raise
        from titan_tpu.models.hf.spec import HFSpec

        return HFSpec.of_dir(hf_dir, overrides)
    return NativeSpec(name=name, args=args, label=name)


def spec_for_weights(model: ModelConfig, hf_dir: str | Path) -> ModelSpec:
    """The spec that runs an HF directory's weights for a [model] section: a native name takes
    them through the adapter (its error when the adapter cannot read them); hf takes the directory
    natively when it can, else through the Transformers backend."""
    return spec_for_hf_dir(hf_dir, native_only=model.name != "hf", overrides=model.hf_overrides)


def build(spec: ModelSpec, cfg: Config, *, device: torch.device | str, seed: int, mesh: DeviceMesh | None = None,
          parallel_dims: ParallelDims | None = None, expert_mesh: DeviceMesh | None = None,
          mp: MixedPrecision | None = None, documents: bool = False, own_weights: bool = True,
          reshard_after_forward: bool | None = None, bucket_mb: float | None = None,
          pipeline: PipelineSchedule | None = None, kernels: KernelConfig | None = None,
          log: Log = lambda message: None) -> TrainableModel:
    """The one way a spec becomes a model: built on the meta device (tensor/context parallel
    when the mesh has those axes, pipeline stages with `pipeline`), materialised and initialised from
    `seed` piece by piece (sharded when there is a mesh, computed in `mp.param_dtype`), then finished
    by the spec (an HF directory's own weights unless `own_weights` is False; the chunked-loss check).

    The execution options come from `cfg` (model.scan_layers, activation_checkpoint.mode, the model
    converters: models/converters.py, lora then fp8; training.seq_len, a native model's RoPE table
    length) and from the run's resolution where it decided them (run/resolved.py: a training run and
    `titan-tpu compile` pass them all): `kernels` (default the config's), `bucket_mb` and
    `reshard_after_forward` (default the config's, with auto as true), `pipeline`. Without a mesh the
    model is plain, on one device."""
    from titan_tpu.models.converters import enabled_converters
    from titan_tpu.parallel.expert_parallel import make_dispatch
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import materialize_and_init

    dims = parallel_dims or ParallelDims(world_size=1)
    if dims.pp > 1 and pipeline is None:
        raise ValueError("a model split into pipeline stages is built from its run's schedule (run/resolved.py); "
                         "pass pipeline=")
    model = spec.build_on_meta(cfg, mesh=mesh, parallel_dims=dims, documents=documents,
                               kernels=cfg.kernels if kernels is None else kernels, pipeline=pipeline)
    converters = enabled_converters(cfg)
    for converter in converters:  # before sharding, so what they add is sharded like the rest
        converter.convert(model, cfg)
    p = cfg.parallelism
    model = materialize_and_init(model, mesh, mode=dims.mode if mesh is not None else "none", mp=mp, device=device,
                                 seed=seed, expert_mesh=expert_mesh,
                                 bucket_mb=p.bucket_mb if bucket_mb is None else bucket_mb,
                                 reshard_after_forward=(p.reshard_after_forward != "false"
                                                        if reshard_after_forward is None else reshard_after_forward))
    if expert_mesh is not None:  # how tokens reach their experts (parallelism.ep_dispatch)
        model.expert_dispatch.dispatch = make_dispatch(expert_mesh, p.ep_dispatch)
    for converter in converters:
        converter.after_init(model, cfg, seed=seed)
    spec.finish(model, log=log, own_weights=own_weights)
    return model


# ---------------------------------------------------------------------------------------------
# Native models: llama3, qwen3, qwen3_moe
# ---------------------------------------------------------------------------------------------


def native_spec(model: ModelConfig) -> NativeSpec:
    """The flavor's TransformerArgs with the config's model options applied (MoE balancing)."""
    from titan_tpu.models.registry import FAMILIES, get_model_args

    label = f"{model.name}/{model.flavor}"
    if model.hf_config or model.hf_overrides:
        raise ValueError(f"model.hf_config / model.hf_overrides apply to model.name = hf, not {model.name}: "
                         "remove them or set --model.name hf")
    args = get_model_args(model.name, model.flavor)
    if args.moe is None:
        changed = moe_options_changed(model)
        if changed:
            raise ValueError(f"model.{changed[0]} applies to mixture-of-experts models (qwen3_moe); "
                             f"{label} is dense: remove it")
    else:
        args.moe = dataclasses.replace(args.moe, load_balance=model.moe_load_balance,
                                       aux_loss_coef=model.moe_aux_loss_coef,
                                       bias_update_rate=model.moe_bias_update_rate)
    if model.mtp_num_layers and not FAMILIES[model.name].mtp:
        raise ValueError(f"model.mtp_num_layers (multi-token prediction) applies to deepseek_v3; {label} has no "
                         "MTP layers: set it to 0")
    if model.mtp_num_layers < 0 or model.mtp_loss_scaling_factor < 0:
        raise ValueError(f"model.mtp_num_layers ({model.mtp_num_layers}) and model.mtp_loss_scaling_factor "
                         f"({model.mtp_loss_scaling_factor}) must be >= 0")
    args.mtp_num_layers, args.mtp_loss_scaling_factor = model.mtp_num_layers, model.mtp_loss_scaling_factor
    return NativeSpec(name=model.name, args=args, label=label)


@dataclass
class NativeSpec(ModelSpec):
    name: str
    args: TransformerArgs
    label: str
    plannable: bool = True
    kind: str = "native"

    def check(self, cfg: Config) -> None:
        p = cfg.parallelism
        if self.args.mtp_num_layers and (p.tp > 1 or p.cp > 1):
            raise ValueError("model.mtp_num_layers: multi-token prediction reads the next shard's tokens and is not "
                             "split by tensor or context parallelism: set parallelism.tp and parallelism.cp to 1")

    def check_expert_parallel(self, ep: int) -> None:
        moe = self.args.moe
        if moe is None:
            raise ValueError(f"parallelism.ep = {ep} spreads MoE experts; {self.label} has none: "
                             "remove it or use an MoE model (qwen3_moe, deepseek_v3)")
        if moe.num_experts % ep != 0:
            raise ValueError(f"parallelism.ep = {ep} must divide the {moe.num_experts} experts of {self.label}")

    def build_on_meta(self, cfg: Config, *, mesh: DeviceMesh | None, parallel_dims: ParallelDims,
                      documents: bool, kernels: KernelConfig | None = None,
                      pipeline: PipelineSchedule | None = None) -> Transformer:
        seq_len = cfg.training.seq_len
        # The RoPE table only needs the training length (a published 128K table is ~134 MB for 8B);
        # checkpoints keep the flavor's own args so exports carry the real max_seq_len.
        args = dataclasses.replace(self.args, max_seq_len=seq_len)
        with torch.device("meta"):
            model = Transformer(args, scan_layers=cfg.model.scan_layers, ac_mode=cfg.activation_checkpoint.mode,
                                kernels=cfg.kernels if kernels is None else kernels)
        self.parallelize(model, cfg, mesh=mesh, parallel_dims=parallel_dims, documents=documents, pipeline=pipeline)
        return model

    def parallelize(self, model: Transformer, cfg: Config, *, mesh: DeviceMesh | None, parallel_dims: ParallelDims,
                    documents: bool, pipeline: PipelineSchedule | None = None) -> None:
        """The Transformer's pipeline stages (parallel/pipeline.py, the run's `pipeline` schedule),
        tensor-parallel plan (parallel/tensor_parallel.py `BLOCK_PLAN`) and context-parallel
        attention, on the meta-device model, before it is materialised."""
        from titan_tpu.parallel.context_parallel import context_parallel
        from titan_tpu.parallel.tensor_parallel import tensor_parallel

        if pipeline is not None:
            from titan_tpu.parallel.pipeline import pipeline_stages

            pipeline_stages(model, mesh, pipeline)
        if parallel_dims.tp > 1:
            tensor_parallel(model, mesh, seq_len=cfg.training.seq_len)
        if parallel_dims.cp > 1:
            context_parallel(model, mesh, seq_len=cfg.training.seq_len, documents=documents)

    def flops_per_token(self, model: TrainableModel, seq_len: int, *, images: ImageInputs | None = None
                        ) -> tuple[float, str]:
        from titan_tpu.models.registry import flops_per_token

        return flops_per_token(self.args, seq_len), ""

    @torch.no_grad()
    def load_hf_weights(self, model: TrainableModel, hf_dir: Path) -> None:
        """Through the native <-> HF adapter (names, fused experts, RoPE layout, fp8 dequantised);
        every tensor's name and shape is checked before any is read, and each process reads only
        the blocks of the weights it holds."""
        from titan_tpu.models.hub.checkpoint import hf_native_sources
        from titan_tpu.models.hub.sources import read_block_
        from titan_tpu.models.lora import is_adapter_key

        # Lazily: each process reads the blocks of the weights it holds, nothing else (models/hub/sources.py).
        _, hf_args, weights = hf_native_sources(hf_dir, mtp_num_layers=self.args.mtp_num_layers)
        # What the shapes cannot show: weights computed with another RoPE or norm epsilon run silently wrong.
        for field in ("rope_theta", "rope_scaling", "norm_eps"):
            if getattr(hf_args, field) != getattr(self.args, field):
                raise ValueError(f"checkpoint.initial_load_path {hf_dir} has {field} = {getattr(hf_args, field)}, "
                                 f"{self.label} has {getattr(self.args, field)}: pick the flavor made for those "
                                 "weights (or --model.name hf --model.hf_config DIR: the directory's own config)")
        own = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}  # HF holds the base
        for key, value in own.items():
            if key not in weights or weights[key].shape != value.shape:
                got = tuple(weights[key].shape) if key in weights else "nothing"
                raise ValueError(f"checkpoint.initial_load_path {hf_dir} does not fit {self.label}: {key} should be "
                                 f"{tuple(value.shape)}, found {got}")
        extra = sorted(set(weights) - set(own))
        if extra and all(k.endswith("expert_bias") for k in extra):  # the routers' balancing bias (DeepSeek-V3)
            raise ValueError(f"checkpoint.initial_load_path {hf_dir} carries the routers' balancing bias ({extra[0]}); "
                             "set --model.moe_load_balance expert_bias to train with it")
        if extra:
            raise ValueError(f"checkpoint.initial_load_path {hf_dir} has tensors the model lacks, e.g. {extra[0]}")
        for key, value in own.items():
            read_block_(value, weights[key])

    def save_hf(self, state_dict: dict[str, torch.Tensor], hf_dir: Path, *, overwrite: bool) -> Path:
        """Through the native <-> HF adapter, in safetensors shards (models/hub/checkpoint.py)."""
        from titan_tpu.models.hub.checkpoint import save_hf_checkpoint

        return save_hf_checkpoint(hf_dir, name=self.name, args=self.args, state_dict=state_dict, overwrite=overwrite)

    def export_hf(self, sources: dict[str, TensorSource], hf_dir: Path, *, dtype: torch.dtype, overwrite: bool) -> Path:
        """Streamed: one tensor in memory at a time (models/hub/checkpoint.py `save_hf_sources`)."""
        from titan_tpu.models.hub.checkpoint import save_hf_sources

        return save_hf_sources(hf_dir, name=self.name, args=self.args, sources=sources, dtype=dtype,
                               overwrite=overwrite)

    def hf_adapters(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Through the native <-> HF adapter: HF names, B's rows in HF's RoPE layout."""
        from titan_tpu.models.hub.adapter import adapters_to_hf

        return adapters_to_hf(adapters, self.args)
