"""A native model family as one record: its name, its flavors and how it maps to Hugging Face.

Every native family is our one `Transformer` (models/common/transformer.py) with a flavor table;
what makes Llama 3, Qwen3 and Qwen3-MoE different families is data, written once here per family
(`FAMILY` in models/llama3.py, qwen3.py, qwen3_moe.py) and collected in models/registry.py. From
the records come the registry's flavor tables, the config's model names (config.py's
`model.name` choices) and the HF adapter (models/hub/adapter.py): which `architectures` and
`model_type` a config.json of the family carries and the family's own config keys in both
directions. The weight names are the one Transformer's (models/hub/adapter.py: the Llama layout,
QK norms where the record has them, experts where it is MoE), so they are not per family.

A new family whose blocks the Transformer already has (attention with or without QK norm, a
dense or mixture-of-experts feed-forward, RoPE with or without Llama 3 scaling) is one module
with its flavors and its record, plus one line in models/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from titan_tpu.models.common.transformer import TransformerArgs


def _no_keys(_) -> dict:
    return {}


@dataclass(frozen=True)
class HFMapping:
    """How a family reads and writes a Hugging Face config.json and state dict."""

    architecture: str  # config.json "architectures" (read and written), e.g. LlamaForCausalLM
    model_type: str  # config.json "model_type", e.g. llama
    # Whether config.json's head_dim is kept when it equals hidden_size // num_attention_heads
    # (Llama flavors leave it implicit; Qwen3 states it).
    explicit_head_dim: bool = True
    # The family's own TransformerArgs fields read from a config.json dict (e.g. Qwen3-MoE's `moe`).
    args_from_config: Callable[[dict], dict] = _no_keys
    # The family's own config.json keys written on export, from the args.
    config_from_args: Callable[[TransformerArgs], dict] = _no_keys


@dataclass(frozen=True)
class Family:
    name: str  # model.name in configs and checkpoints
    flavors: dict[str, TransformerArgs] = field(repr=False)  # model.flavor -> args
    hf: HFMapping
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (HF configs have no flag: the family decides)
    moe: bool = False  # a mixture-of-experts feed-forward (TransformerArgs.moe set)
    # HF's router has a per-expert choice bias (DeepSeek-V3's e_score_correction_bias): models
    # trained with moe.load_balance expert_bias export it.
    router_bias: bool = False
    # Multi-token-prediction layers (models/common/mtp.py), stored in the HF layout as DeepSeek-V3's
    # model.layers.{num_hidden_layers + k}.*.
    mtp: bool = False
