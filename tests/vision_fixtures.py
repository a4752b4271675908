"""Tiny vision-language model directories the vision tests write themselves (no network): a random
config of each architecture, its processor (image processor, a small byte-level BPE tokenizer with
the architecture's special tokens, the chat template) and, if asked, its random weights; images
of coloured squares and image-text chat rows that name them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from data_fixtures import WORDS

from titan_tpu.tools.shapes_demo import LLAVA_TEMPLATE, SPECIALS

# Qwen2.5-VL's own turn format: ChatML, an image part rendered as vision start, one image pad, vision end.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|image_pad|>", "<|video_pad|>"]

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220), "yellow": (230, 220, 40)}


def _train_tokenizer(directory: Path, specials: list[str], *, vocab_size: int = 300) -> dict[str, int]:
    """A byte-level BPE with `specials` first (ids 0..), saved as tokenizer.json; {special: id}."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = WORDS + list(COLOURS) + ["What colour is the square?", "Describe the image.", "It is a square."]
    tok.train_from_iterator(text * 4, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    return {s: tok.token_to_id(s) for s in specials}


def write_qwen2_5_vl_dir(directory: Path, *, weights: bool = False, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL directory: config.json, the processor's files (14-pixel patches merged 2 x 2,
    so a 56 x 56 image is 4 x 4 patches, 4 tokens) and, with `weights`, random safetensors."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory.mkdir(parents=True, exist_ok=True)
    ids = _train_tokenizer(directory, QWEN_VL_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", model_max_length=4096)
    tokenizer.image_token = "<|image_pad|>"
    tokenizer.video_token = "<|video_pad|>"
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    # The processor's files written one by one: constructing Qwen2_5_VLProcessor needs its video
    # processor, which needs torchvision; loading it back (AutoProcessor) does not.
    image_processor.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    (directory / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=32,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    return _save(directory, config, Qwen2_5_VLForConditionalGeneration, weights=weights, seed=seed)


def write_square(path: Path, colour: str, *, size: int = 40) -> Path:
    """A PNG of a `colour` square on white (`size` pixels a side, not the model's resolution)."""
    from PIL import Image

    image = Image.new("RGB", (size, size), (255, 255, 255))
    image.paste(COLOURS[colour], (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def image_chat_rows(directory: Path, n: int, *, seed: int = 0, max_images: int = 2) -> list[dict]:
    """`n` chat rows whose user turns hold 0..max_images images (paths of squares written under
    `directory`); the assistant names their colours."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        colours = [rng.choice(list(COLOURS)) for _ in range(i % (max_images + 1))]
        parts = [{"type": "image", "path": str(write_square(directory / f"{i}_{k}.png", c))}
                 for k, c in enumerate(colours)]
        parts.append({"type": "text", "text": "What colour is the square?" if colours else rng.choice(WORDS)})
        answer = " and ".join(colours) if colours else " ".join(rng.choice(WORDS) for _ in range(3))
        rows.append({"messages": [{"role": "user", "content": parts},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Gemma 3's turn format: an image part is the begin-of-image token, which its processor expands.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                   "<image_soft_token>"]


def gemma3_processor(directory: Path):
    """Gemma 3's own processor of a directory `write_gemma3_dir` wrote (it loads without torchvision)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(directory))


def write_gemma3_dir(directory: Path, *, weights: bool = False, seed: int = 0) -> Path:
    """A tiny Gemma 3 directory: 28-pixel images in 7-pixel patches (4 x 4), pooled to 4 tokens."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    directory.mkdir(parents=True, exist_ok=True)
    ids = _train_tokenizer(directory, GEMMA3_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        model_max_length=4096, extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                     "image_token": "<image_soft_token>"})
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_TEMPLATE,
                                image_seq_length=4)
    processor.save_pretrained(str(directory))
    config = Gemma3Config(
        text_config=dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                         bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=7),
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    if weights:
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # the projector starts at zero: give it weights a gradient check can see
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
        model.save_pretrained(str(directory))
    else:
        config.save_pretrained(str(directory))
    return directory


# A LLaVA-1.5-style turn format (the learning check's): an image part is the <image> token, which
# its processor repeats.
LLAVA_SPECIALS = list(SPECIALS)


def llava_processor(directory: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(directory))


def write_llava_dir(directory: Path, *, weights: bool = False, seed: int = 0) -> Path:
    """A tiny LLaVA directory: a CLIP tower on 28-pixel images in 7-pixel patches (16 tokens an
    image, the class token dropped), a Llama language model."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    directory.mkdir(parents=True, exist_ok=True)
    ids = _train_tokenizer(directory, LLAVA_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=4096,
                                        extra_special_tokens={"image_token": "<image>"})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=LLAVA_TEMPLATE,
                               patch_size=7, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    processor.save_pretrained(str(directory))
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                         pad_token_id=ids["<pad>"]),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=7, projection_dim=16),
        image_token_index=ids["<image>"], vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    return _save(directory, config, LlavaForConditionalGeneration, weights=weights, seed=seed)


def _save(directory, config, model_class, *, weights: bool, seed: int):
    """The config, and with `weights` a model of it drawn from `seed`, saved as an HF directory."""
    import torch

    if weights:
        torch.manual_seed(seed)
        model_class(config).save_pretrained(str(directory))
    else:
        config.save_pretrained(str(directory))
    return directory



# Each tiny architecture's directory writer, and the model.image_size its runs take (0: the
# processor fixes the resolution; the tiny Qwen2.5-VL's allows 56 to 112 pixels).
WRITERS = {"qwen2_5_vl": write_qwen2_5_vl_dir, "gemma3": write_gemma3_dir, "llava": write_llava_dir}
IMAGE_SIZE = {"qwen2_5_vl": 56, "gemma3": 0, "llava": 0}
