"""The model contract: what the trainer, SimpleFSDP, graph capture and checkpoints need from a model.

Two classes satisfy it today: the native `Transformer` (models/common/transformer.py: llama3,
qwen3, qwen3_moe) and `HFCausalLM` (models/hf/model.py: any transformers causal LM).
Everything else they read is `nn.Module`'s own (named_parameters, state_dict, train/eval).

Code below the models (parallel/, graph/, train/) asks ``isinstance(model, TrainableModel)``
where it works for plain modules too (a test's two-layer MLP under SimpleFSDP): a plain module
has no init plan and no expert biases. This file imports nothing of the project, so any layer
may read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from titan_tpu.models.common.transformer import LossOutput

InitPiece = tuple[str, nn.Module, Callable[[], None]]


@runtime_checkable
class TrainableModel(Protocol):
    """A language model the trainer can shard, initialise, step and checkpoint."""

    def __call__(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None, *,
                 positions_BS: torch.Tensor | None = None, per_sequence: bool = False) -> torch.Tensor | LossOutput:
        """Logits without labels; with labels, the summed cross-entropy (per row with per_sequence:
        preference objectives), balancing loss and per-layer expert loads (`LossOutput`), so the
        loss kernel may skip the logits."""
        ...

    # --- initialisation (parallel/simple_fsdp.materialize_and_init) ---------------------------

    def init_plan(self) -> list[InitPiece]:
        """(name, piece, init) in the single-process init order: sharded init materialises one
        piece at a time, and SimpleFSDP buckets and re-shards by these pieces."""
        ...

    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (one device, after to_empty)."""
        ...

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the non-persistent buffers (RoPE tables) on `device`."""
        ...

    # --- checkpoint layout -------------------------------------------------------------------

    def stacked_parameter_names(self) -> set[str]:
        """Parameters holding all layers stacked on dim 0 (scan_layers): weight decay and the
        per-layer checkpoint layout treat them per layer."""
        ...

    def to_per_layer(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors named like the parameters, as the per-layer names checkpoints use."""
        ...

    def from_per_layer(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of `to_per_layer`."""
        ...

    # --- auxiliary-loss-free MoE balancing (train/step.py, graph/capture.py) ------------------

    def expert_bias_names(self) -> list[str]:
        """Buffers the step moves by the expert loads ([] for models without them)."""
        ...

    def updated_expert_biases(self, biases: dict[str, torch.Tensor],
                              expert_load_LE: torch.Tensor) -> dict[str, torch.Tensor]:
        """New values of `expert_bias_names()` after a step with these global loads; pure, so a
        captured step traces it."""
        ...
