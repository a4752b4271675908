"""Routing at a glance: an MoE step's expert loads (`StepResult.expert_load`: tokens routed to each
expert per MoE layer, summed over ranks) as numbers of the metrics row, and one warning line when
a layer's routing piles onto one expert.

A layer is named by its transformer block (the model contract's `expert_load_layers`), as
checkpoints name it: ``layer3`` is ``layers.3``, in a DeepSeek-V3 model with three dense blocks
first too; multi-token prediction's blocks follow the main model's (the first depth is block
n_layers, as HF's DeepSeek-V3 numbers it). Per layer:

    moe/layer{i}/load_max    tokens on its busiest expert / the layer's mean per expert: 1.0 is
                             even; the most it can be is E / top_k (every token picks that expert)
    moe/layer{i}/top_share   the busiest expert's share of the layer's routed tokens (its load / the
                             layer's total load; a token counts once for each of its top_k experts,
                             so a layer whose every token picks one expert shows 1 / top_k)
    moe/layer{i}/dead        experts that got no token in the step, on any rank

Over all layers, as before: ``expert_load_max`` / ``expert_load_min``, the most and least loaded
expert over its layer's mean. And the whole picture, for the report's heat map: ``expert_load``,
{"layer3": [tokens / layer mean, per expert, 3 decimals], ...}. It is a dict, so the trackers
(numbers only) and the console line (train/metrics.py) leave it out and metrics.jsonl keeps it:
about 6 bytes per expert and layer per row (a 48-layer, 128-expert model: 37 KB a row).

The warning (``metrics.expert_load_warning``; 0: off) fires when a layer's load_max rises above
the threshold, and again for that layer only after a row at or below it: a layer that stays
collapsed warns once, not every row; one that swings around the threshold warns at every
crossing upward. The memory of which layers are above is the process's: a resumed run warns
anew for a layer still above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titan_tpu.config import ModelConfig

__all__ = ["LayerLoad", "Routing", "balancing_advice", "layer_loads", "routing_metrics"]


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's routing in one step."""

    block: int  # the transformer block (model contract `expert_load_layers`)
    relative_E: list[float]  # tokens per expert / the layer's mean per expert (1.0: even)
    top_share: float  # the busiest expert's share of the layer's routed tokens
    busiest: int  # that expert's index
    dead: int  # experts with no token

    @property
    def name(self) -> str:
        return f"layer{self.block}"

    @property
    def load_max(self) -> float:
        return max(self.relative_E)


def layer_loads(load_LE: torch.Tensor, blocks: Sequence[int]) -> list[LayerLoad]:
    """Each row of `load_LE` [L, E] (tokens per expert, all ranks) as a `LayerLoad` named by `blocks`.
    `blocks` may name more rows than there are: a per-sequence forward (DPO, ORPO) runs no
    multi-token-prediction depth, whose rows come last."""
    assert load_LE.shape[0] <= len(blocks), f"{load_LE.shape[0]} expert-load rows, {len(blocks)} blocks named"
    load_LE = load_LE.detach().float().cpu()  # one copy to the host; the row reads every number
    relative_LE = load_LE / load_LE.mean(dim=1, keepdim=True).clamp(min=1e-9)
    top_L, busiest_L = load_LE.max(dim=1)
    share_L = top_L / load_LE.sum(dim=1).clamp(min=1e-9)
    dead_L = (load_LE == 0).sum(dim=1)
    return [LayerLoad(block=block, relative_E=relative_LE[i].tolist(), top_share=share_L[i].item(),
                      busiest=int(busiest_L[i]), dead=int(dead_L[i]))
            for i, block in zip(range(load_LE.shape[0]), blocks)]


def routing_metrics(layers: list[LayerLoad]) -> dict:
    """The metrics row's routing keys (module docstring); {} without MoE layers."""
    if not layers:
        return {}
    row = {"expert_load_max": max(layer.load_max for layer in layers),
           "expert_load_min": min(min(layer.relative_E) for layer in layers)}
    for layer in layers:
        row[f"moe/{layer.name}/load_max"] = layer.load_max
        row[f"moe/{layer.name}/top_share"] = layer.top_share
        row[f"moe/{layer.name}/dead"] = layer.dead
    row["expert_load"] = {layer.name: [round(v, 3) for v in layer.relative_E] for layer in layers}
    return row


def balancing_advice(model: ModelConfig) -> str:
    """What the warning suggests, for the run's model.moe_load_balance."""
    if model.moe_load_balance == "aux_loss":
        return f"raise model.moe_aux_loss_coef (now {model.moe_aux_loss_coef:g})"
    if model.moe_load_balance == "expert_bias":
        return f"raise model.moe_bias_update_rate (now {model.moe_bias_update_rate:g})"
    return "set model.moe_load_balance to aux_loss or expert_bias (none balances nothing)"


class Routing:
    """A run's routing view: each metrics row's routing keys, and the warning's memory of which
    layers are above the threshold (module docstring)."""

    def __init__(self, *, blocks: Sequence[int], warn_above: float, advice: str):
        self.blocks = list(blocks)  # the model's expert_load_layers()
        self.warn_above = warn_above  # metrics.expert_load_warning; 0: no warning
        self.advice = advice  # `balancing_advice`
        self.above: set[int] = set()  # blocks whose last row was above warn_above

    def row(self, step: int, load_LE: torch.Tensor | None) -> tuple[dict, list[str]]:
        """(the routing keys of step's metrics row, the warning lines it gives); ({}, []) for a
        dense model (no loads)."""
        if load_LE is None:
            return {}, []
        layers = layer_loads(load_LE, self.blocks)
        return routing_metrics(layers), self._warnings(step, layers)

    def _warnings(self, step: int, layers: list[LayerLoad]) -> list[str]:
        if not self.warn_above:
            return []
        lines = []
        for layer in layers:
            if layer.load_max <= self.warn_above:
                self.above.discard(layer.block)  # recovered: the next crossing warns again
            elif layer.block not in self.above:
                self.above.add(layer.block)
                lines.append(f"warning: step {step}: MoE layer {layer.block} (moe/{layer.name}) sends "
                             f"{layer.top_share:.1%} of its routed tokens to expert {layer.busiest}: load max/mean "
                             f"{layer.load_max:.2f} > metrics.expert_load_warning = {self.warn_above:g}, "
                             f"{layer.dead} of {len(layer.relative_E)} experts got no token. If it persists, "
                             f"{self.advice}. Said again only after the layer recovers.")
        return lines
