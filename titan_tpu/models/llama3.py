"""Llama 3 / 3.1 / 3.2 flavors (dimensions as published in Meta's HF config.json files)."""

from titan_tpu.models.common.transformer import RopeScaling, TransformerArgs
from titan_tpu.models.family import Family, HFMapping

# Llama 3.1 (8B/70B/405B) scales RoPE by 8 from an 8k original context; Llama 3.2 (1B/3B) by 32.
_ROPE_3_1 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=8192)
_ROPE_3_2 = dict(_ROPE_3_1, factor=32.0)
_VOCAB = 128256
_MAX_POS = 131072


def _llama(**kwargs) -> TransformerArgs:
    defaults = dict(vocab_size=_VOCAB, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=_MAX_POS)
    defaults.update(kwargs)
    return TransformerArgs(**defaults)


LLAMA3_FLAVORS: dict[str, TransformerArgs] = {
    # Tiny model for tests and CPU runs: 6,163,712 parameters.
    # max_seq_len above the 8,192 positions Llama 3.1's RoPE scaling starts from, as the real models
    # have it (transformers warns on every load of an export otherwise); runs build the table at seq_len.
    "debug": _llama(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
                    ffn_hidden_dim=768, rope_scaling=RopeScaling(**_ROPE_3_1), max_seq_len=16384),
    # Llama 3.2 1B and 3B tie the output projection to the embeddings.
    "1B": _llama(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192,
                 rope_scaling=RopeScaling(**_ROPE_3_2), tie_embeddings=True),
    "3B": _llama(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden_dim=8192,
                 rope_scaling=RopeScaling(**_ROPE_3_2), tie_embeddings=True),
    "8B": _llama(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
                 rope_scaling=RopeScaling(**_ROPE_3_1)),
    "70B": _llama(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672,
                  rope_scaling=RopeScaling(**_ROPE_3_1)),
    "405B": _llama(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248,
                   rope_scaling=RopeScaling(**_ROPE_3_1)),
}

FAMILY = Family(
    name="llama3",
    flavors=LLAMA3_FLAVORS,
    hf=HFMapping(architecture="LlamaForCausalLM", model_type="llama", explicit_head_dim=False,
                 config_from_args=lambda args: {"mlp_bias": False}),
)
