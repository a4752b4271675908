"""`titan-tpu generate` with images: tiny random Qwen2.5-VL, Gemma 3 and LLaVA directories
(tests/vision_fixtures.py), prompts rendered as training rows are, greedy tokens against
transformers' own `generate` on its processor's inputs, from a training checkpoint, and the
one-line errors of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vision_fixtures import (  # noqa: E402
    IMAGE_SIZE,
    WRITERS,
    gemma3_processor,
    image_chat_rows,
    llava_processor,
    write_rows,
    write_square,
)

from titan_tpu.cli import main  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: write(tmp_path_factory.mktemp(name), weights=True) for name, write in WRITERS.items()}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """Squares at Qwen2.5-VL's 56 pixels (its processor keeps that size; the others resize to theirs)."""
    folder = tmp_path_factory.mktemp("images")
    return {colour: write_square(folder / f"{colour}.png", colour, size=56) for colour in ("red", "blue", "green")}


def _messages(paths: list[Path], text: str) -> list[dict]:
    parts = [{"type": "image", "path": str(p)} for p in paths] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def _processor_inputs(name: str, directory: Path, prompts: list[list[dict]]) -> dict:
    """What the model's processor gives for these conversations, left-padded as for generate.
    Qwen2.5-VL's processor needs torchvision (its video part) to load, which this environment
    lacks: its inputs are built as its processor builds them, from its image processor and
    tokenizer (each image's placeholder repeated grid / merge_size^2 times, the image tokens'
    mm_token_type_ids 1)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    pictures = [[Image.open(p["path"]).convert("RGB") for p in m[0]["content"] if p["type"] == "image"]
                for m in prompts]
    if name != "qwen2_5_vl":
        processor = {"gemma3": gemma3_processor, "llava": llava_processor}[name](directory)
        texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
        return dict(processor(text=texts, images=pictures, padding=True, padding_side="left", return_tensors="pt"))
    image_processor = AutoImageProcessor.from_pretrained(str(directory))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    template = (directory / "chat_template.jinja").read_text()
    pixels = image_processor(images=[p for row in pictures for p in row], return_tensors="pt")
    per_image = int(pixels["image_grid_thw"][0].prod()) // image_processor.merge_size ** 2
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True, chat_template=template)
             .replace("<|image_pad|>", "<|image_pad|>" * per_image) for m in prompts]
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {**encoded, **pixels, "mm_token_type_ids": (encoded["input_ids"] == image_token).int()}


def _transformers_generate(model, inputs: dict) -> list[list[int]]:
    """transformers' greedy tokens, all NEW_TOKENS of them (no stop), as lists per prompt."""
    out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def _reference(directory: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(directory), dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()


def _generate(capsys, *argv: str) -> list[list[int]]:
    capsys.readouterr()
    assert main(["generate", *argv, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json",
                 "--device", "cpu"]) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]


def _image_flags(paths: list[Path]) -> list[str]:
    return [flag for p in paths for flag in ("--image", str(p))]


@pytest.mark.parametrize("name", list(WRITERS))
def test_one_prompt_with_images_generates_transformers_greedy_tokens(model_dirs, images, capsys, name):
    """--image twice and --prompt: fp32, the tokens of transformers' generate(**processor(...))."""
    directory = model_dirs[name]
    paths = [images["red"], images["blue"]]
    ours = _generate(capsys, "--hf-dir", str(directory), *_image_flags(paths), "--prompt", "Describe the image.",
                     "--model.max_images", "2", "--model.image_size", str(IMAGE_SIZE[name]))
    inputs = _processor_inputs(name, directory, [_messages(paths, "Describe the image.")])
    assert ours == _transformers_generate(_reference(directory), inputs)


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_batch_of_prompts_file_rows_generates_transformers_greedy_tokens(model_dirs, images, tmp_path, capsys,
                                                                          name):
    """Rows of several lengths, with two images, one and none (relative paths: from the file's
    folder), left-padded in one batch as transformers pads them."""
    directory = model_dirs[name]
    prompts = [_messages([images["red"], images["green"]], "What colour is the square?"),
               _messages([images["blue"]], "Describe the image."),
               _messages([], "alpha beta")]
    relative = json.loads(json.dumps(prompts))
    write_square(tmp_path / "pictures" / "blue.png", "blue", size=56)
    relative[1][0]["content"][0]["path"] = "pictures/blue.png"
    write_rows(tmp_path / "prompts.jsonl", [{"messages": m} for m in relative])
    ours = _generate(capsys, "--hf-dir", str(directory), "--prompts-file", str(tmp_path / "prompts.jsonl"),
                     "--model.max_images", "2", "--model.image_size", str(IMAGE_SIZE[name]))
    with_images = prompts[:2]  # transformers' processors take no image-less row beside image rows
    assert ours[:2] == _transformers_generate(_reference(directory),
                                              _processor_inputs(name, directory, with_images))
    text_only = _generate(capsys, "--hf-dir", str(directory), "--prompt", "alpha beta", "--chat")
    assert ours[2] == text_only[0]


@pytest.mark.parametrize("name", list(WRITERS))
def test_the_prompt_ids_are_the_processors(model_dirs, images, name):
    from titan_tpu.data.images import ImagePrompts
    from titan_tpu.data.tokenizer import load_tokenizer

    directory = model_dirs[name]
    messages = _messages([images["red"], images["blue"]], "Describe the image.")
    prompts = ImagePrompts.of_dir(directory, tokenizer=load_tokenizer(directory / "tokenizer.json"), max_images=2,
                                  image_size=IMAGE_SIZE[name])
    ids, slots = prompts.encode(messages, where="row 0")
    theirs = _processor_inputs(name, directory, [messages])
    assert ids == theirs["input_ids"][0].tolist()
    assert slots["slots"].tolist() == [True, True]


def _model_and_prompts(directory: Path, name: str, *, max_images: int):
    from titan_tpu.config import Config
    from titan_tpu.data.images import ImagePrompts
    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.models.hf.spec import HFSpec
    from titan_tpu.models.spec import build

    cfg = Config()
    cfg.model.name, cfg.model.hf_config = "hf", str(directory)
    model = build(HFSpec.of_dir(directory), cfg, device="cpu", seed=0)
    prompts = ImagePrompts.of_dir(directory, tokenizer=load_tokenizer(directory / "tokenizer.json"),
                                  max_images=max_images, image_size=IMAGE_SIZE[name])
    return model, prompts


def test_the_image_changes_the_completion(model_dirs, images):
    """The prefill reads the pixels: another image, other log-probabilities from the first token."""
    from titan_tpu.generate import generate

    model, prompts = _model_and_prompts(model_dirs["llava"], "llava", max_images=1)
    encoded = [prompts.encode(_messages([images[c]], "Describe the image."), where=c) for c in ("red", "blue")]
    ids = [e[0] for e in encoded]
    out = generate(model, ids, max_new_tokens=4, images=prompts.batch(ids, [e[1] for e in encoded]))
    assert not torch.equal(out.logprobs_BN[0], out.logprobs_BN[1])


def test_a_compiled_decode_step_gives_the_eager_tokens(model_dirs, images):
    """The decode steps feed text only (Qwen2.5-VL's positions continuing behind the token count),
    so the compiled step with its static cache takes image prompts too."""
    from titan_tpu.generate import generate

    model, prompts = _model_and_prompts(model_dirs["qwen2_5_vl"], "qwen2_5_vl", max_images=2)
    encoded = [prompts.encode(_messages(paths, "Describe the image."), where="row")
               for paths in ([images["red"], images["blue"]], [images["green"]])]
    ids = [e[0] for e in encoded]
    image_inputs = prompts.batch(ids, [e[1] for e in encoded])
    eager = generate(model, ids, max_new_tokens=6, images=image_inputs)
    compiled = generate(model, ids, max_new_tokens=6, images=image_inputs, compile_backend="aot_eager")
    assert torch.equal(compiled.tokens_BN, eager.tokens_BN)


def test_a_training_checkpoint_generates_with_the_runs_image_settings(model_dirs, images, tmp_path, capsys):
    """--checkpoint RUN of a Qwen2.5-VL fine-tune: its model.image_size (56) and model.max_images
    come from the run; the tokens are transformers' greedy ones on the trained weights."""
    from titan_tpu.train.checkpoint import load_full_state_dict

    directory = model_dirs["qwen2_5_vl"]
    rows = write_rows(tmp_path / "data" / "rows.jsonl", image_chat_rows(tmp_path / "data" / "images", 8))
    run = tmp_path / "run"
    assert main(["train", "--model.name", "hf", "--model.hf_config", str(directory), "--model.max_images", "2",
                 "--model.image_size", "56", "--data.source", str(rows), "--data.format", "chat", "--output_dir",
                 str(run), "--data.cache_dir", str(tmp_path / "cache"), "--training.batch_size", "2",
                 "--training.seq_len", "96", "--training.steps", "2", "--lr_scheduler.warmup_steps", "0",
                 "--optimizer.lr", "0.01", "--metrics.tensorboard", "false", "--validation.enabled", "false",
                 "--checkpoint.interval", "2", "--training.device", "cpu"]) == 0
    paths = [images["green"], images["red"]]
    ours = _generate(capsys, "--checkpoint", str(run), *_image_flags(paths), "--prompt", "What colour is the square?")
    reference = _reference(directory)
    trained = load_full_state_dict(run / "checkpoints" / "step-00000002")
    reference.load_state_dict({k.removeprefix("hf_model."): v for k, v in trained.items()}, strict=False)
    inputs = _processor_inputs("qwen2_5_vl", directory, [_messages(paths, "What colour is the square?")])
    assert ours == _transformers_generate(reference, inputs)
    assert ours != _transformers_generate(_reference(directory), inputs)  # the fine-tune changed the tokens


# --- bad input -----------------------------------------------------------------------------------


def _one_line_error(capsys, argv: list[str], match: str) -> None:
    """One error line (transformers' weight-loading progress may come before it on stderr)."""
    capsys.readouterr()
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and match in errors[0], errors


def test_an_unreadable_image_names_the_file(model_dirs, tmp_path, capsys):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    directory = str(model_dirs["gemma3"])
    _one_line_error(capsys, ["generate", "--hf-dir", directory, "--image", str(tmp_path / "missing.png"),
                             "--prompt", "Describe the image.", "--device", "cpu"],
                    f"image of chat --prompt 0 cannot be read (file {tmp_path / 'missing.png'}: ")
    write_rows(tmp_path / "prompts.jsonl", [{"messages": _messages([Path("broken.png")], "Describe the image.")}])
    _one_line_error(capsys, ["generate", "--hf-dir", directory, "--prompts-file", str(tmp_path / "prompts.jsonl"),
                             "--device", "cpu"],
                    f"image of chat {tmp_path / 'prompts.jsonl'} 0 cannot be read (file broken.png: cannot identify")


def test_images_on_a_text_only_model_are_refused(tmp_path, images, capsys):
    from data_fixtures import write_chat_tokenizer_dir
    from transformers import AutoModelForCausalLM, Qwen2Config

    directory = tmp_path / "text_model"
    config = Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    write_chat_tokenizer_dir(directory, vocab_size=400)
    _one_line_error(capsys, ["generate", "--hf-dir", str(directory), "--image", str(images["red"]), "--prompt",
                             "Describe the image.", "--device", "cpu"],
                    "is a text-only model (it has no vision encoder to read images)")
    write_rows(tmp_path / "prompts.jsonl", [{"messages": _messages([images["red"]], "Describe the image.")}])
    _one_line_error(capsys, ["generate", "--hf-dir", str(directory), "--prompts-file", str(tmp_path / "prompts.jsonl"),
                             "--device", "cpu"], "0 holds an image and the model is text-only")


def test_more_images_than_slots_are_refused(model_dirs, images, capsys):
    _one_line_error(capsys, ["generate", "--hf-dir", str(model_dirs["llava"]), *_image_flags(list(images.values())),
                             "--prompt", "Describe the image.", "--model.max_images", "2", "--device", "cpu"],
                    "chat --prompt 0 holds 3 images, more than the 2 image slots of a row; raise model.max_images to 3")


def test_image_flags_go_with_one_prompt(model_dirs, images, capsys):
    _one_line_error(capsys, ["generate", "--hf-dir", str(model_dirs["llava"]), "--image", str(images["red"]),
                             "--prompt", "a", "--prompt", "b", "--device", "cpu"], "--image goes with one --prompt")
