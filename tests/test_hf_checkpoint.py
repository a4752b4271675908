"""HF safetensors checkpoint I/O without transformers: sharding, validation, atomic saves."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_tpu.models.common import TransformerArgs
from titan_tpu.models.hub import checkpoint as hub_checkpoint
from titan_tpu.models.hub.checkpoint import (
    load_hf_checkpoint,
    load_model_from_hf,
    save_hf_checkpoint,
)
from titan_tpu.models.registry import MODEL_FLAVORS, build_model, get_model_args

ARGS = {
    "llama3": TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                              ffn_hidden_dim=48, rope_theta=5e5, max_seq_len=64),
    "qwen3": TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                             vocab_size=64, ffn_hidden_dim=48, norm_eps=1e-6, qk_norm=True,
                             tie_embeddings=True, max_seq_len=64),
}


def _save(path, name="llama3", **kwargs):
    model = build_model(ARGS[name], seed=0)
    out = save_hf_checkpoint(path, name=name, args=ARGS[name], state_dict=model.state_dict(),
                             **kwargs)
    return model, out


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_sharded_round_trip(tmp_path, name):
    model, out = _save(tmp_path / "ckpt", name, max_shard_bytes=20_000)
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert not list(tmp_path.glob(".ckpt*"))  # no temporary directories left behind
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert ("lm_head.weight" in index["weight_map"]) != ARGS[name].tie_embeddings

    loaded_name, args, sd = load_hf_checkpoint(out)
    assert (loaded_name, args) == (name, ARGS[name])
    expected = model.state_dict()
    assert sd.keys() == expected.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], expected[k], rtol=0, atol=0)

    _, _, reloaded = load_model_from_hf(out)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens), model(tokens), rtol=0, atol=0)
    assert all(p.requires_grad for p in reloaded.parameters())


def test_single_file_and_dtype(tmp_path):
    model = build_model(ARGS["llama3"], seed=0, dtype=torch.bfloat16)
    out = save_hf_checkpoint(tmp_path / "c", name="llama3", args=ARGS["llama3"],
                             state_dict=model.state_dict())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, _, sd = load_hf_checkpoint(out)
    assert sd["norm.weight"].dtype == torch.bfloat16
    _, _, fp32_model = load_model_from_hf(out, dtype=torch.float32)
    assert fp32_model.tok_embeddings.weight.dtype == torch.float32


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    _, out = _save(tmp_path / "c")
    (out / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_hf_checkpoint(out)


def test_missing_weights_file(tmp_path):
    _, out = _save(tmp_path / "c")
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf_checkpoint(out)


def test_missing_shard(tmp_path):
    _, out = _save(tmp_path / "c", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    (out / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {second} named in"):
        load_hf_checkpoint(out)


def _edit_single_file(out, edit):
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")


def test_missing_tensor(tmp_path):
    _, out = _save(tmp_path / "c")
    _edit_single_file(out, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf_checkpoint(out)


def test_untied_checkpoint_needs_lm_head(tmp_path):
    _, out = _save(tmp_path / "c")
    _edit_single_file(out, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        load_hf_checkpoint(out)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    _, out = _save(tmp_path / "c", "qwen3")
    _edit_single_file(out, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    _, _, sd = load_hf_checkpoint(out)
    assert "output.weight" not in sd


def test_shape_mismatch(tmp_path):
    _, out = _save(tmp_path / "c")
    _edit_single_file(out, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    match = r"k_proj.weight' .* has shape \[8, 32\], expected \[16, 32\]"
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(out)


def test_unexpected_tensor(tmp_path):
    _, out = _save(tmp_path / "c")
    extra = {"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}
    _edit_single_file(out, lambda t: t.update(extra))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_hf_checkpoint(out)


def test_unsupported_architecture(tmp_path):
    _, out = _save(tmp_path / "c")
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported HF model"):
        load_hf_checkpoint(out)


def test_save_refuses_non_empty_dir_without_overwrite(tmp_path):
    _save(tmp_path / "c")
    with pytest.raises(FileExistsError, match="--overwrite"):
        _save(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    _save(tmp_path / "empty")  # an empty directory is fine
    _save(tmp_path / "c", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "empty"]


def test_save_rejects_mismatched_state_dict(tmp_path):
    model = build_model(ARGS["llama3"], seed=0)
    sd = model.state_dict()
    sd["layers.0.ffn_norm.weight"] = torch.ones(5)
    with pytest.raises(ValueError, match="ffn_norm"):
        save_hf_checkpoint(tmp_path / "c", name="llama3", args=ARGS["llama3"], state_dict=sd)
    del sd["layers.0.ffn_norm.weight"]
    with pytest.raises(ValueError, match="'layers.0.ffn_norm.weight' is missing"):
        save_hf_checkpoint(tmp_path / "c", name="llama3", args=ARGS["llama3"], state_dict=sd)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_failed_save_leaves_existing_checkpoint_intact(tmp_path, monkeypatch, overwrite):
    target = tmp_path / "c"
    if overwrite:
        _save(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()} if overwrite else None

    # The streaming writer writes one shard file at a time: fail in the middle of the second.
    real_write = hub_checkpoint._write_safetensors
    calls = []

    def failing_write(path, tensors, dtype):
        calls.append(path)
        if len(calls) == 2:  # crash in the middle of writing the second shard
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError("disk full")
        real_write(path, tensors, dtype)

    monkeypatch.setattr(hub_checkpoint, "_write_safetensors", failing_write)
    with pytest.raises(OSError, match="disk full"):
        _save(target, max_shard_bytes=20_000, overwrite=overwrite)
    assert len(calls) == 2 and calls[0] != calls[1]

    if overwrite:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    else:
        assert not target.exists()
    # No temporary or backup directories are left next to the target.
    assert sorted(p.name for p in tmp_path.iterdir()) == (["c"] if overwrite else [])


def test_failed_swap_restores_the_old_checkpoint(tmp_path, monkeypatch):
    """With overwrite=True the old directory is moved aside; if moving the new one into place
    fails, the old one is put back."""
    import os

    _, target = _save(tmp_path / "c")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real_rename = os.rename

    def flaky_rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", flaky_rename)
    with pytest.raises(OSError, match="rename failed"):
        _save(target, overwrite=True)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def _save_fused_qwen3_moe(path):
    """A Qwen3-MoE directory as transformers 5.x holds the model in memory: experts fused
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in model.safetensors. Returns transformers' model."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf_sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert hf_sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)  # the fused layout
    path.mkdir()
    save_file(hf_sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    return ref


def test_fused_expert_file_loads(tmp_path):
    """Issue 24: the names were checked against the hub layout before from_hf_state_dict unfused."""
    ref = _save_fused_qwen3_moe(tmp_path / "hf")
    name, args, model = load_model_from_hf(tmp_path / "hf")
    assert name == "qwen3_moe"
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    # One fused tensor of a layer without the other is a missing tensor, named.
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    del sd["model.layers.1.mlp.experts.down_proj"]
    save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.down_proj' is missing"):
        load_hf_checkpoint(tmp_path / "hf")


@pytest.mark.parametrize("name, flavor", [(n, f) for n, flavors in MODEL_FLAVORS.items() for f in flavors
                                          if n in ("llama3", "qwen3", "qwen3_moe") and f == "debug"])
def test_exported_config_loads_without_warnings(tmp_path, name, flavor, caplog):
    """transformers validates an exported config on every load; a debug export must pass cleanly (the
    Llama 3 debug flavor once had a shorter max_seq_len than its RoPE scaling's original window)."""
    import logging

    from transformers import AutoConfig

    args = get_model_args(name, flavor)
    model = build_model(args, seed=0)
    out = save_hf_checkpoint(tmp_path / "hf", name=name, args=args, state_dict=model.state_dict())
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()  # transformers' logger keeps its records to itself otherwise
    try:
        with caplog.at_level(logging.WARNING):
            AutoConfig.from_pretrained(out)
    finally:
        hf_logging.disable_propagation()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
