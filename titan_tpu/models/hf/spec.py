"""The model spec of the Transformers backend (``model.name = hf``): see models/spec.py."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_tpu.models.hf.config import HFArgs, auto_model_class, hf_args_from_spec
from titan_tpu.models.hf.flops import hf_flops_per_token
from titan_tpu.models.hf.model import PREFIX, HFCausalLM, build_hf_model
from titan_tpu.models.hf.weights import export_hf, has_weights, load_pretrained_weights
from titan_tpu.models.spec_base import Log, ModelSpec, moe_options_changed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_tpu.config import Config, ModelConfig
    from titan_tpu.data.batch import ImageInputs
    from titan_tpu.kernels import KernelConfig
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.pipeline import PipelineSchedule


def hf_spec(model: ModelConfig) -> HFSpec:
    changed = moe_options_changed(model)
    if changed:
        raise ValueError(f"model.{changed[0]} applies to qwen3_moe; an hf model balances its experts as its "
                         "config says (output_router_logits, router_aux_loss_coef; set them with "
                         "--model.hf_overrides): remove it")
    return HFSpec(name=model.name, args=hf_args_from_spec(model.hf_config, model.hf_overrides),
                  label=f"hf:{model.hf_config}", hf_config=model.hf_config)


@dataclass
class HFSpec(ModelSpec):
    name: str
    args: HFArgs
    label: str
    hf_config: str  # model.hf_config: a directory (its weights and tokenizer are used) or a model_type
    # The layers are transformers' own code, which the planner has no formula terms for: it plans the
    # model by measuring it on the meta device instead (plan/hf_terms.py), and holds what an hf model
    # cannot change (pipeline stages, scanned layers).
    plannable: bool = False
    kind: str = "hf"

    @classmethod
    def of_dir(cls, hf_dir: str | Path, overrides: str = "") -> HFSpec:
        """The spec of a Hugging Face directory the Transformers backend runs (model.hf_overrides
        applied)."""
        hf_config = str(hf_dir)
        return cls(name="hf", args=hf_args_from_spec(hf_config, overrides), label=f"hf:{hf_config}",
                   hf_config=hf_config)

    @classmethod
    def of_args(cls, model_args: dict) -> HFSpec:
        """The spec of a checkpoint's HF-backend model (its HFArgs as a dict)."""
        return cls.of_hf_args(HFArgs(**model_args))

    @classmethod
    def of_hf_args(cls, args: HFArgs) -> HFSpec:
        return cls(name="hf", args=args, label=f"hf:{args.hf_config}", hf_config=args.hf_config)

    def check(self, cfg: Config) -> None:
        if cfg.model.mtp_num_layers:
            raise ValueError("model.mtp_num_layers (multi-token prediction) needs --model.name deepseek_v3; the hf "
                             "backend runs transformers' model, which has none: set it to 0")
        if cfg.model.scan_layers:
            raise ValueError("model.scan_layers needs a native model (llama3, qwen3, qwen3_moe); an hf model runs "
                             "its own layer loop: set model.scan_layers false")
        if cfg.parallelism.tp > 1 or cfg.parallelism.cp > 1:
            raise ValueError("--parallelism.tp or cp > 1 is not supported with --model.name hf (the Transformers "
                             "backend); set tp 1 and cp 1 or use a native model")

    def check_expert_parallel(self, ep: int) -> None:
        """Decided on the model built on the meta device (no memory): transformers' stacked experts
        only (models/hf/hooks.py `expert_parallel_refusal`)."""
        from titan_tpu.models.hf.hooks import expert_parallel_refusal

        config = self.args.transformers_config()
        with torch.device("meta"):
            hf_model = auto_model_class(config).from_config(config)
        reason = expert_parallel_refusal(hf_model, ep)
        if reason is not None:
            raise ValueError(reason)

    def build_on_meta(self, cfg: Config, *, mesh: DeviceMesh | None, parallel_dims: ParallelDims,
                      documents: bool, kernels: KernelConfig | None = None,
                      pipeline: PipelineSchedule | None = None) -> HFCausalLM:
        return build_hf_model(self.args, kernels=cfg.kernels if kernels is None else kernels,
                              ac_mode=cfg.activation_checkpoint.mode, dtype=torch.float32,
                              train_vision=cfg.model.train_vision)

    def finish(self, model: HFCausalLM, *, log: Log, own_weights: bool = True) -> None:
        """The directory's weights when it has them (and `own_weights`); then whether the chunked
        loss kernel may replace the model's logits (decided on the real weights)."""
        if own_weights and has_weights(self.hf_config):
            load_pretrained_weights(model, self.hf_config)
            log(f"weights loaded from {self.hf_config}")
        loss = "the chunked loss kernel" if model.check_chunked_loss(self.args.vocab_size) else "the model's own logits"
        log(f"loss: {loss} ({model.chunked_loss_reason})")

    def flops_per_token(self, model: HFCausalLM, seq_len: int, *, images: ImageInputs | None = None
                        ) -> tuple[float, str]:
        return hf_flops_per_token(model, seq_len, images=images)

    def own_weights_path(self) -> Path | None:
        return Path(self.hf_config).expanduser() if has_weights(self.hf_config) else None

    def image_model_dir(self) -> Path | None:
        from titan_tpu.models.hf.vision import is_vision_language

        return Path(self.hf_config).expanduser() if is_vision_language(self.args.transformers_config()) else None

    def own_tokenizer_path(self) -> str | None:
        candidate = Path(self.hf_config).expanduser() / "tokenizer.json"
        return str(candidate) if candidate.is_file() else None

    def load_hf_weights(self, model: HFCausalLM, hf_dir: Path) -> None:
        """transformers reads the directory itself, so its checkpoint conversions apply."""
        load_pretrained_weights(model, hf_dir)

    def hf_adapters(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names are transformers' own under the wrapper's prefix."""
        return {name[len(PREFIX):]: t for name, t in adapters.items()}

    def save_hf(self, state_dict: dict[str, torch.Tensor], hf_dir: Path, *, overwrite: bool) -> Path:
        """transformers writes its own layout (save_pretrained) into a fresh sibling directory that
        then replaces `hf_dir`: an interrupted export never leaves a half-written directory where a
        complete one was."""
        if hf_dir.exists() and not hf_dir.is_dir():
            raise FileExistsError(f"{hf_dir} exists and is not a directory; choose another path")
        if hf_dir.is_dir() and any(hf_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{hf_dir} already exists and is not empty; pass --overwrite or choose another "
                                  "directory")
        staging = hf_dir.with_name(f".{hf_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
        export_hf(self.args, state_dict, staging)
        if hf_dir.exists():
            old = hf_dir.with_name(f".{hf_dir.name}.old-{uuid.uuid4().hex[:8]}")
            hf_dir.rename(old)
            staging.rename(hf_dir)
            shutil.rmtree(old)
        else:
            staging.rename(hf_dir)
        return hf_dir
