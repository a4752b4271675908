"""Image-text conversations packed into rows (data.pack_images, data/images.py): each image stays
with its conversation, a row's slots hold its images in token order, positions restart per
conversation, and a packed batch trains exactly as its conversations one per row do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from grad_fixtures import BiasTerms, assert_gradients_close  # noqa: E402
from vision_fixtures import (  # noqa: E402
    IMAGE_SIZE,
    WRITERS,
    image_chat_rows,
    write_rows,
)

from titan_tpu.config import Config  # noqa: E402
from titan_tpu.data.batch import IGNORE_INDEX  # noqa: E402
from titan_tpu.data.chat import ChatRenderer, load_chat_template  # noqa: E402
from titan_tpu.data.images import (  # noqa: E402
    PACKABLE,
    ImageChatRows,
    ImageProcessorView,
    check_packable,
    pack_bounds,
    stack_rows,
)
from titan_tpu.data.tokenizer import load_tokenizer  # noqa: E402
from titan_tpu.models.hf.spec import HFSpec  # noqa: E402
from titan_tpu.models.spec import build  # noqa: E402

SEQ_LEN = 160
MAX_IMAGES = 3
CONVERSATIONS = 7  # 0, 1, 2, 0, 1, 2, 0 images


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: write(tmp_path_factory.mktemp(name), weights=True) for name, write in WRITERS.items()}


def _rows(directory: Path, rows: list[dict], *, pack: bool, max_images: int = MAX_IMAGES) -> ImageChatRows:
    model_type = next(name for name in WRITERS if name in directory.name)
    template, special = load_chat_template(directory)
    renderer = ChatRenderer(template, load_tokenizer(directory / "tokenizer.json"), special_tokens=special)
    view = ImageProcessorView(directory, max_images=max_images, image_size=IMAGE_SIZE[model_type])
    return ImageChatRows(rows, renderer=renderer, view=view, seq_len=SEQ_LEN, val_fraction=0.0, name="rows.jsonl",
                         pack=pack)


def _batches(directory: Path, tmp_path: Path):
    """(the conversations packed, the same conversations one a row) as batches, and the packed source."""
    conversations = image_chat_rows(tmp_path / "images", CONVERSATIONS, max_images=2)
    packed, single = _rows(directory, conversations, pack=True), _rows(directory, conversations, pack=False)
    assert single.num_train == CONVERSATIONS and packed.num_train < CONVERSATIONS
    return (stack_rows([packed.row(i) for i in range(packed.num_train)], packed.view),
            stack_rows([single.row(i) for i in range(single.num_train)], single.view), packed)


def test_pack_bounds_start_a_row_where_tokens_or_slots_run_out():
    assert pack_bounds([40, 40, 40, 40], [0, 0, 0, 0], seq_len=100, max_images=2) == [0, 2, 4]
    assert pack_bounds([10, 10, 10, 10], [1, 1, 1, 0], seq_len=100, max_images=2) == [0, 2, 4]
    assert pack_bounds([10, 10], [2, 1], seq_len=100, max_images=2) == [0, 1, 2]
    assert pack_bounds([], [], seq_len=100, max_images=2) == [0]  # no row


@pytest.mark.parametrize("name", PACKABLE)
def test_packed_rows_keep_each_image_with_its_conversation(model_dirs, tmp_path, name):
    packed, single, source = _batches(model_dirs[name], tmp_path)
    image_token_id = source.view.config.image_token_id
    per_image = source.view.tokens_per_image
    bounds = source.bounds
    for r in range(packed.inputs_BS.shape[0]):
        conversations = range(bounds[r], bounds[r + 1])
        inputs, labels, positions = packed.inputs_BS[r], packed.labels_BS[r], packed.positions_BS[r]
        # Each conversation's tokens and labels as its own row has them, positions restarting at 0.
        at = 0
        for c in conversations:
            n = len(source.encoded[c][0])
            assert torch.equal(inputs[at:at + n], single.inputs_BS[c, :n])
            assert torch.equal(labels[at:at + n], single.labels_BS[c, :n])
            assert positions[at:at + n].tolist() == list(range(n))
            # Per-token extras as the conversation's own row has them: Qwen2.5-VL's 3-D positions
            # restart with it (rotary is relative, so only this tells), Gemma 3's token types.
            if single.images.positions_3BS is not None:
                assert torch.equal(packed.images.positions_3BS[:, r, at:at + n], single.images.positions_3BS[:, c, :n])
            if single.images.token_types_BS is not None:
                assert torch.equal(packed.images.token_types_BS[r, at:at + n], single.images.token_types_BS[c, :n])
            at += n
        assert (labels[at:] == IGNORE_INDEX).all() and (at == len(positions) or positions[at] == 0)
        # The row's slots: its conversations' images in order, as many as its image token runs.
        images = [k for c in conversations for k in range(int(single.images.slots_BM[c].sum()))]
        assert len(images) <= MAX_IMAGES
        assert packed.images.slots_BM[r].tolist() == [k < len(images) for k in range(MAX_IMAGES)]
        assert int((inputs == image_token_id).sum()) == per_image * len(images)
        expected = torch.cat([single.images.pixel_values[c][single.images.slots_BM[c]] for c in conversations])
        assert torch.equal(packed.images.pixel_values[r][:len(images)], expected)


def _ce_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(batch.inputs_BS, batch.labels_BS, positions_BS=batch.positions_BS, images=batch.images)
    out.ce_sum.backward()
    return out.ce_sum.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", PACKABLE)
def test_a_packed_batch_trains_as_its_conversations_one_a_row(model_dirs, tmp_path, name):
    """The summed loss and every gradient of the packed batch equal those of the same conversations
    one per row (fp32, within 1e-5): no token attends outside its conversation, no image goes to
    another one."""
    directory = model_dirs[name]
    packed, single, _ = _batches(directory, tmp_path)
    cfg = Config()
    cfg.model.name, cfg.model.hf_config, cfg.model.train_vision = "hf", str(directory), True
    model = build(HFSpec.of_dir(directory), cfg, device="cpu", seed=0)
    loss, grads = _ce_and_grads(model, packed)
    with BiasTerms(model) as terms:
        expected_loss, expected_grads = _ce_and_grads(model, single)
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss)
    # A key projection's bias has zero gradient in exact arithmetic: its floor is fp32's rounding
    # bound for its sum over the tokens (grad_fixtures.py).
    assert_gradients_close(grads, expected_grads, terms)


@pytest.mark.parametrize("name", PACKABLE)
def test_a_conversation_with_more_images_than_slots_names_the_row_and_the_key(model_dirs, tmp_path, name):
    rows = image_chat_rows(tmp_path / "images", 3)
    with pytest.raises(ValueError, match=r"chat row 3 of rows.jsonl holds 2 images, more than the 1 image slots of a "
                                         r"row; raise model.max_images to 2"):
        _rows(model_dirs[name], rows, pack=True, max_images=1)


def test_an_architecture_not_packed_yet_is_refused_in_one_line(model_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"^packing is not supported for paligemma yet; set data.pack_images = false"):
        check_packable("paligemma")
    for name in sorted(set(WRITERS) - set(PACKABLE)):
        with pytest.raises(ValueError, match=rf"^packing is not supported for {name} yet; set data.pack_images"):
            _rows(model_dirs[name], image_chat_rows(tmp_path / "images", 2), pack=True)


def _train(tmp_path: Path, directory: Path, run: str, *extra: str) -> list[dict]:
    from titan_tpu.cli import main

    rows = write_rows(tmp_path / "data" / "rows.jsonl", image_chat_rows(tmp_path / "data" / "images", 12))
    model_type = next(name for name in WRITERS if name in directory.name)
    args = ["train", "--model.name", "hf", "--model.hf_config", str(directory), "--model.max_images", str(MAX_IMAGES),
            "--model.image_size", str(IMAGE_SIZE[model_type]), "--data.source", str(rows), "--data.format", "chat",
            "--data.pack_images", "true", "--output_dir", str(tmp_path / run), "--data.cache_dir",
            str(tmp_path / "cache"), "--training.batch_size", "2", "--training.seq_len", str(SEQ_LEN),
            "--training.steps", "3", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
            "--metrics.tensorboard", "false", "--validation.enabled", "false", "--training.device", "cpu", *extra]
    assert main(args) == 0
    return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.parametrize("name", PACKABLE)
def test_a_packed_run_trains_and_graph_mode_matches_eager(model_dirs, tmp_path, capsys, name):
    """titan-tpu train with data.pack_images: the rows say they are packed, and the captured step
    (documents, Gemma 3's packed masks) gives eager's losses."""
    directory = model_dirs[name]
    eager = _train(tmp_path, directory, "eager")
    assert "conversations packed (data.pack_images)" in capsys.readouterr().out
    graph = _train(tmp_path, directory, "graph", "--training.mode", "graph", "--compile.backend", "aot_eager")
    assert len(eager) == len(graph) == 3
    for ours, theirs in zip(graph, eager):
        assert abs(ours - theirs) <= 1e-5 * theirs
