"""LoRA: low-rank adapters on the linear layers of any model, chosen by name pattern.

A targeted ``nn.Linear`` keeps its own weight (frozen: no gradient, no optimizer state) and gains
two trained parameters beside it, ``lora_A`` [rank, in] and ``lora_B`` [out, rank], and a forward
hook that adds ``dropout(x) @ A^T @ B^T * alpha / rank`` to its output. Keeping them on the
linear module itself, rather than wrapping it in a new module, leaves every base weight's name as
it was: HF directories, checkpoints of full runs and the native <-> HF adapter read the base model
unchanged, and the adapters are the state-dict entries ending in `.lora_A` / `.lora_B`. Because
the hook reads ``module.lora_A`` as an attribute, SimpleFSDP's parametrization (gathering,
casting) and graph capture's ``functional_call`` treat the adapters like any other parameter.

The model code does not change: native and Transformers-backend models share this module. A
pattern is a module name's last part (``wq``, ``q_proj``) or an ``fnmatch`` glob of the full name
(``*.layers.0.*.wq``); the default adapts the attention and MLP projections of either family.

Initialisation follows peft's default: A Kaiming-uniform (a = sqrt(5), as ``nn.Linear``), B zero,
so a run starts at the base model's function. It draws from its own generator, seeded by the run's
seed, in module order, full tensors copied into each rank's shard: any number of ranks gets the
same adapters, and the base weights the same values as a run without LoRA.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.tensors import copy_full_

if TYPE_CHECKING:
    from titan_tpu.config import LoRAConfig
    from titan_tpu.models.hub.sources import TensorSource

__all__ = ["ADAPTER_NAMES", "DEFAULT_TARGETS", "LoRASettings", "adapters_disabled", "add_adapters", "apply_lora",
           "freeze_base",
           "init_lora_", "is_adapter_key", "layers_in_every_block", "lora_modules", "merge_lora_sources",
           "merge_lora_state_dict",
           "target_names"]

ADAPTER_NAMES = ("lora_A", "lora_B")
# The attention and MLP projections of the native models (wq..w3) and of transformers' usual
# naming (q_proj..down_proj); the default takes those of them the model has.
DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3",
                   "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STATE = "_lora"  # the LoRASettings of an adapted linear, in its __dict__
# In a block template's adapted linear (its __dict__): the model whose train()/eval() mode the
# adapters' dropout follows, since a template is no submodule and never changes mode itself.
_MODE_OF = "_lora_mode_of"
# How many `adapters_disabled` blocks are open: the hook adds nothing while one is.
_DISABLED = [0]


@dataclass(frozen=True)
class LoRASettings:
    """What the forward hook of one adapted linear needs."""

    rank: int
    alpha: float
    dropout: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_adapter_key(name: str) -> bool:
    """Whether a parameter or state-dict name is a LoRA adapter's (`...q_proj.lora_A`)."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def _matches(name: str, pattern: str) -> bool:
    return name.rpartition(".")[2] == pattern or fnmatch.fnmatchcase(name, pattern)


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def target_names(model: nn.Module, patterns: list[str], *, section: str = "lora") -> list[str]:
    """The names of `model`'s linear layers that `patterns` select (empty: DEFAULT_TARGETS, outside
    a vision-language model's tower and projector, which are adapted when patterns name them).

    Raises a one-line ValueError naming a user pattern that selects nothing, with the linear
    layers there are. `section` names the config section in the message (lora, fp8)."""
    linears = _linears(model)
    chosen = [n for n in linears if any(_matches(n, p) for p in patterns or DEFAULT_TARGETS)]
    if not patterns:  # the defaults adapt a vision-language model's language model only
        vision = getattr(model, "vision_module_names", tuple)()
        chosen = [n for n in chosen if not any(n == v or n.startswith(v + ".") for v in vision)]
    for pattern in patterns:
        if not any(_matches(n, pattern) for n in linears):
            raise ValueError(f"{section}.target_modules: {pattern!r} matches no linear layer; the model's are "
                             f"{_summary(linears)}")
    if not chosen:
        raise ValueError(f"{section}.target_modules: the default patterns match no linear layer of this model; name "
                         f"some of {_summary(linears)}")
    return chosen


def _summary(linears: dict[str, nn.Linear]) -> str:
    """The distinct last parts of the linear layers' names, and one full name as an example."""
    leaves = sorted({n.rpartition(".")[2] for n in linears})
    example = next(iter(linears), "")
    return f"{', '.join(leaves)} (e.g. {example})" if leaves else "none"


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Give the linear layers of `model` that `cfg.target_modules` selects LoRA adapters, in place
    (on any device, the meta device too); returns their names. The adapters' values are set by
    `init_lora_`. rank must be at least 1 and at most the layer's smaller side."""
    _check_rank(cfg)
    names = target_names(model, cfg.target_modules)
    settings = LoRASettings(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout)
    for name in names:
        linear = model.get_submodule(name)
        _check_layer_rank(cfg, name, linear)
        _add_adapter(linear, settings)
    return names


def _check_rank(cfg: LoRAConfig) -> None:
    if cfg.rank < 1:
        raise ValueError(f"lora.rank = {cfg.rank} must be >= 1")


def _check_layer_rank(cfg: LoRAConfig, name: str, linear: nn.Linear) -> None:
    if cfg.rank > min(linear.in_features, linear.out_features):
        raise ValueError(f"lora.rank = {cfg.rank} is larger than layer {name} "
                         f"({linear.in_features} -> {linear.out_features}); use at most "
                         f"{min(linear.in_features, linear.out_features)}")


def _add_adapter(linear: nn.Linear, settings: LoRASettings, *, n_layers: int | None = None,
                 mode_of: nn.Module | None = None) -> None:
    """Adapters on one linear; with n_layers, on a scanned stack's linear (weight [L, out, in]):
    the adapters are stacked like it ([L, rank, in], [L, out, rank]) and take no hook, since the
    stack only stores weights (its block template, given adapters too, computes)."""
    assert _STATE not in linear.__dict__, "a linear layer was given LoRA twice"
    w = linear.weight
    lead = () if n_layers is None else (n_layers,)
    linear.lora_A = nn.Parameter(torch.empty(*lead, settings.rank, linear.in_features, device=w.device,
                                             dtype=w.dtype))
    linear.lora_B = nn.Parameter(torch.empty(*lead, linear.out_features, settings.rank, device=w.device,
                                             dtype=w.dtype))
    linear.__dict__[_STATE] = settings
    if mode_of is not None:
        linear.__dict__[_MODE_OF] = mode_of
    if n_layers is None:
        linear.register_forward_hook(_add_low_rank_update)


@contextlib.contextmanager
def adapters_disabled() -> Iterator[None]:
    """Inside, every adapted linear computes its base layer alone (the adapters are skipped, not
    multiplied by zero): the base model, without a copy of it, as DPO's reference policy under
    LoRA. Read when a forward runs (or is traced), so a captured step records the base model for
    the calls made inside the block and the adapted one elsewhere."""
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


def _add_low_rank_update(linear: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The hook: out + B(A(dropout(x))) * alpha / rank (out alone inside `adapters_disabled`)."""
    if _DISABLED[0]:
        return out
    settings: LoRASettings = linear.__dict__[_STATE]
    x = args[0]
    if settings.dropout > 0:
        x = F.dropout(x, p=settings.dropout, training=linear.__dict__.get(_MODE_OF, linear).training)
    return out + F.linear(F.linear(x, linear.lora_A), linear.lora_B) * settings.scaling


def lora_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The adapted linear layers of `model` by name."""
    return {name: m for name, m in model.named_modules() if _STATE in m.__dict__}


@torch.no_grad()
def init_lora_(model: nn.Module, *, seed: int) -> None:
    """peft's default initialisation of every adapter (A Kaiming-uniform, B zero), from a
    generator of its own seeded by `seed`, whole tensors in module order copied into each rank's
    shard: the same adapters on any number of ranks, and the global RNG untouched."""
    generator = torch.Generator().manual_seed(seed)
    for group in _draw_groups(lora_modules(model)):
        # The stored parameters: under SimpleFSDP reading `linear.lora_A` gives a gathered copy.
        stored_a = [linear._parameters["lora_A"] for linear in group]
        full_a = [torch.empty(a.shape) for a in stored_a]
        # A scanned stack's adapters ([L, rank, in]) are drawn layer by layer, each layer's in
        # module order, as the unrolled model draws them: scanned or not, the same adapters.
        for layer in range(full_a[0].shape[0] if full_a[0].dim() == 3 else 1):
            for a in full_a:
                a_layer = a[layer] if a.dim() == 3 else a
                bound = 1.0 / math.sqrt(a_layer.shape[1])  # kaiming_uniform_ with a = sqrt(5), as nn.Linear and peft
                a_layer.uniform_(-bound, bound, generator=generator)
        for linear, stored, full in zip(group, stored_a, full_a):
            copy_full_(stored, full)
            copy_full_(linear._parameters["lora_B"], torch.zeros(linear._parameters["lora_B"].shape))


def _draw_groups(linears: dict[str, nn.Linear]) -> list[list[nn.Linear]]:
    """The adapted linears in module order, those of a scanned stack (stacked adapters, adjacent
    in module order) in one group, every other one alone."""
    groups: list[list[nn.Linear]] = []
    previous_stacked = False
    for linear in linears.values():
        stacked = linear._parameters["lora_A"].dim() == 3
        if stacked and previous_stacked:
            groups[-1].append(linear)
        else:
            groups.append([linear])
        previous_stacked = stacked
    return groups


def freeze_base(model: nn.Module) -> None:
    """Every parameter but the adapters stops taking gradients (and so optimizer state)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))


def merge_lora_state_dict(state_dict: dict[str, torch.Tensor], *, scaling: float) -> dict[str, torch.Tensor]:
    """A state dict (full tensors) with every adapter pair folded into its base weight,
    W + B @ A * scaling, and the adapter entries dropped: the plain model's weights."""
    merged = {k: v for k, v in state_dict.items() if not is_adapter_key(k)}
    for key in state_dict:
        if key.endswith(".lora_A"):
            prefix = key[: -len("lora_A")]
            a, b = state_dict[key].float(), state_dict[prefix + "lora_B"].float()
            weight = merged[prefix + "weight"]
            merged[prefix + "weight"] = (weight.float() + (b @ a) * scaling).to(weight.dtype)
    return merged


def merge_lora_sources(sources: dict[str, TensorSource], *, scaling: float) -> dict[str, TensorSource]:
    """`merge_lora_state_dict` of weights given as sources (models/hub/sources.py): each adapted
    weight read with its pair folded in, block by block, when an export asks for it."""
    from titan_tpu.models.hub.sources import MergedLoRA

    merged = {k: v for k, v in sources.items() if not is_adapter_key(k)}
    for key in sources:
        if key.endswith(".lora_A"):
            prefix = key[: -len("lora_A")]
            merged[prefix + "weight"] = MergedLoRA(merged[prefix + "weight"], sources[key], sources[prefix + "lora_B"],
                                                   scaling)
    return merged


def add_adapters(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """`apply_lora` on a built model, and on the block templates that activation-checkpointed
    native blocks run as functions of their weights (models/common/functional_block.py): those
    must compute what the blocks do, so every block must carry the same adapters."""
    from titan_tpu.models.common.transformer import Transformer

    settings = LoRASettings(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout)
    if isinstance(model, Transformer) and model.scan_layers:
        return _add_stacked_adapters(model, cfg, settings)
    names = apply_lora(model, cfg)
    templates = model.block_templates() if isinstance(model, Transformer) else []
    if not templates:
        return names
    relative = layers_in_every_block(model, names, section="lora")
    for template in templates:
        for rel in relative:
            _add_adapter(template.get_submodule(rel), settings, mode_of=model)
    return names


def layers_in_every_block(model: nn.Module, names: list[str], *, section: str) -> list[str]:
    """The selected layers' names within a block (`attention.wq`), which must be the same in every
    block: the block templates of activation-checkpointed blocks compute for all of them (LoRA's
    adapters, fp8's linears). Raises a one-line ValueError naming `section` when they differ."""
    per_block: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            per_block.setdefault(parts[1], set()).add(".".join(parts[2:]))
    relative = per_block.get("0", set())
    if any(per_block.get(str(i), set()) != relative for i in range(len(model.layers))):
        raise ValueError(f"{section}.target_modules must select the same layers in every block under activation "
                         "checkpointing; widen the patterns or set activation_checkpoint.mode none")
    return sorted(relative)


def _add_stacked_adapters(model: nn.Module, cfg: LoRAConfig, settings: LoRASettings) -> list[str]:
    """Scanned layers (models/common/scan.py): the stack's linears (named like one block's,
    `layers.attention.wq`) get stacked adapters, every layer the same targets, and the block
    template that the scan body runs gets one layer's adapters with the hook. Outside the stack
    (the output projection) adapters are as unrolled."""
    _check_rank(cfg)
    names = target_names(model, cfg.target_modules)
    stacks = model.stacks()  # one, or one per run of identical blocks
    for name in names:
        linear = model.get_submodule(name)
        _check_layer_rank(cfg, name, linear)
        if name.startswith("layers."):
            stack_name, stack = next((n, stack) for n, stack in stacks if name.startswith(n + "."))
            _add_adapter(linear, settings, n_layers=stack.n_layers)
            _add_adapter(stack._block_fn.template.get_submodule(name[len(stack_name) + 1:]), settings, mode_of=model)
        else:
            _add_adapter(linear, settings)
    return names
