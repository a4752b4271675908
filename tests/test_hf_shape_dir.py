"""The weightless stand-in of Qwen2.5-VL-7B-Instruct's directory (tools/hf_shape_dir.py) that the TPU
recipe configs/qwen2_5_vl_7b_tpu.toml compiles with: transformers reads it as the 7B model, its
processor makes 256 tokens of a 448-pixel image, its tokenizer gives the special tokens their real
ids, and its rows render with their images as training renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.tools import hf_shape_dir
from titan_tpu.tools.hf_shape_dir import QWEN2_5_VL_SPECIALS, STAND_INS, ensure, write_qwen2_5_vl_7b


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return write_qwen2_5_vl_7b(tmp_path_factory.mktemp("stand_in") / "Qwen2.5-VL-7B-Instruct")


def test_the_config_is_the_7b_model(qwen_dir):
    from titan_tpu.models.hf.config import load_hf_config, text_config

    config = load_hf_config(str(qwen_dir))
    text, vision = text_config(config), config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (3584, 18944, 28)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (28, 4, 152064)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.fullatt_block_indexes) == \
        (32, 1280, 3584, [7, 15, 23, 31])
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and not config.tie_word_embeddings
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (151655, 151652, 151653)


def test_rows_render_with_their_images_at_the_real_ids(qwen_dir):
    from titan_tpu.data.images import ImageChatRows, directory_renderer, stack_rows
    from titan_tpu.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(qwen_dir / "tokenizer.json"))
    assert {token: tokenizer.token_id(token) for token in QWEN2_5_VL_SPECIALS} == QWEN2_5_VL_SPECIALS
    renderer, view = directory_renderer(qwen_dir, tokenizer=tokenizer, max_images=2, image_size=448)
    assert view.tokens_per_image == 256 and view.pixel_shape == (1024, 1176)  # 32 x 32 patches, merged 2 x 2
    rows = [json.loads(line) for line in (qwen_dir / "rows/train.jsonl").read_text().splitlines()]
    source = ImageChatRows(rows, renderer=renderer, view=view, seq_len=2048, val_fraction=0.0, name="rows",
                           bases=[qwen_dir / "rows"] * len(rows))
    batch = stack_rows([source.row(i) for i in range(len(rows))], view)
    assert batch.images.slots_BM.tolist() == [[True, True], [True, False], [True, True]]
    assert (batch.inputs_BS == 151655).sum(1).tolist() == [512, 256, 512]  # every image's 256 pads
    assert ((batch.labels_BS != -100).sum(1) > 0).all()  # the assistant's answers train


def test_ensure_writes_a_named_stand_in_once(tmp_path, monkeypatch):
    writes = []
    monkeypatch.setitem(STAND_INS, str(tmp_path / "stand_in"), ("a model", lambda d: writes.append(d) or
                                                                  write_qwen2_5_vl_7b(d)))
    assert ensure(str(tmp_path / "stand_in"), log=lambda message: None)
    assert not ensure(str(tmp_path / "stand_in"), log=lambda message: None)  # there already
    assert not ensure(str(tmp_path / "elsewhere")) and not ensure("qwen3") and len(writes) == 1  # a user's own


def test_the_recipe_names_a_stand_in():
    from titan_tpu.config import build_config

    cfg = build_config(Path(__file__).resolve().parents[1] / "configs/qwen2_5_vl_7b_tpu.toml")
    assert cfg.model.hf_config in STAND_INS and cfg.data.source.startswith(cfg.model.hf_config)
    assert hf_shape_dir.main(["--model", "Qwen2.5-VL-7B-Instruct"]) == 2  # DIR goes with --model
