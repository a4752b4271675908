"""FLOPs per trained token of an HF-backend model (MFU and the throughput log)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_tpu.models.hf.config import _moe_shape, text_config
from titan_tpu.models.hf.model import HFCausalLM

if TYPE_CHECKING:
    from titan_tpu.data.batch import ImageInputs


def hf_flops_per_token(model: HFCausalLM, seq_len: int, *, images: ImageInputs | None = None) -> tuple[float, str]:
    """(FLOPs per trained token, how they were counted): 6 x the non-embedding parameters a token
    uses (the output projection counted; MoE experts scaled by top_k / experts, an estimate) plus
    6 x layers x heads x head_dim x seq_len for causal attention, from the config when it names
    them. A vision-language model's tower and projector are not in that count (a text token does
    not pass through them): with `images` (a batch's image slots) their work per row is spread over
    the row's seq_len tokens (`vision_flops_per_row`); without (text rows) they do none. A frozen
    weight (LoRA's base) counts 4, not 6: it gets no weight gradient (XLA's count of
    qwen2_5_vl_7b_tpu's step: 245.8 TFLOP a chip with LoRA, 360.3 without), as a native model's
    (models/registry.py `frozen_weight_gradient_flops_per_token`)."""
    vision_ids: set[int] = set()
    vision_flops, vision_how = 0.0, ""
    if model.vision is not None:
        tower, projector = _vision_modules(model)
        vision_ids = {id(p) for p in tower.parameters()} | {id(p) for p in projector.parameters()}
        if images is not None:
            vision_flops = vision_flops_per_row(model, images) / seq_len
            slots = images.slots_BM.shape[1]
            vision_how = (f"; the vision tower and projector on the {slots} image slot(s) of a row, filled or not, "
                          "counted by FlopCounterMode and spread over the row's tokens")
    text = text_config(model.hf_model.config)
    embeddings = model.hf_model.get_input_embeddings()
    output = model.hf_model.get_output_embeddings()
    # The stored weights: reading `.weight` under data parallelism or a compute cast returns a new
    # (gathered, cast) tensor each time.
    stored_embeddings = embeddings._parameters.get("weight") if embeddings is not None else None
    skip = {id(stored_embeddings)} if stored_embeddings is not None else set()
    tied = (output is not None and stored_embeddings is not None
            and output._parameters.get("weight") is stored_embeddings)
    moe = _moe_shape(text)
    n = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip or id(p) in vision_ids:
            continue
        share = moe[1] / moe[0] if moe is not None and ".experts." in f".{name}." else 1.0
        n += p.numel() * share * (1.0 if p.requires_grad else 2 / 3)  # frozen: forward and input gradient
    if tied:
        n += embeddings.weight.numel() * (1.0 if stored_embeddings.requires_grad else 2 / 3)
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (
        text.hidden_size // heads if heads and hasattr(text, "hidden_size") else None)
    how = "6N + 6 L H hd S from the config"
    attention = 0.0
    if layers and heads and head_dim:
        attention = 6.0 * layers * heads * head_dim * seq_len
    else:
        how = "6N only (the config names no attention shape)"
    if moe is not None:
        how += "; MoE experts counted at top_k / experts (an estimate)"
    return 6.0 * n + attention + vision_flops, how + vision_how


def _vision_modules(model: HFCausalLM) -> tuple[nn.Module, nn.Module]:
    """(the vision tower, the projector into the language model): the parameters a text token does
    not pass through (Qwen2.5-VL's projector is inside its tower)."""
    return (model.hf_model.get_submodule(model.vision.tower), model.hf_model.get_submodule(model.vision.projector))


def vision_flops_per_row(model: HFCausalLM, images: ImageInputs) -> float:
    """The vision side's training FLOPs per row of `images` (a batch's image slots, filled or not:
    an empty slot runs through the tower as a filled one does), counted by torch's FlopCounterMode
    on a copy of the model on the meta device (no memory, no compute): the tower and projector
    forward on these slots and their backward as the step runs it, which enters the tower only
    when it trains and reaches the projector's weights always."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_tpu.models.hf.config import auto_model_class
    from titan_tpu.models.hf.vision import use_graph_safe_forwards

    config = model.hf_model.config
    with torch.device("meta"):
        meta_model = auto_model_class(config).from_config(config, dtype=torch.float32)
    use_graph_safe_forwards(meta_model, model.vision)
    trains = {name: p.requires_grad for name, p in model.hf_model.named_parameters()}
    for name, p in meta_model.named_parameters():
        p.requires_grad_(trains.get(name, False))
    with FlopCounterMode(display=False) as counter:
        features_ND = model.vision.features(meta_model, _on_meta(images))
        if features_ND.requires_grad:
            features_ND.sum().backward()
    return counter.get_total_flops() / images.pixel_values.shape[0]


def _on_meta(images: ImageInputs) -> ImageInputs:
    def moved(value):
        if isinstance(value, torch.Tensor):
            return value.to("meta")
        if isinstance(value, dict):
            return {key: moved(v) for key, v in value.items()}
        return value

    return dataclasses.replace(images, **{f.name: moved(getattr(images, f.name)) for f in dataclasses.fields(images)})
