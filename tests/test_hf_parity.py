"""Logit parity with Hugging Face transformers, in both directions.

Import: build a random HF model, convert its state dict with from_hf_state_dict, and check the
native model gives the same logits. Export: convert back with to_hf_state_dict, and save with
save_hf_checkpoint then load with transformers' from_pretrained: same logits again.
"""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titan_tpu.models.common import RopeScaling, Transformer, TransformerArgs  # noqa: E402
from titan_tpu.models.common.rope import rope_cache  # noqa: E402
from titan_tpu.models.hub.adapter import (  # noqa: E402
    from_hf_state_dict,
    hf_config_from_model_args,
    model_args_from_hf_config,
    to_hf_state_dict,
)
from titan_tpu.models.hub.checkpoint import load_model_from_hf, save_hf_checkpoint  # noqa: E402
from titan_tpu.models.registry import build_model  # noqa: E402

# Llama 3.1 scaling with a short original context so that a ~200-token test sequence reaches
# the scaled (low-frequency) and smoothed bands: with theta 5e5 and head_dim 16 the wavelengths
# are 6, 33, 168, ... tokens, against thresholds 64 / 4 = 16 and 64 / 1 = 64.
_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)
SEQ_LEN = 200

CASES = {
    "llama_gqa_scaled": ("llama3", TransformerArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=96,
        rope_theta=500000.0, rope_scaling=_SCALING, max_seq_len=256)),
    "llama_tied_mha": ("llama3", TransformerArgs(
        dim=48, n_layers=2, n_heads=3, n_kv_heads=3, vocab_size=200, ffn_hidden_dim=80,
        rope_theta=10000.0, tie_embeddings=True, max_seq_len=256)),
    "qwen3_gqa_headdim_tied": ("qwen3", TransformerArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=24, vocab_size=256,
        ffn_hidden_dim=96, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=True,
        max_seq_len=256)),
    "qwen3_untied": ("qwen3", TransformerArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128,
        ffn_hidden_dim=64, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=256)),
}


def _hf_model(name: str, args: TransformerArgs):
    config_dict = hf_config_from_model_args(name, args)
    if name == "llama3":
        config, cls = transformers.LlamaConfig(**config_dict), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**config_dict), transformers.Qwen3ForCausalLM
    config._attn_implementation = "sdpa"
    model = cls(config).eval()
    # HF inits norms to 1 and projections with std 0.02: randomise everything more strongly
    # so that a wrong permutation of q_norm/k_norm or a swapped w1/w3 cannot hide.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model


def _tokens(args: TransformerArgs) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab_size, (2, SEQ_LEN), generator=gen)


def _assert_logits_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_match_hf(case, tmp_path):
    name, args = CASES[case]
    hf = _hf_model(name, args)
    tokens = _tokens(args)
    with torch.no_grad():
        hf_logits = hf(input_ids=tokens).logits

    # HF -> native.
    model = build_model(args)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    with torch.no_grad():
        _assert_logits_close(model(tokens), hf_logits)

    # native -> HF state dict: exactly the HF tensors back (tied lm_head omitted as HF does).
    exported = to_hf_state_dict(model.state_dict(), args)
    hf_sd = hf.state_dict()
    if args.tie_embeddings:
        hf_sd.pop("lm_head.weight")
    assert exported.keys() == hf_sd.keys()
    for key, t in exported.items():
        torch.testing.assert_close(t, hf_sd[key], rtol=0, atol=0)

    # native -> HF checkpoint on disk -> transformers.from_pretrained.
    out = save_hf_checkpoint(tmp_path / "hf", name=name, args=args, state_dict=model.state_dict())
    cls = type(hf)
    reloaded = cls.from_pretrained(out, attn_implementation="sdpa").eval()
    assert reloaded.dtype == torch.float32
    with torch.no_grad():
        _assert_logits_close(reloaded(input_ids=tokens).logits, hf_logits)

    # ... and back through our own loader, with the config round-tripping exactly.
    name2, args2, model2 = load_model_from_hf(out)
    assert (name2, args2) == (name, args)
    with torch.no_grad():
        _assert_logits_close(model2(tokens), hf_logits)


def test_hf_pretrained_dir_loads_natively(tmp_path):
    """A directory written by transformers' own save_pretrained loads with our loader."""
    name, args = CASES["qwen3_gqa_headdim_tied"]
    hf = _hf_model(name, args)
    hf.save_pretrained(tmp_path / "hf")
    name2, args2, model = load_model_from_hf(tmp_path / "hf")
    assert name2 == "qwen3" and args2 == args
    tokens = _tokens(args)
    with torch.no_grad():
        _assert_logits_close(model(tokens), hf(input_ids=tokens).logits)


def test_llama31_scaling_changes_the_rope_table():
    _, args = CASES["llama_gqa_scaled"]
    scaled = rope_cache(head_dim=args.hd, max_seq_len=SEQ_LEN, theta=args.rope_theta,
                        scaling=args.rope_scaling)
    plain = rope_cache(head_dim=args.hd, max_seq_len=SEQ_LEN, theta=args.rope_theta, scaling=None)
    # Table rows are [pair, (cos, sin)]. The highest frequency pair (wavelength 6 < 16) is
    # untouched; lower ones are scaled.
    torch.testing.assert_close(scaled[:, :1], plain[:, :1], rtol=0, atol=0)
    assert (scaled[:, 1:] - plain[:, 1:]).abs().max() > 0.5
    # And HF computes the same scaled inverse frequencies.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**hf_config_from_model_args("llama3", args))
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    from titan_tpu.models.common.rope import rope_inv_freq

    ours = rope_inv_freq(head_dim=args.hd, theta=args.rope_theta, scaling=args.rope_scaling)
    torch.testing.assert_close(ours, hf_inv_freq, rtol=0, atol=0)


def test_hf_config_round_trip_of_real_flavors():
    from titan_tpu.models.registry import MODEL_FLAVORS

    for name, flavors in MODEL_FLAVORS.items():
        for flavor, args in flavors.items():
            assert model_args_from_hf_config(hf_config_from_model_args(name, args)) == (name, args)


def test_transformers_5_config_keys_are_read():
    """transformers 5 writes rope settings under rope_parameters."""
    _, args = CASES["llama_gqa_scaled"]
    config = transformers.LlamaConfig(**hf_config_from_model_args("llama3", args)).to_dict()
    assert "rope_parameters" in config
    assert model_args_from_hf_config(config) == ("llama3", args)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "unsupported HF model"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    ],
)
def test_unsupported_hf_configs(change, match):
    config = hf_config_from_model_args("llama3", CASES["llama_gqa_scaled"][1])
    config.update(change)
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config(config)


def test_native_model_is_not_hf_model_without_permutation():
    """Sanity check of the test itself: skipping the RoPE permutation breaks parity."""
    name, args = CASES["llama_gqa_scaled"]
    hf = _hf_model(name, args)
    sd = from_hf_state_dict(hf.state_dict(), args)
    sd["layers.0.attention.wq.weight"] = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    model = build_model(args)
    model.load_state_dict(sd)
    tokens = _tokens(args)
    with torch.no_grad():
        assert not torch.allclose(model(tokens), hf(input_ids=tokens).logits, atol=1e-3)
    assert isinstance(model, Transformer) and dataclasses.is_dataclass(args)
