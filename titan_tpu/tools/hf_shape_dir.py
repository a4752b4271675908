"""Weightless stand-ins of Hugging Face vision-language directories at their real size, for a TPU
recipe's compile on a machine without the model (no network, no weights).

A real directory holds config.json, the weights, the tokenizer's files and the processor's. A
compile needs only shapes: the config (every size of the model), the image processor (the patch
grid an image becomes) and a tokenizer and chat template that put the special tokens at the ids
the config names, so that a chat row with images renders as it would with the real tokenizer.
The stand-in holds exactly that, plus a few image-text chat rows with their pictures
(rows/train.jsonl) for the data a step is captured with. Its config.json and
preprocessor_config.json are the published files' numbers; its tokenizer is a small word-level
vocabulary whose special tokens carry the real ids (the other ids are never read by a compile).

    python -m titan_tpu.tools.hf_shape_dir                 # every stand-in a recipe names, where it names it
    python -m titan_tpu.tools.hf_shape_dir --model Qwen2.5-VL-7B-Instruct DIR

A recipe names its stand-in's path as model.hf_config (`STAND_INS`); `ensure` writes it there
when it is missing, so that `titan-tpu compile` and the recipe table run on a fresh clone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["STAND_INS", "ensure", "write_qwen2_5_vl_7b"]

# Qwen/Qwen2.5-VL-7B-Instruct's config.json as the Hub publishes it (huggingface.co/Qwen/
# Qwen2.5-VL-7B-Instruct/blob/main/config.json): a 28-layer Qwen2.5 language model (hidden 3584,
# 28 heads, 4 key/value heads, vocabulary 152,064, untied output) and a 32-layer vision tower
# (hidden 1280, 14-pixel patches merged 2 x 2 into the language model's width).
QWEN2_5_VL_7B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}

# The same repository's preprocessor_config.json: Qwen2-VL's image processor (CLIP's mean and std),
# 14-pixel patches merged 2 x 2, any resolution between min_pixels and max_pixels.
QWEN2_5_VL_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}

# Qwen2.5-VL's special tokens at the ids its tokenizer gives them (the config's ids above).
QWEN2_5_VL_SPECIALS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
    "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}

# Qwen2.5-VL-Instruct's turn format (its chat_template.json, images only): ChatML with the default
# system turn, an image part rendered as vision start, one image pad (the processor repeats it),
# vision end.
QWEN2_5_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The rows' words: a document reader's questions and answers.
QUESTIONS = ("What is written in this document?", "Describe the chart.", "Compare the two pages.")
ANSWERS = ("A receipt for three items.", "A bar chart of sales by month.", "The second page has a table.")


def _write_tokenizer(directory: Path, specials: dict[str, int], *, eos: str, pad: str) -> None:
    """A word-level tokenizer.json whose `specials` carry their ids (the rows' words take small
    ids), with the tokenizer_config.json that names its end and padding tokens."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    texts = (*QUESTIONS, *ANSWERS, "You are a helpful assistant. system user assistant")
    words = sorted({word for text in texts for word, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}, **specials}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": pad,
         "model_max_length": 131072}, indent=2))


def _write_rows(directory: Path, *, images_per_row: int, side: int) -> None:
    """rows/train.jsonl: chat rows of `images_per_row` pictures, every other row one fewer (a slot
    left empty), as PNGs beside them (`side` pixels a side), and a question, answered; every row
    renders to a few dozen text tokens besides its images."""
    from PIL import Image, ImageDraw

    rows = directory / "rows"
    (rows / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS)):
        parts = []
        for k in range(images_per_row - i % 2):  # a row with every slot filled, one with a slot left empty
            image = Image.new("RGB", (side, side), (245, 245, 240))
            ImageDraw.Draw(image).rectangle((side // 8, side // 8 + 40 * k, side // 2, side // 4 + 40 * k),
                                            fill=(40, 40, 40))
            name = f"images/page_{i}_{k}.png"
            image.save(rows / name)
            parts.append({"type": "image", "path": name})
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}) + "\n")
    (rows / "train.jsonl").write_text("".join(lines))


def write_qwen2_5_vl_7b(directory: str | Path) -> Path:
    """A weightless Qwen2.5-VL-7B-Instruct directory: the published config and image processor, a
    tokenizer with its special tokens at their ids, its chat template, and rows with images."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(QWEN2_5_VL_7B_CONFIG, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN2_5_VL_PREPROCESSOR, indent=2))
    (directory / "chat_template.jinja").write_text(QWEN2_5_VL_TEMPLATE)
    _write_tokenizer(directory, QWEN2_5_VL_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")
    _write_rows(directory, images_per_row=2, side=448)
    (directory / "README.md").write_text(
        "A weightless stand-in of Qwen/Qwen2.5-VL-7B-Instruct written by python -m titan_tpu.tools.hf_shape_dir: "
        "the published config.json and preprocessor_config.json, a word-level tokenizer whose special tokens carry "
        "the real ids, the chat template, and rows/train.jsonl with images. Shapes only: for titan-tpu compile. "
        "To train, point model.hf_config at the real directory.\n")
    return directory


# model.hf_config of a recipe -> (the model it stands in for, its writer).
STAND_INS: dict[str, tuple[str, Callable[[str | Path], Path]]] = {
    "outputs/hf_shapes/Qwen2.5-VL-7B-Instruct": ("Qwen2.5-VL-7B-Instruct", write_qwen2_5_vl_7b),
}


def ensure(hf_config: str, log: Callable[[str], None] = print) -> bool:
    """Write the stand-in `hf_config` names (a path of `STAND_INS`) if it has no config.json yet;
    whether one was written. Any other path (a user's real directory) is left alone."""
    target = Path(hf_config)
    if hf_config not in STAND_INS or (target / "config.json").is_file():
        return False
    model, write = STAND_INS[hf_config]
    # Written beside and renamed into place: processes that need it at once (test workers, ranks)
    # never read a half-written directory, and one rename wins.
    staging = target.with_name(f"{target.name}.writing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()  # an empty leftover would take the rename, not refuse it
    try:
        staging.rename(target)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(staging, ignore_errors=True)
        return False
    log(f"wrote {hf_config}: a weightless stand-in of {model} (python -m titan_tpu.tools.hf_shape_dir)")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_tpu.tools.hf_shape_dir", description=__doc__.split("\n")[0])
    models = {model: write for model, write in STAND_INS.values()}
    parser.add_argument("--model", choices=sorted(models), help="the model to stand in for (with DIR)")
    parser.add_argument("directory", nargs="?", help="where to write it (default: every stand-in at its recipe's path)")
    args = parser.parse_args(argv)
    if (args.model is None) != (args.directory is None):
        print("error: give --model NAME and DIR together, or neither (every stand-in at its recipe's path)",
              file=sys.stderr)
        return 2
    if args.model:
        print(f"wrote {models[args.model](args.directory)}")
        return 0
    for path, (model, write) in STAND_INS.items():
        print(f"wrote {write(path)} ({model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
