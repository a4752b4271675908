"""The model contract: what the trainer, SimpleFSDP, graph capture and checkpoints need from a model.

Two classes satisfy it today: the native `Transformer` (models/common/transformer.py: llama3,
qwen3, qwen3_moe, deepseek_v3) and `HFCausalLM` (models/hf/model.py: any transformers causal LM).
Besides `TrainableModel`'s methods and the `LossOutput` that `model(tokens, labels)` returns, the
contract holds the attributes a model sets on its modules and SimpleFSDP (parallel/simple_fsdp.py)
reads, or SimpleFSDP sets and the model reads: `EXPERT_MARKER`, `STACKED_MARKER`,
`PER_LAYER_GATHER` (with `stored_weights`, what a gather is handed), and pipeline stages'
`STAGE_ROWS` and `WHOLE_ON_STAGES`. Both sides import them from
here, so SimpleFSDP, generic over models, imports nothing of models/. Everything else they read is
`nn.Module`'s own (named_parameters, state_dict, train/eval).

Code that works on any module (parallel/, graph/, train/) asks ``isinstance(model, TrainableModel)``
where it works for plain modules too (a test's two-layer MLP under SimpleFSDP): a plain module
has no init plan and no expert biases. This file imports nothing of the project, so any layer
may read it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = ["EXPERT_MARKER", "PER_LAYER_GATHER", "STACKED_MARKER", "STAGE_ROWS", "WHOLE_ON_STAGES", "GradientReducer",
           "InitPiece", "LossOutput", "TrainableModel", "gradient_reducer", "stored_weights"]

# Attribute set to True on modules holding expert weights (models/common/moe.py; transformers' stacked
# experts: models/hf/model.py): SimpleFSDP reads it to lay them out for expert parallelism.
EXPERT_MARKER = "_expert_weights"

# Attribute set to True on every module holding stacked weights (models/common/scan.py): SimpleFSDP
# reads it to shard those weights on dim 1.
STACKED_MARKER = "_layer_stacked"

# Attribute a data-parallel wrapper (parallel/simple_fsdp.py) sets on a block, or on a scanned
# stack, whose weights it wants gathered inside the block's own computation rather than when read
# as attributes: an object with `local(stored) -> tensors` (once per forward; for a stack, the
# local shards [L, ...] the loop slices) and `gather(tensors) -> compute tensors` (one block's or
# one layer's). The model calls the block as a function of `gather(...)` inside the checkpointed
# region or the loop body, so a recomputation or each iteration gathers what it uses.
PER_LAYER_GATHER = "per_layer_gather"

# Attribute pipeline parallelism (parallel/pipeline.py) sets on a scanned stack split over its
# stages: a function of a stacked tensor giving (row, that row's tensor) for the rows this rank
# holds, each a view into the stack, as the per-layer state dict names them.
STAGE_ROWS = "stage_rows"

# Attribute pipeline parallelism sets to True on every module of a scanned stack that every stage
# holds whole (the dense layers ahead of DeepSeek-V3's pipelined MoE stack): SimpleFSDP reads it to
# keep the stack's layer dim whole on pp (replicated there, its gradient summed over the stages).
WHOLE_ON_STAGES = "_whole_on_stages"


def stored_weights(module: nn.Module, names: list[str]) -> list[Tensor]:
    """`module`'s parameters (and persistent buffers) `names` as stored, not as read: under data
    parallelism the sharded parameters themselves, which `PER_LAYER_GATHER` gathers."""
    out = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        out.append(sub._parameters[leaf] if leaf in sub._parameters else sub._buffers[leaf])
    return out


class LossOutput(NamedTuple):
    """What `model(tokens, labels)` returns: the step's loss pieces, computed beside each other."""

    ce_sum: torch.Tensor  # summed next-token cross-entropy (0-dim fp32); the step divides it
    aux_loss: torch.Tensor  # MoE balancing loss, coefficient applied (0-dim fp32; 0 for dense)
    expert_load: torch.Tensor  # tokens routed to each expert per MoE layer [L_moe, E] ([0, 0] for dense)
    # Multi-token prediction (models/common/mtp.py): its cross-entropy summed over its targets, the
    # mean over depths (0-dim fp32; None without MTP), and the weight the step trains it with.
    mtp_ce_sum: torch.Tensor | None = None
    mtp_weight: float = 0.0


InitPiece = tuple[str, nn.Module, Callable[[], None]]


class GradientReducer(Protocol):
    """The sums a model's own parallel layout needs of its gradients after the backward, before
    clipping: pipeline stages (parallel/pipeline.py `PipelineStage`) sum over pp the gradients of the
    weights every stage holds whole, each stage having the part of its own uses. The step calls it
    beside `grad_sync` (replica groups' averaging): eager in place, captured as new tensors."""

    def sum_(self, grads: dict[str, torch.Tensor]) -> None:
        """In place, in `grads`' order (the eager step)."""
        ...

    def summed(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As new tensors, with functional collectives (the captured step)."""
        ...


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

    # --- gradients (train/step.py, graph/capture.py) ------------------------------------------

    def gradient_reducer(self) -> GradientReducer | None:
        """What sums gradient parts its own parallel layout split (pipeline stages), or None."""
        ...

    # --- routing statistics (loops/routing.py) ------------------------------------------------

    def expert_load_layers(self) -> list[int]:
        """The transformer block of each row of `LossOutput.expert_load`, in row order (blocks after
        the main model's, as multi-token prediction's, numbered on from n_layers): the metrics name
        an MoE layer by its block, as checkpoints do. [] for a model that reports no expert loads."""
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


def gradient_reducer(model: nn.Module) -> GradientReducer | None:
    """The model's `GradientReducer`; None for a model without one (or a plain module: a test's MLP)."""
    return model.gradient_reducer() if isinstance(model, TrainableModel) else None
