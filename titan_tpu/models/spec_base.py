"""The model spec's interface: what every model kind answers (`ModelSpec`), implemented by
`NativeSpec` (models/spec.py) and `HFSpec` (models/hf/spec.py). A module of its own so both
implementations build on it and models/spec.py, which picks between them, imports them without a
cycle."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_tpu.config import Config, ModelConfig
    from titan_tpu.data.batch import ImageInputs
    from titan_tpu.kernels import KernelConfig
    from titan_tpu.model_contract import TrainableModel
    from titan_tpu.models.hub.sources import TensorSource
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.pipeline import PipelineSchedule

Log = Callable[[str], None]


class ModelSpec(ABC):
    """One model kind's answers. `args` has at least vocab_size, max_seq_len and moe (None for
    models without our MoE machinery); checkpoints store it as a dict beside `name`."""

    name: str  # model.name: what checkpoints record and resume checks compare
    args: Any  # TransformerArgs for native models, HFArgs for the HF backend
    label: str  # how messages name the model: llama3/debug, hf:<hf_config>
    plannable: bool  # titan-tpu plan has terms for its layers (our Transformer's)
    kind: str  # how reports name the backend that runs it: native | hf

    def check(self, cfg: Config) -> None:
        """Checks of other config sections that depend on the model kind (run.setup.prepare_run)."""

    @abstractmethod
    def check_expert_parallel(self, ep: int) -> None:
        """A one-line ValueError when `--parallelism.ep ep` (> 1) cannot spread this model's experts."""

    @abstractmethod
    def build_on_meta(self, cfg: Config, *, mesh: DeviceMesh | None, parallel_dims: ParallelDims,
                      documents: bool, kernels: KernelConfig | None = None,
                      pipeline: PipelineSchedule | None = None) -> TrainableModel:
        """The model on the meta device with `kernels` (default the config's), its pipeline and
        tensor/context-parallel layout applied when the mesh has those axes (`parallelize`):
        `parallel.simple_fsdp.materialize_and_init` materialises it next."""

    def parallelize(self, model: TrainableModel, cfg: Config, *, mesh: DeviceMesh | None,
                    parallel_dims: ParallelDims, documents: bool, pipeline: PipelineSchedule | None = None) -> None:
        """Apply the model's tensor- and context-parallel layout (the spec owns tp and cp for its
        model; SimpleFSDP's data-parallel axes come after, generic). The default has none: a kind
        without one refuses tp and cp in `check`."""

    def finish(self, model: TrainableModel, *, log: Log, own_weights: bool = True) -> None:
        """After initialisation: what the model's own files or checks add (the HF backend loads
        the weights of its directory unless `own_weights` is False)."""

    @abstractmethod
    def flops_per_token(self, model: TrainableModel, seq_len: int, *, images: ImageInputs | None = None
                        ) -> tuple[float, str]:
        """(model FLOPs per trained token, a note on how they were counted; "" for the formula).
        `images`: a batch's image slots (a vision-language model's rows), whose vision work counts too."""

    def own_weights_path(self) -> Path | None:
        """The weights that come with the model (an HF directory's), which `finish` loads, if any."""
        return None

    def own_tokenizer_path(self) -> str | None:
        """The tokenizer that comes with the model (an HF directory's tokenizer.json), if any."""
        return None

    def image_model_dir(self) -> Path | None:
        """The directory of a vision-language model, whose processor renders image-text rows; None
        for a text-only model."""
        return None

    def tokenizer_path(self, cfg: Config) -> str | None:
        """data.tokenizer_path, else the model's own tokenizer, else None (train a BPE)."""
        return cfg.data.tokenizer_path or self.own_tokenizer_path()

    @abstractmethod
    def load_hf_weights(self, model: TrainableModel, hf_dir: Path) -> None:
        """Copy the weights of a Hugging Face directory into `model` (plain or sharded)."""

    @abstractmethod
    def save_hf(self, state_dict: dict[str, torch.Tensor], hf_dir: Path, *, overwrite: bool) -> Path:
        """Write a full state dict (our names) as a Hugging Face directory that from_pretrained loads."""

    def export_hf(self, sources: dict[str, TensorSource], hf_dir: Path, *, dtype: torch.dtype, overwrite: bool) -> Path:
        """`save_hf` of weights given as sources (a checkpoint read lazily, models/hub/sources.py), in
        `dtype`. Here every weight is read into memory first; a spec that can write tensor by tensor
        (the native one) streams them instead."""
        from titan_tpu.models.hub.sources import full_index

        state_dict = {key: source.read(full_index(source.shape)).to(dtype) for key, source in sources.items()}
        return self.save_hf(state_dict, hf_dir, overwrite=overwrite)


    @abstractmethod
    def hf_adapters(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """LoRA adapters by our state-dict name -> by the module names of the transformers model
        (`model.layers.0.self_attn.q_proj.lora_A`), in its layout: what a peft export holds."""


def moe_options_changed(model: ModelConfig, prefix: str = "moe_") -> list[str]:
    """The model.moe_* options (or those named `prefix`*) set to other than their defaults. The
    defaults come from the config's own class, so this layer need not import config.py (which
    sits above it)."""
    defaults = type(model)()
    return [f.name for f in dataclasses.fields(model)
            if f.name.startswith(prefix) and getattr(model, f.name) != getattr(defaults, f.name)]
