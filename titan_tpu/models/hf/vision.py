"""Vision-language models on the Transformers backend: what differs per architecture, and the
static-shape merge of image features into the text.

A vision-language directory (Qwen2.5-VL, Gemma 3, LLaVA) is built as transformers'
``*ForConditionalGeneration`` model and wrapped in `HFCausalLM` like any causal LM. Its batches
carry images beside the tokens (data/batch.py `ImageInputs`), in static shapes: every image at one
fixed resolution and each row a fixed number of image slots, the empty ones zeros and masked. So
the model never runs transformers' own merge (`get_placeholder_mask` counts the image tokens of
the batch against the features, a data-dependent check, and a padded slot would fail it). Instead
the wrapper runs the vision tower on every slot, places the features itself (`merge_image_features`:
the k-th image token of row b takes feature k of row b's slots, a gather whose shape is the batch's)
and calls the language model on the merged embeddings with what else the architecture needs (the
3-D rotary positions of Qwen2.5-VL, Gemma 3's image token types for its bidirectional image
attention), computed by the data loader. An empty slot's features are computed and never read, so
they add nothing to the loss or any gradient.

`VISION_ARCHITECTURES` holds one record per supported model_type; a new one is a record.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionArchitecture:
    """What the wrapper needs to know of one vision-language architecture."""

    model_type: str
    tower: str  # module path (under the HF model) of the vision encoder, frozen unless model.train_vision
    # Features -> language model: the projector, which trains even with the tower frozen. "" where
    # it is a module of its own outside the tower (Gemma 3's and LLaVA's multi_modal_projector).
    projector_in_tower: str
    # (the HF model, the batch's ImageInputs) -> image features [B x slots x tokens per image, D]
    features: Callable[[nn.Module, Any], torch.Tensor]
    # the batch's ImageInputs -> keyword arguments of the base model's forward beside inputs_embeds
    language_inputs: Callable[[Any], dict[str, torch.Tensor]]
    # Static-shape forms of the tower's modules that graph capture cannot trace, by class name (bound
    # to our instances only, as hooks.py GRAPH_SAFE_FORWARDS are)
    graph_safe_forwards: tuple[tuple[str, Callable[..., torch.Tensor]], ...] = ()
    # (text config, ImageInputs, positions_BS) -> the attention masks by layer type of packed rows, for an
    # architecture whose mask is more than causal within each document (Gemma 3: an image's tokens see
    # the whole image), which the attention's documents alone would lose; None: the documents do.
    packed_masks: Callable[[Any, Any, torch.Tensor], dict[str, torch.Tensor]] | None = None

    @property
    def projector(self) -> str:
        """Module path (under the HF model) of the projector into the language model."""
        return f"{self.tower}.{self.projector_in_tower}" if self.projector_in_tower else "model.multi_modal_projector"


def _pooled(output) -> torch.Tensor:
    features = output.pooler_output if hasattr(output, "pooler_output") else output
    if isinstance(features, (tuple, list)):
        features = torch.cat(list(features))
    return features.reshape(-1, features.shape[-1])


# Set while a Qwen2.5-VL vision tower runs: the patches of one image (every slot's image has the
# same size), which its graph-safe attention blocks the patches by.
_PATCHES_PER_IMAGE: contextvars.ContextVar[int] = contextvars.ContextVar("titan_tpu_patches_per_image")


def _qwen2_5_vl_features(hf_model: nn.Module, images) -> torch.Tensor:
    # The vision tower itself, not get_image_features: that one splits its output per image with
    # .tolist() of the grid, which the merge here does not need. The loader's precomputed inputs
    # (rotary positions, segments, window order) replace the tower's own data-dependent ones.
    visual = hf_model.model.visual
    patches_ND = images.pixel_values.reshape(-1, images.pixel_values.shape[-1]).to(visual.dtype)
    token = _PATCHES_PER_IMAGE.set(images.pixel_values.shape[2])
    try:
        return _pooled(visual(patches_ND, grid_thw=images.grid_thw.reshape(-1, 3), **(images.tower_inputs or {})))
    finally:
        _PATCHES_PER_IMAGE.reset(token)


def _qwen2_5_vl_vision_attention(module: nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                                 **kwargs) -> torch.Tensor:
    """`Qwen2_5_VLVisionAttention.forward` with static shapes: its per-segment loop (a split by
    `cu_seqlens.tolist()`) becomes one attention per image, [images, heads, P, P] masked to the
    segments (the whole image, or its windows) that the segment ids from `cu_seqlens` name. Every
    segment lies within one image, so the result is the loop's; the window layers pay for whole
    images (P x P, not windows' squares) in exchange for one static shape."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    N = hidden_states.shape[0]
    P = _PATCHES_PER_IMAGE.get(N)  # outside our features (a direct call of the tower): one segment set
    q_NHD, k_NHD, v_NHD = module.qkv(hidden_states).reshape(N, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q_NHD, k_NHD = apply_rotary_pos_emb_vision(q_NHD, k_NHD, cos, sin)
    segment_N = torch.searchsorted(cu_seqlens.to(torch.int64), torch.arange(N, device=hidden_states.device),
                                   right=True)
    segment_IP = segment_N.view(N // P, P)
    allowed_I1PP = (segment_IP.unsqueeze(-1) == segment_IP.unsqueeze(-2)).unsqueeze(1)

    def per_image(x_NHD: torch.Tensor) -> torch.Tensor:
        return x_NHD.view(N // P, P, module.num_heads, -1).transpose(1, 2)

    out_IHPD = F.scaled_dot_product_attention(per_image(q_NHD), per_image(k_NHD), per_image(v_NHD),
                                              attn_mask=allowed_I1PP, scale=module.scaling)
    return module.proj(out_IHPD.transpose(1, 2).reshape(N, -1))


def _gemma3_packed_masks(text_config, images, positions_BS: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gemma 3's masks (boolean [B, 1, S, S]) of rows packed with documents: causal or within one
    image, and within one document; its sliding layers' also within the window. transformers' own
    packed masks look its image blocks up by position in the document on the sliding layers (their
    remap applies to the image overlay as well), so they are built here."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    from titan_tpu.kernels.attention import document_ids_from_positions

    S = positions_BS.shape[1]
    index_S = torch.arange(S, device=positions_BS.device)
    documents_BS = document_ids_from_positions(positions_BS)
    blocks_BS = get_block_sequence_ids_for_mask(images.token_types_BS, device=positions_BS.device)
    causal_SS = index_S[:, None] >= index_S[None, :]
    same_image_BSS = (blocks_BS[:, :, None] == blocks_BS[:, None, :]) & (blocks_BS[:, :, None] >= 0)
    full_BSS = (documents_BS[:, :, None] == documents_BS[:, None, :]) & (causal_SS | same_image_BSS)
    window_SS = index_S[None, :] > index_S[:, None] - text_config.sliding_window
    return {"full_attention": full_BSS.unsqueeze(1), "sliding_attention": (full_BSS & window_SS).unsqueeze(1)}


def _image_features(hf_model: nn.Module, images) -> torch.Tensor:
    pixels = images.pixel_values.flatten(0, 1)  # [B x slots, C, H, W]
    return _pooled(hf_model.model.get_image_features(pixel_values=pixels.to(hf_model.dtype)))


VISION_ARCHITECTURES: dict[str, VisionArchitecture] = {a.model_type: a for a in (
    VisionArchitecture("qwen2_5_vl", tower="model.visual", projector_in_tower="merger", features=_qwen2_5_vl_features,
                       language_inputs=lambda images: {"position_ids": images.positions_3BS},
                       graph_safe_forwards=(("Qwen2_5_VLVisionAttention", _qwen2_5_vl_vision_attention),)),
    VisionArchitecture("gemma3", tower="model.vision_tower", projector_in_tower="", features=_image_features,
                       language_inputs=lambda images: {"token_type_ids": images.token_types_BS},
                       packed_masks=_gemma3_packed_masks),
    VisionArchitecture("llava", tower="model.vision_tower", projector_in_tower="", features=_image_features,
                       language_inputs=lambda images: {}),
)}


def is_vision_language(config) -> bool:
    """Whether `config` is a vision-language model this backend trains with its images (a record of
    `VISION_ARCHITECTURES`). Other composite configs with a vision tower that transformers' causal-LM
    mapping holds (Dots 3 Note, ...) are trained as before: as their text model."""
    return config.model_type in VISION_ARCHITECTURES and hasattr(config, "vision_config")


def vision_architecture(config) -> VisionArchitecture | None:
    """The record of a vision-language config; None for a text-only one."""
    return VISION_ARCHITECTURES[config.model_type] if is_vision_language(config) else None


def unsupported_vision_error(config) -> ValueError | None:
    """The one-line error for an image-text-to-text model that neither has a record here nor a
    causal-LM class in transformers; None for any other config."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = config.model_type
    if (model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in VISION_ARCHITECTURES
            and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return ValueError(f"model.hf_config: {model_type} is a vision-language model the hf backend does not train "
                          f"yet; supported: {', '.join(sorted(VISION_ARCHITECTURES))}")
    return None


def merge_image_features(embeds_BSD: torch.Tensor, features_ND: torch.Tensor, *, tokens_BS: torch.Tensor,
                         image_token_id: int) -> torch.Tensor:
    """`embeds_BSD` with its image tokens replaced by image features: the k-th image token of row b
    takes row k of b's share of `features_ND` (B equal shares, each the row's slots in order).
    Static shapes (a cumulative sum and a gather, no boolean indexing): the data loader guarantees
    that a row never holds more image tokens than its share."""
    B = embeds_BSD.shape[0]
    per_row = features_ND.shape[0] // B
    is_image_BS = tokens_BS == image_token_id
    index_BS = (torch.cumsum(is_image_BS.long(), dim=1) - 1).clamp(min=0)
    index_BS = index_BS + torch.arange(B, device=tokens_BS.device).unsqueeze(1) * per_row
    gathered_BSD = features_ND.to(embeds_BSD.dtype)[index_BS]
    return torch.where(is_image_BS.unsqueeze(-1), gathered_BSD, embeds_BSD)


def use_graph_safe_forwards(hf_model: nn.Module, architecture: VisionArchitecture) -> None:
    forms = dict(architecture.graph_safe_forwards)
    for module in hf_model.modules():
        form = forms.get(type(module).__name__)
        if form is not None:
            module.forward = functools.partial(form, module)


def freeze_tower(hf_model: nn.Module, architecture: VisionArchitecture) -> int:
    """Stop gradients to the vision encoder (its projector into the language model keeps training);
    the number of parameters frozen."""
    tower = hf_model.get_submodule(architecture.tower)
    projector = architecture.projector_in_tower
    frozen = 0
    for name, param in tower.named_parameters():
        if projector and name.startswith(projector + "."):
            continue
        param.requires_grad_(False)
        frozen += param.numel()
    return frozen
