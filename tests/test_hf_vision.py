"""Vision-language models on the Transformers backend: tiny random Qwen2.5-VL directories written
here (tests/vision_fixtures.py), image-text chat rows in static shapes (data/images.py), our
training step's loss and gradients against transformers' own forward and backward on the same
batch, and the one-line errors of bad input."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from grad_fixtures import BiasTerms, assert_gradients_close  # noqa: E402
from vision_fixtures import (  # noqa: E402
    gemma3_processor,
    image_chat_rows,
    llava_processor,
    write_gemma3_dir,
    write_llava_dir,
    write_qwen2_5_vl_dir,
    write_rows,
    write_square,
)

from titan_tpu.config import Config  # noqa: E402
from titan_tpu.data.batch import IGNORE_INDEX  # noqa: E402
from titan_tpu.data.chat import ChatRenderer, load_chat_template  # noqa: E402
from titan_tpu.data.images import ImageChatRows, ImageProcessorView, stack_rows  # noqa: E402
from titan_tpu.data.tokenizer import load_tokenizer  # noqa: E402
from titan_tpu.models.hf.spec import HFSpec  # noqa: E402
from titan_tpu.models.spec import build  # noqa: E402
from titan_tpu.train.objective import ModelCalls, NextTokenObjective  # noqa: E402

SEQ_LEN = 96
SLOTS = 2


@dataclasses.dataclass(frozen=True)
class Arch:
    write: Callable[..., Path]
    image_size: int  # model.image_size: 0 where the processor has a fixed resolution
    pixel_shape: tuple[int, ...]  # one slot's pixel_values
    tower: str  # parameter names of the frozen vision encoder contain this
    projector: str  # ... except these, which train with it frozen

    def reference_inputs(self, batch, image_token_id: int) -> dict:
        """The batch as transformers' processor would give it: only the real images."""
        images = batch.images
        slots = images.slots_BM.flatten()
        pixels = images.pixel_values.flatten(0, 1)[slots]
        if images.grid_thw is not None:  # Qwen2.5-VL: patches of all images in one list, their grids, token types
            return {"pixel_values": pixels.flatten(0, 1), "image_grid_thw": images.grid_thw.flatten(0, 1)[slots],
                    "mm_token_type_ids": (batch.inputs_BS == image_token_id).int()}
        if images.token_types_BS is not None:  # Gemma 3
            return {"pixel_values": pixels, "token_type_ids": images.token_types_BS}
        return {"pixel_values": pixels}


ARCHES = {
    "qwen2_5_vl": Arch(write_qwen2_5_vl_dir, 56, (16, 3 * 2 * 14 * 14), ".visual.", ".merger."),
    "gemma3": Arch(write_gemma3_dir, 0, (3, 28, 28), ".vision_tower.", "never"),
    "llava": Arch(write_llava_dir, 0, (3, 28, 28), ".vision_tower.", "never"),
}
# Qwen2.5-VL's processor needs torchvision (its video part) to load, which this environment lacks.
OWN_PROCESSORS = {"gemma3": gemma3_processor, "llava": llava_processor}
TOKENS_PER_IMAGE = {"qwen2_5_vl": 4, "gemma3": 4, "llava": 16}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: arch.write(tmp_path_factory.mktemp(name), weights=True) for name, arch in ARCHES.items()}


@pytest.fixture(scope="module")
def qwen_dir(model_dirs) -> Path:
    return model_dirs["qwen2_5_vl"]


def _view(directory: Path, max_images: int = SLOTS) -> ImageProcessorView:
    arch = ARCHES[json.loads((directory / "config.json").read_text())["model_type"]]
    return ImageProcessorView(directory, max_images=max_images, image_size=arch.image_size)


def _rows(directory: Path, rows: list[dict], *, max_images: int = SLOTS, name: str = "rows.jsonl") -> ImageChatRows:
    template, special = load_chat_template(directory)
    renderer = ChatRenderer(template, load_tokenizer(directory / "tokenizer.json"), special_tokens=special)
    return ImageChatRows(rows, renderer=renderer, view=_view(directory, max_images), seq_len=SEQ_LEN,
                         val_fraction=0.0, name=name)


def _batch(directory: Path, tmp_path: Path, n: int = 3):
    source = _rows(directory, image_chat_rows(tmp_path / "images", n))
    return stack_rows([source.row(i) for i in range(n)], source.view)


def _config(directory: Path, *, train_vision: bool) -> Config:
    cfg = Config()
    cfg.model.name, cfg.model.hf_config, cfg.model.train_vision = "hf", str(directory), train_vision
    return cfg


def _ours(directory: Path, *, train_vision: bool = True):
    cfg = _config(directory, train_vision=train_vision)
    return build(HFSpec.of_dir(directory), cfg, device="cpu", seed=0)


def _reference(directory: Path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def _reference_loss(model, batch, arch: Arch) -> torch.Tensor:
    images = arch.reference_inputs(batch, model.config.image_token_id) if batch.images is not None else {}
    out = model(input_ids=batch.inputs_BS, use_cache=False, **images)
    count = (batch.labels_BS != IGNORE_INDEX).sum()
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch.labels_BS.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum") / count


def _our_loss(model, batch) -> torch.Tensor:
    count = (batch.labels_BS != IGNORE_INDEX).sum()
    return NextTokenObjective().micro_batch(ModelCalls(model), batch, count=count, share=1.0).objective


def _assert_same_loss(ours, reference, batch, arch: Arch) -> None:
    """Our loss equals transformers' within 1e-5 on `batch`; both backwards run (gradients in .grad)."""
    loss = _our_loss(ours, batch)
    loss.backward()
    expected = _reference_loss(reference, batch, arch)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())


@pytest.mark.parametrize("name", list(ARCHES))
def test_rows_have_static_shapes_and_train_on_the_answer_only(model_dirs, tmp_path, name):
    directory = model_dirs[name]
    batch = _batch(directory, tmp_path)
    images = batch.images
    assert batch.inputs_BS.shape == (3, SEQ_LEN)
    assert images.pixel_values.shape == (3, SLOTS, *ARCHES[name].pixel_shape)
    assert images.slots_BM.tolist() == [[False, False], [True, False], [True, True]]
    image_token_id = _view(directory).config.image_token_id
    per_image = TOKENS_PER_IMAGE[name]
    assert (batch.inputs_BS == image_token_id).sum(dim=1).tolist() == [0, per_image, 2 * per_image]
    # The trained labels decode to the assistant's answer and its end of turn.
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    trained = batch.labels_BS[2][batch.labels_BS[2] != IGNORE_INDEX].tolist()
    rows = image_chat_rows(tmp_path / "images", 3)
    end_of_turn = {"qwen2_5_vl": "<|im_end|>", "gemma3": "<end_of_turn>", "llava": "</s>"}[name]
    assert tokenizer.decode(trained) == rows[2]["messages"][1]["content"][0]["text"] + end_of_turn


def test_qwen_grids_are_the_processors(qwen_dir, tmp_path):
    batch = _batch(qwen_dir, tmp_path)
    assert batch.images.grid_thw.tolist()[0] == [[1, 4, 4], [1, 4, 4]]  # 56 px: 4 x 4 patches of 14
    assert batch.images.positions_3BS.shape == (3, 3, SEQ_LEN)


@pytest.mark.parametrize("name", list(OWN_PROCESSORS))
def test_rows_are_the_processors_own(model_dirs, tmp_path, name):
    """Token ids, token types and pixels as the model's own processor makes them."""
    from PIL import Image

    directory = model_dirs[name]
    processor = OWN_PROCESSORS[name](directory)
    rows = image_chat_rows(tmp_path / "images", 3)
    batch = _batch(directory, tmp_path)
    for i, row in enumerate(rows):
        paths = [part["path"] for part in row["messages"][0]["content"] if part["type"] == "image"]
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        theirs = processor(text=[text], images=[Image.open(p).convert("RGB") for p in paths] or None,
                           return_tensors="pt")
        n = theirs["input_ids"].shape[1]
        assert batch.inputs_BS[i, :n].tolist() == theirs["input_ids"][0].tolist()
        if "token_type_ids" in theirs:
            assert batch.images.token_types_BS[i, :n].tolist() == theirs["token_type_ids"][0].tolist()
        if paths:
            torch.testing.assert_close(batch.images.pixel_values[i, :len(paths)], theirs["pixel_values"])


def test_rope_positions_are_transformers_own(qwen_dir, tmp_path):
    batch = _batch(qwen_dir, tmp_path)
    model = _reference(qwen_dir)
    image_token_id = model.config.image_token_id
    slots = batch.images.slots_BM.flatten()
    theirs, _ = model.model.get_rope_index(batch.inputs_BS, mm_token_type_ids=(batch.inputs_BS == image_token_id).int(),
                                           image_grid_thw=batch.images.grid_thw.flatten(0, 1)[slots])
    assert torch.equal(theirs, batch.images.positions_3BS)


@pytest.mark.parametrize("train_vision", [True, False])
@pytest.mark.parametrize("name", list(ARCHES))
def test_loss_and_gradients_match_transformers(model_dirs, tmp_path, name, train_vision):
    directory, arch = model_dirs[name], ARCHES[name]
    batch = _batch(directory, tmp_path)
    ours = _ours(directory, train_vision=train_vision)
    reference = _reference(directory)
    with BiasTerms(reference) as terms:
        _assert_same_loss(ours, reference, batch, arch)
    theirs = dict(reference.named_parameters())
    frozen = 0
    for name_, param in ours.named_parameters():
        key = name_.removeprefix("hf_model.")
        if not param.requires_grad:
            assert arch.tower in f".{key}" and arch.projector not in key, name_
            frozen += 1
            continue
        if theirs[key].grad is None:  # a part the forward does not use (SigLIP's pooling head): nothing either
            assert param.grad is None or not param.grad.any(), key
            continue
        # A key projection's bias has zero gradient in exact arithmetic: its floor is fp32's rounding
        # bound for its sum over the tokens (grad_fixtures.py).
        assert_gradients_close({key: param.grad}, {key: theirs[key].grad}, terms)
    tower = [n for n in theirs if arch.tower in f".{n}" and arch.projector not in n]
    assert frozen == (0 if train_vision else len(tower))


@pytest.mark.parametrize("name", list(ARCHES))
def test_empty_slots_change_nothing(model_dirs, tmp_path, name):
    """An empty slot's pixels are never read: noise there leaves the loss as it was."""
    qwen_dir = model_dirs[name]
    batch = _batch(qwen_dir, tmp_path)
    noisy = batch.images.pixel_values.clone()
    noisy[~batch.images.slots_BM] = torch.randn_like(noisy[~batch.images.slots_BM])
    model = _ours(qwen_dir)
    with torch.no_grad():
        plain = _our_loss(model, batch)
        other = _our_loss(model, dataclasses.replace(batch, images=dataclasses.replace(batch.images,
                                                                                        pixel_values=noisy)))
    assert plain.item() == other.item()


@pytest.mark.parametrize("train_vision", [True, False])
@pytest.mark.parametrize("name", list(ARCHES))
def test_vision_flops_are_transformers_own(model_dirs, tmp_path, name, train_vision):
    """MFU's count of the vision side: per image, what torch's FlopCounterMode counts when
    transformers' own model encodes the batch's images and back-propagates into them (the tower
    only when it trains), with eager attention; spread over a row's tokens on top of the text's."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_tpu.models.hf.flops import hf_flops_per_token, vision_flops_per_row

    directory, arch = model_dirs[name], ARCHES[name]
    batch = _batch(directory, tmp_path)
    ours = _ours(directory, train_vision=train_vision)
    reference = _reference(directory)
    reference.config.vision_config._attn_implementation = "eager"
    frozen = {key for key, p in ours.hf_model.named_parameters() if not p.requires_grad}
    for key, p in reference.named_parameters():
        p.requires_grad_(key not in frozen)
    inputs = arch.reference_inputs(batch, reference.config.image_token_id)
    with FlopCounterMode(display=False) as counter:
        out = reference.model.get_image_features(
            **{k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")})
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        torch.cat(list(features)).sum().backward()
    images = int(batch.images.slots_BM.sum())
    slots = batch.images.slots_BM.shape[1]
    per_row = vision_flops_per_row(ours, batch.images)
    assert per_row / slots == counter.get_total_flops() / images
    with_images, how = hf_flops_per_token(ours, SEQ_LEN, images=batch.images)
    text_only, _ = hf_flops_per_token(ours, SEQ_LEN)
    assert with_images - text_only == pytest.approx(per_row / SEQ_LEN, rel=1e-12)
    assert "image slot" in how


# The projectors' linear layers; Gemma 3's projector is a plain weight (a matmul, no nn.Linear) that
# LoRA cannot adapt: naming it is refused in one line.
PROJECTORS = {"qwen2_5_vl": "hf_model.model.visual.merger.*", "gemma3": "hf_model.model.multi_modal_projector*",
              "llava": "hf_model.model.multi_modal_projector.*"}


def _lora_model(directory: Path, targets: list[str]):
    """Ours with LoRA adapters (rank 4); B drawn at random, so that A's gradient is not zero."""
    from titan_tpu.models.lora import lora_modules

    cfg = _config(directory, train_vision=False)
    cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules = True, 4, 8.0, targets
    model = build(HFSpec.of_dir(directory), cfg, device="cpu", seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for linear in lora_modules(model).values():
            linear._parameters["lora_B"].copy_(torch.randn(linear._parameters["lora_B"].shape, generator=generator))
    return model.train()


def _peft_reference(directory: Path, ours):
    """transformers' model of the directory adapted by peft on exactly our adapted layers, with our adapters."""
    import re

    peft = pytest.importorskip("peft")
    from titan_tpu.models.lora import is_adapter_key, lora_modules

    modules = [name.removeprefix("hf_model.") for name in lora_modules(ours)]
    model = peft.get_peft_model(_reference(directory), peft.LoraConfig(
        r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules="|".join(re.escape(m) for m in modules)))
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in ours.state_dict().items():
            if is_adapter_key(name):
                theirs[f"base_model.model.{name.removeprefix('hf_model.')}.default.weight"].copy_(value)
    return model.train()


@pytest.mark.parametrize("name", list(ARCHES))
def test_lora_adapts_the_language_model_and_matches_peft(model_dirs, tmp_path, name):
    """LoRA's default targets on a vision-language model are the language model's projections
    (not the tower's, which share their names); the projector is adapted when named. The loss and
    every adapter's gradient equal peft's on transformers' model with the same adapters."""
    from titan_tpu.models.lora import lora_modules

    directory, arch = model_dirs[name], ARCHES[name]
    vision = _ours(directory).vision_module_names()
    default = _lora_model(directory, [])
    assert lora_modules(default) and not any(n.startswith(vision) for n in lora_modules(default))
    assert all(not p.requires_grad for n, p in default.named_parameters() if "lora_" not in n)
    if name == "gemma3":
        with pytest.raises(ValueError, match=r"^lora.target_modules: .*multi_modal_projector.* matches no linear"):
            _lora_model(directory, [PROJECTORS[name]])
        variants = (default,)
    else:
        with_projector = _lora_model(directory, [*lora_modules(default), PROJECTORS[name]])
        variants = (default, with_projector)
        added = set(lora_modules(with_projector)) - set(lora_modules(default))
        assert added and all(n.startswith(vision[1]) for n in added)
        tower = [n for n in lora_modules(with_projector) if n.startswith(vision[0]) and not n.startswith(vision[1])]
        assert not tower

    batch = _batch(directory, tmp_path)
    for ours in variants:
        reference = _peft_reference(directory, ours)
        _assert_same_loss(ours, reference, batch, arch)
        theirs = dict(reference.named_parameters())
        trained = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
        assert len(trained) == sum(p.requires_grad for p in theirs.values())
        for key, param in trained:
            their = theirs[f"base_model.model.{key.removeprefix('hf_model.')}.default.weight"]
            torch.testing.assert_close(param.grad, their.grad, rtol=1e-5, atol=1e-5 * their.grad.abs().max().item(),
                                       msg=lambda m: f"{key}: {m}")


def _eval_rows(capsys, *args: str) -> dict:
    from titan_tpu.cli import main

    capsys.readouterr()
    assert main(["eval", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(ARCHES))
def test_eval_rows_gives_transformers_loss(model_dirs, tmp_path, capsys, name):
    """titan-tpu eval --rows on image-text chat rows: each row's loss on its answer equals
    transformers' own forward on that row's real images, and the total is token-weighted."""
    directory, arch = model_dirs[name], ARCHES[name]
    rows = image_chat_rows(tmp_path / "images", 5)
    size = ("--model.image_size", str(arch.image_size)) if arch.image_size else ()
    result = _eval_rows(capsys, "--hf-dir", str(directory), "--rows", str(write_rows(tmp_path / "rows.jsonl", rows)),
                        "--seq-len", str(SEQ_LEN), "--batch-size", "2", "--model.max_images", str(SLOTS), *size)
    reference = _reference(directory).eval()
    source = _rows(directory, rows)
    expected, tokens = [], 0
    with torch.no_grad():
        for i in range(len(rows)):
            batch = stack_rows([source.row(i)], source.view)
            if batch.images.slots_BM.any():
                expected.append(_reference_loss(reference, batch, arch).item())
            else:  # a row without images: transformers takes no image inputs at all
                text_only = dataclasses.replace(batch, images=None)
                expected.append(_reference_loss(reference, text_only, arch).item())
            tokens += int((batch.labels_BS != IGNORE_INDEX).sum())
    assert result["num_sequences"] == 5 and result["num_tokens"] == tokens
    assert result["per_sequence_loss"] == pytest.approx(expected, rel=1e-5)


# --- bad input -----------------------------------------------------------------------------------


def test_an_unreadable_image_names_the_row_and_file(qwen_dir, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    rows = image_chat_rows(tmp_path / "images", 2)
    rows[1]["messages"][0]["content"][0]["path"] = str(broken)
    source = _rows(qwen_dir, rows)
    with pytest.raises(ValueError, match=r"image of chat row 2 of rows.jsonl cannot be read \(file .*broken.png"):
        source.row(1)


def test_a_missing_image_is_found_when_the_rows_are_read(qwen_dir, tmp_path):
    """A path to no file stops the reading of the rows, not the batch that holds it hours later."""
    rows = image_chat_rows(tmp_path / "images", 3)
    rows[2]["messages"][0]["content"][0]["path"] = str(tmp_path / "gone.png")
    with pytest.raises(ValueError, match=r"image of chat row 3 of rows.jsonl cannot be read \(file .*gone.png: no such "
                                         r"file"):
        _rows(qwen_dir, rows)


def test_too_many_images_names_the_row_and_the_key(qwen_dir, tmp_path):
    rows = image_chat_rows(tmp_path / "images", 3)
    with pytest.raises(ValueError, match=r"chat row 3 of rows.jsonl holds 2 images, more than the 1 image slots of a "
                                         r"row; raise model.max_images to 2"):
        _rows(qwen_dir, rows, max_images=1)


def test_a_directory_without_its_processor_is_refused(qwen_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(qwen_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no image processor .*: a vision-language model needs its "
                                                "processor's files"):
        ImageProcessorView(bare, max_images=1)


def test_an_image_row_on_a_text_only_model_is_refused(tmp_path):
    from data_fixtures import write_chat_tokenizer_dir

    directory = write_chat_tokenizer_dir(tmp_path / "text_model")
    template, special = load_chat_template(directory)
    renderer = ChatRenderer(template, load_tokenizer(directory / "tokenizer.json"), special_tokens=special)
    messages = [{"role": "user", "content": [{"type": "image", "path": str(write_square(tmp_path / "a.png", "red"))},
                                             {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": "red"}]
    with pytest.raises(ValueError, match="chat row 0 holds an image and the model is text-only"):
        renderer.encode(messages, where="row 0")


def test_eval_rows_on_a_text_only_model_is_one_line(tmp_path, capsys):
    from titan_tpu.cli import main

    rows = write_rows(tmp_path / "rows.jsonl", image_chat_rows(tmp_path / "images", 2))
    assert main(["eval", "--model.name", "llama3", "--model.flavor", "debug", "--rows", str(rows)]) != 0
    error = capsys.readouterr().err.strip()
    assert error == ("error: eval --rows scores image-text chat rows on a vision-language model, and llama3/debug is "
                     "text-only; give a Qwen2.5-VL, Gemma 3 or LLaVA model, or evaluate text with --text")


def test_an_unsupported_vision_language_model_is_refused(tmp_path):
    from transformers import Idefics3Config

    from titan_tpu.models.hf.config import load_hf_config

    Idefics3Config().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="idefics3 is a vision-language model the hf backend does not train yet; "
                                         "supported: gemma3, llava, qwen2_5_vl"):
        load_hf_config(str(tmp_path))


# --- titan-tpu train ------------------------------------------------------------------------------


def _train(tmp_path: Path, directory: Path, run: str, *extra: str) -> list[dict]:
    from titan_tpu.cli import main

    rows = write_rows(tmp_path / "data" / "rows.jsonl", image_chat_rows(tmp_path / "data" / "images", 12))
    args = ["train", "--model.name", "hf", "--model.hf_config", str(directory), "--model.max_images", "2",
            "--data.source", str(rows), "--data.format", "chat", "--output_dir", str(tmp_path / run),
            "--data.cache_dir", str(tmp_path / "cache"), "--training.batch_size", "2", "--training.seq_len",
            str(SEQ_LEN), "--training.steps", "6", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
            "--metrics.tensorboard", "false", "--validation.freq", "3", "--validation.steps", "1",
            "--data.val_fraction", "0.2", "--checkpoint.interval", "3", "--training.device", "cpu", *extra]
    assert main(args) == 0
    return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]


def test_train_resume_and_export(model_dirs, tmp_path, capsys):
    """titan-tpu train on image-text rows of a Qwen2.5-VL directory: it trains (the vision encoder
    frozen, so it ends where it started), resuming at step 3 gives the same losses bitwise, and the
    export loads in transformers with the trained weights."""
    import shutil

    from transformers import AutoModelForImageTextToText

    from titan_tpu.cli import main
    from titan_tpu.train.checkpoint import load_full_state_dict

    directory = model_dirs["qwen2_5_vl"]
    extra = ("--model.image_size", "56")
    straight = _train(tmp_path, directory, "run", *extra)
    losses = [r["loss"] for r in straight if "loss" in r]
    assert len(losses) == 6 and any("val_loss" in r for r in straight)
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-00000003",
                    tmp_path / "resumed" / "checkpoints" / "step-00000003")
    resumed = _train(tmp_path, directory, "resumed", *extra)
    assert [r["loss"] for r in resumed if "loss" in r] == losses[3:]

    trained = load_full_state_dict(tmp_path / "run" / "checkpoints" / "step-00000006")
    start = AutoModelForImageTextToText.from_pretrained(str(directory)).state_dict()
    assert torch.equal(trained["hf_model.model.visual.blocks.0.attn.qkv.weight"],
                       start["model.visual.blocks.0.attn.qkv.weight"])  # frozen
    assert not torch.equal(trained["hf_model.model.visual.merger.mlp.0.weight"],
                           start["model.visual.merger.mlp.0.weight"])  # the projector trains
    assert main(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "export"),
                 "--dtype", "float32"]) == 0
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "export")).state_dict()
    for name, value in exported.items():
        assert torch.equal(value, trained[f"hf_model.{name}"]), name

    # eval --rows on the checkpoint reads the run's image settings (model.image_size 56, 2 slots) and
    # scores as the export does with them given
    rows = str(tmp_path / "data" / "rows.jsonl")
    settings = ("--model.image_size", "56", "--model.max_images", "2")
    from_run = _eval_rows(capsys, "--checkpoint", str(tmp_path / "run"), "--rows", rows, "--seq-len", str(SEQ_LEN))
    from_export = _eval_rows(capsys, "--hf-dir", str(tmp_path / "export"), "--rows", rows, "--seq-len", str(SEQ_LEN),
                             *settings)
    assert from_run["per_sequence_loss"] == pytest.approx(from_export["per_sequence_loss"], rel=1e-6)


def test_lora_run_exports_to_peft_and_merged(model_dirs, tmp_path):
    """A LoRA run on image-text rows: the --to-peft export on transformers' vision-language model
    (peft) and the --to-hf --merge-lora export give our trained model's logits on images and text."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForImageTextToText

    from titan_tpu.cli import main
    from titan_tpu.train.checkpoint import load_full_state_dict

    directory, arch = model_dirs["qwen2_5_vl"], ARCHES["qwen2_5_vl"]
    _train(tmp_path, directory, "run", "--model.image_size", "56", "--lora.enabled", "true", "--lora.rank", "4",
           "--optimizer.lr", "1e-2")
    run = tmp_path / "run"
    assert main(["convert", "--checkpoint", str(run), "--to-peft", str(tmp_path / "peft")]) == 0
    assert main(["convert", "--checkpoint", str(run), "--to-hf", str(tmp_path / "merged"), "--merge-lora",
                 "--dtype", "float32"]) == 0
    cfg = _config(directory, train_vision=False)
    cfg.lora.enabled, cfg.lora.rank = True, 4
    ours = build(HFSpec.of_dir(directory), cfg, device="cpu", seed=0)
    ours.load_state_dict(load_full_state_dict(run / "checkpoints" / "step-00000006"))
    batch = _batch(directory, tmp_path)
    adapted = peft.PeftModel.from_pretrained(_reference(directory), str(tmp_path / "peft")).eval()
    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ours.eval()(batch.inputs_BS, images=batch.images)
        inputs = dict(input_ids=batch.inputs_BS, use_cache=False,
                      **arch.reference_inputs(batch, merged.config.image_token_id))
        with adapted.disable_adapter():
            plain = adapted(**inputs).logits
        for logits in (adapted(**inputs).logits, merged(**inputs).logits):
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the adapters trained


def test_text_rows_train_the_language_model(model_dirs, tmp_path, capsys):
    """Plain text (format text) on a vision-language model is allowed: its language model trains
    without images, and the run says so."""
    from titan_tpu.cli import main

    text = tmp_path / "text.jsonl"
    write_rows(text, [{"text": f"alpha beta gamma {i} What colour is the square? It is a square."} for i in range(200)])
    run = tmp_path / "run"
    args = ["train", "--model.name", "hf", "--model.hf_config", str(model_dirs["qwen2_5_vl"]), "--data.source",
            str(text), "--output_dir", str(run), "--data.cache_dir", str(tmp_path / "cache"), "--training.batch_size",
            "2", "--training.seq_len", "32", "--training.steps", "2", "--metrics.tensorboard", "false",
            "--validation.enabled", "false", "--checkpoint.enabled", "false", "--training.device", "cpu"]
    assert main(args) == 0
    assert "text rows on a vision-language model: its language model trains" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(ARCHES))
def test_graph_mode_trains_as_eager_does(model_dirs, tmp_path, name):
    """Static shapes: graph mode captures the step once (with the data's own example batch, images
    included; Qwen2.5-VL's tower with the loader's precomputed inputs and its static attention) and
    its losses are eager's."""
    directory = model_dirs[name]
    extra = ("--validation.enabled", "false", "--training.steps", "3", "--model.image_size",
             str(ARCHES[name].image_size))
    eager = _train(tmp_path, directory, "eager", *extra)
    graph = _train(tmp_path, directory, "graph", *extra, "--training.mode", "graph", "--compile.backend", "aot_eager")
    for ours, theirs in zip([r["loss"] for r in graph if "loss" in r], [r["loss"] for r in eager if "loss" in r]):
        assert abs(ours - theirs) <= 1e-5 * theirs


def test_a_run_names_the_file_row_and_image_it_cannot_read(model_dirs, tmp_path, capsys):
    """Relative image paths are read from the rows' folder; a broken one stops the run in one line
    naming the rows' file, the row and the image."""
    from titan_tpu.cli import main

    data = tmp_path / "data"
    rows = image_chat_rows(data / "images", 4)
    for row in rows:  # relative to the rows' file
        for part in row["messages"][0]["content"]:
            if part["type"] == "image":
                part["path"] = str(Path(part["path"]).relative_to(data))
    (data / "images" / "broken.png").write_bytes(b"not a png")
    rows[2]["messages"][0]["content"][0]["path"] = "images/broken.png"
    source = write_rows(data / "rows.jsonl", rows)
    args = ["train", "--model.name", "hf", "--model.hf_config", str(model_dirs["gemma3"]), "--model.max_images", "2",
            "--data.source", str(source), "--data.format", "chat", "--output_dir", str(tmp_path / "run"),
            "--training.batch_size", "4", "--training.seq_len", str(SEQ_LEN), "--training.steps", "1",
            "--metrics.tensorboard", "false", "--validation.enabled", "false", "--data.val_fraction", "0",
            "--checkpoint.enabled", "false", "--training.device", "cpu"]
    assert main(args) != 0
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert error == [f"error: image of chat {source} row 3 cannot be read (file images/broken.png: cannot identify "
                     f"image file '{data / 'images' / 'broken.png'}'); fix or drop the row"]


def test_an_image_size_the_processor_would_change_is_refused(qwen_dir):
    with pytest.raises(ValueError, match="model.image_size = 168 is outside what the processor .* allows .*: "
                                         "choose a side from 56 to 112"):
        ImageProcessorView(qwen_dir, max_images=1, image_size=168)  # above its max_pixels of 112 x 112
    with pytest.raises(ValueError, match="model.image_size = 50 must be a multiple of 28"):
        ImageProcessorView(qwen_dir, max_images=1, image_size=50)
