"""What one micro-batch holds: typed batches, one class per kind of input.

A step (train/step.py) and its captured form (graph/capture.py) never look inside a batch: the
objective (train/objective.py) reads its fields by name, and the captured step passes a batch
through the graph boundary as the flat list of its tensors (a registered pytree: `flatten` /
`unflatten`, set up by `batch_class`), so a new kind of input (images beside tokens, a reward per
row) is a new class here, the loader that fills it and the objective that reads it, and nothing in
between changes.

* `TokenBatch`: next-token training (pre-training, SFT): inputs, labels (IGNORE_INDEX where a
  token is not trained) and, with document masking, each token's position in its document; for a
  vision-language model its `ImageInputs` (the image slots of each row, static shapes).
* `PreferenceBatch`: preference pairs (DPO, ORPO): a chosen and a rejected `TokenBatch` of the same
  shape, row i of each completing the same prompt; labels mark the completion tokens only.
* `RolloutBatch`: sampled completions (GRPO): prompt + completion rows, targets on the completion
  tokens only, each row's advantage, and the log-probabilities the sampler (old policy) and the
  frozen reference gave each target token.

`as_batch` also takes the plain ``(inputs, labels[, positions])`` tuple that tests and benchmarks
write by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["BATCH_CLASSES", "IGNORE_INDEX", "Batch", "ImageInputs", "PreferenceBatch", "RolloutBatch", "TokenBatch",
           "as_batch", "batch_class", "flatten", "unflatten"]

IGNORE_INDEX = -100  # a label the loss skips (a prompt, padding, a chat turn that is not the assistant's)


BATCH_CLASSES: tuple[type, ...] = ()  # every batch class, registered by `batch_class`


def batch_class(cls: type) -> type:
    """A batch class: a dataclass that is a pytree node whose children are the fields that are set
    (a None field holds no tensor), so the captured step passes it through the graph boundary."""
    global BATCH_CLASSES
    names = [f.name for f in fields(cls)]

    def flatten_fn(b):
        present = tuple(n for n in names if getattr(b, n) is not None)
        return [getattr(b, n) for n in present], present

    def unflatten_fn(values, present):
        return cls(**dict(zip(present, values)))

    pytree.register_pytree_node(cls, flatten_fn, unflatten_fn,
                                serialized_type_name=f"titan_tpu.data.batch.{cls.__name__}")
    BATCH_CLASSES += (cls,)
    return cls


@batch_class
@dataclass(frozen=True)
class ImageInputs:
    """A vision-language batch's images, in static shapes (models/hf/vision.py): M image slots per
    row, every image at one resolution, an empty slot zeros. The k-th image token of a row belongs
    to its slots in order; which fields are set depends on the architecture."""

    pixel_values: Tensor  # [B, M, ...]: each slot's image as the processor lays it out (fp32)
    slots_BM: Tensor  # bool: the slot holds an image
    grid_thw: Tensor | None = None  # Qwen2.5-VL: [B, M, 3] each slot's patch grid (time, height, width)
    positions_3BS: Tensor | None = None  # Qwen2.5-VL: the 3-D rotary positions (time, height, width) of each token
    token_types_BS: Tensor | None = None  # Gemma 3: 1 on image tokens (they attend to their image both ways)
    # What the vision tower would compute from the images' sizes with data-dependent ops, computed by the
    # loader instead (Qwen2.5-VL: rotary positions, attention segments and window order of all slots' patches)
    tower_inputs: dict[str, Tensor] | None = None


@batch_class
@dataclass(frozen=True)
class TokenBatch:
    inputs_BS: Tensor  # token ids
    labels_BS: Tensor  # the next token of each position, IGNORE_INDEX where nothing is trained
    positions_BS: Tensor | None = None  # position within the packed document (restarting at 0); None: one document
    images: ImageInputs | None = None  # a vision-language model's image slots; None: text only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.labels_BS.shape)

    def trained_tokens(self) -> Tensor:
        """Labels the loss trains on (0-dim)."""
        return (self.labels_BS != IGNORE_INDEX).sum()

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TokenBatch:
        return pytree.tree_map(lambda t: t.to(device, non_blocking=non_blocking), self)

    def contiguous(self) -> TokenBatch:
        return pytree.tree_map(lambda t: t.contiguous(), self)


@batch_class
@dataclass(frozen=True)
class PreferenceBatch:
    chosen: TokenBatch  # prompt + chosen completion, labels on the completion only
    rejected: TokenBatch  # prompt + rejected completion, same shape

    @property
    def shape(self) -> tuple[int, int]:
        """(pairs, sequence length)."""
        return self.chosen.shape

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PreferenceBatch:
        return pytree.tree_map(lambda t: t.to(device, non_blocking=non_blocking), self)

    def contiguous(self) -> PreferenceBatch:
        return pytree.tree_map(lambda t: t.contiguous(), self)


@batch_class
@dataclass(frozen=True)
class RolloutBatch:
    inputs_BS: Tensor  # prompt + completion token ids, right-padded
    labels_BS: Tensor  # the next token where it is a completion token (trained), else IGNORE_INDEX
    advantages_B: Tensor  # fp32: each row's reward, normalised within its prompt's group
    old_logps_BS: Tensor  # fp32: log-probability of each label under the policy that sampled it (0 elsewhere)
    ref_logps_BS: Tensor | None = None  # fp32: the same under the frozen reference; None without a KL penalty

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.labels_BS.shape)

    def trained_tokens(self) -> Tensor:
        return (self.labels_BS != IGNORE_INDEX).sum()

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> RolloutBatch:
        return pytree.tree_map(lambda t: t.to(device, non_blocking=non_blocking), self)

    def contiguous(self) -> RolloutBatch:
        return pytree.tree_map(lambda t: t.contiguous(), self)


Batch = TokenBatch | PreferenceBatch | RolloutBatch


def as_batch(batch: Batch | tuple[Tensor, ...]) -> Batch:
    """A typed batch; a tuple (inputs, labels[, positions]) becomes a TokenBatch."""
    if isinstance(batch, BATCH_CLASSES):
        return batch
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        size = f" of {len(batch)} tensors" if isinstance(batch, (tuple, list)) else ""
        kinds = ", ".join(c.__name__ for c in BATCH_CLASSES)
        raise ValueError(f"a micro-batch is one of {kinds} or (inputs, labels[, positions]), got "
                         f"{type(batch).__name__}{size}")
    return TokenBatch(*batch)


def flatten(batch: Batch) -> tuple[list[Tensor], pytree.TreeSpec]:
    """(the batch's tensors in field order, what `unflatten` rebuilds it from); None fields hold no tensor."""
    return pytree.tree_flatten(batch)


def unflatten(tensors: list[Tensor], spec: pytree.TreeSpec) -> Batch:
    return pytree.tree_unflatten(tensors, spec)
