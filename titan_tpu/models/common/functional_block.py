"""Call a block with its weights passed in as tensors, not read from the module.

Scan-over-layers and activation checkpointing both need a block as a pure function of tensors:
scan hands each iteration one layer's slice of stacked weights, and a checkpointed block is run
again during the backward, when (in a traced step) the weights that `torch.func.functional_call`
swapped into the model are no longer in place. `FunctionalBlock` keeps a *template* of the block
on the meta device (its code and structure, no storage; never registered as a submodule, so it
adds no parameters) and runs it with the weights given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["FunctionalBlock", "read_weights"]


class FunctionalBlock:
    def __init__(self, make_block: Callable[[], nn.Module]):
        with torch.device("meta"):
            self.template = make_block()

    @property
    def param_names(self) -> list[str]:
        """The weights' names: the parameters, then the persistent buffers (per-layer state such as
        an MoE expert bias). Read from the template each time, so parameters added to it after
        construction (LoRA adapters, models/lora.py) count."""
        persistent = self.template.state_dict(keep_vars=True).keys()
        names = [n for n, _ in self.template.named_parameters()]
        return names + [n for n, _ in self.template.named_buffers() if n in persistent]

    def __call__(self, h: Tensor, rope: Tensor, document_ids: Tensor | None, *weights: Tensor):
        """Run the block on (h, rope, document_ids) with `weights` (and persistent buffers) in
        `param_names` order; returns what the block returns."""
        return torch.func.functional_call(self.template, dict(zip(self.param_names, weights)),
                                          (h, rope, document_ids))


def read_weights(module: nn.Module, names: list[str]) -> list[Tensor]:
    """The compute tensors of `module`'s parameters `names`, read as attributes: under data
    parallelism that is the all-gathered tensor (parallel/simple_fsdp.py), not the stored shard."""
    out = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        out.append(getattr(module.get_submodule(owner), leaf))
    return out
