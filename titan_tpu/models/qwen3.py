"""Qwen3 dense flavors (dimensions as published in Qwen's HF config.json files).

Qwen3 differs from Llama 3 by per-head RMSNorm on q and k (qk_norm), an explicit head_dim of
128 (not always dim / n_heads, e.g. 0.6B: 1024 / 16 = 64), rope_theta 1e6 without scaling,
rms eps 1e-6, and tied embeddings on the small models.
"""

from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.family import Family, HFMapping

_VOCAB = 151936
_MAX_POS = 40960


def sliding_window_config(args: TransformerArgs) -> dict:
    """Qwen configs' sliding-window keys, written off (the native model attends to the whole window)."""
    return dict(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)


def _qwen3(**kwargs) -> TransformerArgs:
    defaults = dict(vocab_size=_VOCAB, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0,
                    qk_norm=True, max_seq_len=_MAX_POS)
    defaults.update(kwargs)
    return TransformerArgs(**defaults)


QWEN3_FLAVORS: dict[str, TransformerArgs] = {
    # Tiny model for tests and CPU runs: GQA, head_dim 64 != dim / n_heads (32), tied.
    "debug": _qwen3(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2048,
                    ffn_hidden_dim=768, tie_embeddings=True, max_seq_len=4096),
    "0.6B": _qwen3(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072,
                   tie_embeddings=True),
    "1.7B": _qwen3(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144,
                   tie_embeddings=True),
    "4B": _qwen3(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728,
                 tie_embeddings=True),
    "8B": _qwen3(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288),
    "14B": _qwen3(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408),
    "32B": _qwen3(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600),
}

FAMILY = Family(
    name="qwen3",
    flavors=QWEN3_FLAVORS,
    hf=HFMapping(architecture="Qwen3ForCausalLM", model_type="qwen3", config_from_args=sliding_window_config),
    qk_norm=True,
)
