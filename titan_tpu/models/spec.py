"""The model spec: what the rest of the project asks about the configured model, answered once.

`model_spec(cfg.model)` resolves the [model] section into one object that knows the model's
args, how messages name it, how to build it on the meta device (parallelized on a mesh or not),
its FLOPs per token, its own tokenizer and where its HF weights come from. The trainer, the
config checks and the planner ask the spec; they never ask which kind of model runs.

Two kinds implement the interface (`ModelSpec`, models/spec_base.py):

* `NativeSpec` (this file): llama3, qwen3, qwen3_moe, our `Transformer` with a flavor of the
  registry's table; HF directories are read through the native <-> HF adapter (hf_checkpoint).
* `HFSpec` (models/hf_spec.py): ``model.name = hf``, any transformers causal LM.

What a built model then offers the trainer, SimpleFSDP and graph capture is the model contract,
`titan_tpu.model_contract.TrainableModel`, which both model classes satisfy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.spec_base import ModelSpec, moe_options_changed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_tpu.config import Config, ModelConfig
    from titan_tpu.model_contract import TrainableModel
    from titan_tpu.parallel.mesh import ParallelDims


def model_spec(model: ModelConfig) -> ModelSpec:
    """The spec of a [model] section; raises a one-line ValueError on options that do not apply
    to the model (MoE options of a dense model, hf_config of a native one) or an unknown flavor."""
    if model.name == "hf":
        from titan_tpu.models.hf_spec import hf_spec

        return hf_spec(model)
    return native_spec(model)


def checkpoint_spec(model_name: str, model_args: dict) -> ModelSpec:
    """The spec of a checkpoint's model, from the name and args it records (no config needed:
    titan-tpu convert)."""
    if model_name == "hf":
        from titan_tpu.models.hf_spec import HFSpec

        return HFSpec.of_args(model_args)
    args = TransformerArgs(**model_args)  # rope_scaling may stay a dict: __post_init__ converts it
    return NativeSpec(name=model_name, args=args, label=model_name)


# ---------------------------------------------------------------------------------------------
# Native models: llama3, qwen3, qwen3_moe
# ---------------------------------------------------------------------------------------------


def native_spec(model: ModelConfig) -> NativeSpec:
    """The flavor's TransformerArgs with the config's model options applied (MoE balancing)."""
    from titan_tpu.models.registry import get_model_args

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
    return NativeSpec(name=model.name, args=args, label=label)


@dataclass
class NativeSpec(ModelSpec):
    name: str
    args: TransformerArgs
    label: str
    plannable: bool = True

    def build_on_meta(self, cfg: Config, *, mesh: DeviceMesh | None, parallel_dims: ParallelDims,
                      documents: bool) -> Transformer:
        from titan_tpu.parallel.context_parallel import context_parallel
        from titan_tpu.parallel.tensor_parallel import tensor_parallel

        seq_len = cfg.training.seq_len
        # The RoPE table only needs the training length (a published 128K table is ~134 MB for 8B);
        # checkpoints keep the flavor's own args so exports carry the real max_seq_len.
        args = dataclasses.replace(self.args, max_seq_len=seq_len)
        with torch.device("meta"):
            model = Transformer(args, scan_layers=cfg.model.scan_layers, ac_mode=cfg.activation_checkpoint.mode,
                                kernels=cfg.kernels)
        if parallel_dims.tp > 1:
            tensor_parallel(model, mesh, seq_len=seq_len)
        if parallel_dims.cp > 1:
            context_parallel(model, mesh, seq_len=seq_len, documents=documents)
        return model

    def flops_per_token(self, model: TrainableModel, seq_len: int) -> tuple[float, str]:
        from titan_tpu.models.registry import flops_per_token

        return flops_per_token(self.args, seq_len), ""

    @torch.no_grad()
    def load_hf_weights(self, model: TrainableModel, hf_dir: Path) -> None:
        """Through the native <-> HF adapter (names, fused experts, RoPE layout); every tensor's
        name and shape is checked before any is copied."""
        from titan_tpu.models.hf_checkpoint import load_hf_checkpoint
        from titan_tpu.models.lora import is_adapter_key
        from titan_tpu.tensors import copy_full_

        _, _, weights = load_hf_checkpoint(hf_dir)
        own = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}  # HF holds the base
        for key, value in own.items():
            if key not in weights or weights[key].shape != value.shape:
                got = tuple(weights[key].shape) if key in weights else "nothing"
                raise ValueError(f"checkpoint.initial_load_path {hf_dir} does not fit {self.label}: {key} should be "
                                 f"{tuple(value.shape)}, found {got}")
        extra = sorted(set(weights) - set(own))
        if extra:
            raise ValueError(f"checkpoint.initial_load_path {hf_dir} has tensors the model lacks, e.g. {extra[0]}")
        for key, value in own.items():
            copy_full_(value, weights[key])  # every rank read the file: each keeps its shard

    def save_hf(self, state_dict: dict[str, torch.Tensor], hf_dir: Path, *, overwrite: bool) -> Path:
        """Through the native <-> HF adapter, in safetensors shards (models/hf_checkpoint.py)."""
        from titan_tpu.models.hf_checkpoint import save_hf_checkpoint

        return save_hf_checkpoint(hf_dir, name=self.name, args=self.args, state_dict=state_dict, overwrite=overwrite)

    def hf_adapters(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Through the native <-> HF adapter: HF names, B's rows in HF's RoPE layout."""
        from titan_tpu.models.hf_adapter import adapters_to_hf

        return adapters_to_hf(adapters, self.args)
