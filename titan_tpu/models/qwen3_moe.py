"""Qwen3-MoE flavors (dimensions as published in Qwen's HF config.json files).

Qwen3-MoE is Qwen3 (per-head q/k RMSNorm, head_dim 128, rope_theta 1e6, rms eps 1e-6) with every
feed-forward a mixture of experts: 128 SwiGLU experts of width moe_intermediate_size, top-8
routing with renormalised weights (norm_topk_prob), no shared expert, untied embeddings.
`ffn_hidden_dim` is the published intermediate_size, used only by layers listed in
mlp_only_layers (none in the published models).
"""

from titan_tpu.models.common.moe import MoEArgs
from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.family import Family, HFMapping
from titan_tpu.models.qwen3 import sliding_window_config

_VOCAB = 151936
_MAX_POS = 40960


def _qwen3_moe(*, num_experts: int, top_k: int, moe_hidden: int, **kwargs) -> TransformerArgs:
    defaults = dict(vocab_size=_VOCAB, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                    max_seq_len=_MAX_POS, tie_embeddings=False,
                    moe=MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=moe_hidden, norm_topk_prob=True))
    defaults.update(kwargs)
    return TransformerArgs(**defaults)


QWEN3_MOE_FLAVORS: dict[str, TransformerArgs] = {
    # Tiny model for tests and CPU runs: 8 experts, top-2, GQA, head_dim 32 != dim / n_heads.
    "debug": _qwen3_moe(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048,
                        ffn_hidden_dim=512, num_experts=8, top_k=2, moe_hidden=128, max_seq_len=4096),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active.
    "30b_a3b": _qwen3_moe(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_dim=6144,
                          num_experts=128, top_k=8, moe_hidden=768),
    # Qwen3-235B-A22B: 235B parameters, 22B active.
    "235b_a22b": _qwen3_moe(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_dim=12288,
                            num_experts=128, top_k=8, moe_hidden=1536),
}


def moe_args_from_config(config: dict) -> dict:
    """The `moe` args of a Qwen3-MoE config.json dict."""
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("HF config has a shared expert (Qwen2-MoE style); only Qwen3-MoE is supported")
    # Published config.json files say num_experts; transformers 5.x writes num_local_experts.
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    return {"moe": MoEArgs(num_experts=int(num_experts), top_k=int(config["num_experts_per_tok"]),
                           hidden_dim=int(config["moe_intermediate_size"]),
                           norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                           decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
                           mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
                           aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))}


def config_from_moe_args(args: TransformerArgs) -> dict:
    """Qwen3-MoE's config.json keys: Qwen's sliding-window keys (off), then the experts'."""
    m = args.moe
    return {**sliding_window_config(args), "num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.hidden_dim, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": m.decoder_sparse_step, "mlp_only_layers": list(m.mlp_only_layers),
            "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False}


FAMILY = Family(
    name="qwen3_moe",
    flavors=QWEN3_MOE_FLAVORS,
    hf=HFMapping(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", args_from_config=moe_args_from_config,
                 config_from_args=config_from_moe_args),
    qk_norm=True,
    moe=True,
)
