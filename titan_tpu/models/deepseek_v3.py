"""DeepSeek-V3 flavors (dimensions as published in the HF config.json files).

DeepSeek-V3 is the one Transformer with multi-head latent attention (`TransformerArgs.mla`,
models/common/mla.py) and a DeepSeek router (`MoEArgs`: sigmoid scores, group-limited top-k,
routed_scaling_factor, shared experts), its first `first_k_dense_replace` layers dense SwiGLU
(`MoEArgs.mlp_only_layers`). The auxiliary-loss-free balancing bias is `expert_bias`
(model.moe_load_balance = "expert_bias"), HF's `e_score_correction_bias`. RoPE covers only the
qk_rope_head_dim part of each head (so `head_dim` is that width), with YaRN scaling on 671B.

Multi-token prediction (model.mtp_num_layers, models/common/mtp.py) is off unless configured: the
MTP layer of a published checkpoint (model.layers.{num_hidden_layers}.*) is then skipped on import,
as transformers skips it, and read when it is on.
"""

from titan_tpu.models.common.mla import MLAArgs
from titan_tpu.models.common.moe import MoEArgs
from titan_tpu.models.common.rope import RopeScaling
from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.family import Family, HFMapping


def _deepseek_v3(*, first_k_dense: int, mla: MLAArgs, num_experts: int, top_k: int, moe_hidden: int,
                 num_shared: int, n_group: int = 1, topk_group: int = 1, route_scale: float = 1.0,
                 **kwargs) -> TransformerArgs:
    moe = MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=moe_hidden, norm_topk_prob=True,
                  mlp_only_layers=tuple(range(first_k_dense)), load_balance="expert_bias", score_func="sigmoid",
                  n_group=n_group, topk_group=topk_group, route_scale=route_scale, num_shared_experts=num_shared)
    defaults = dict(norm_eps=1e-6, rope_theta=10000.0, tie_embeddings=False, moe=moe, mla=mla)
    defaults.update(kwargs)
    return TransformerArgs(n_kv_heads=defaults["n_heads"], **defaults)  # MLA: one key-value head per head


DEEPSEEK_V3_FLAVORS: dict[str, TransformerArgs] = {
    # Tiny model for tests and CPU runs: one dense layer then MoE layers, low-rank query, 8 experts
    # in 2 groups (top-1 group, top-2 experts), one shared expert.
    "debug": _deepseek_v3(dim=256, n_layers=4, n_heads=8, vocab_size=2048, ffn_hidden_dim=512, max_seq_len=4096,
                          first_k_dense=1, mla=MLAArgs(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                                                       qk_rope_head_dim=16, v_head_dim=32),
                          num_experts=8, top_k=2, moe_hidden=128, num_shared=1, n_group=2, topk_group=1),
    # The 16B shape as Moonlight-16B-A3B publishes it (DeepSeek-V2-Lite's dimensions with
    # DeepSeek-V3's sigmoid router): full-rank query, 64 experts top-6, 2 shared.
    "16B": _deepseek_v3(dim=2048, n_layers=27, n_heads=16, vocab_size=163840, ffn_hidden_dim=11264,
                        norm_eps=1e-5, rope_theta=50000.0, max_seq_len=8192, first_k_dense=1,
                        mla=MLAArgs(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                    v_head_dim=128),
                        num_experts=64, top_k=6, moe_hidden=1408, num_shared=2, route_scale=2.446),
    # DeepSeek-V3 / V3.1 / Kimi-K2-style 671B: 256 experts in 8 groups (top-4 groups, top-8
    # experts), one shared, YaRN x40 over a 4K original context.
    "671B": _deepseek_v3(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_dim=18432,
                         max_seq_len=163840, first_k_dense=3,
                         rope_scaling=RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                                  beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                         mla=MLAArgs(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                     v_head_dim=128),
                         num_experts=256, top_k=8, moe_hidden=2048, num_shared=1, n_group=8, topk_group=4,
                         route_scale=2.5),
}


def args_from_config(config: dict) -> dict:
    """The `moe` and `mla` args of a DeepSeek-V3 config.json dict."""
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("rope_interleave", True)):
        if config.get(key, ok) != ok:
            raise ValueError(f"HF config has {key}={config[key]!r}; DeepSeek-V3 supports only {ok!r}")
    experts = config.get("n_routed_experts", config.get("num_local_experts"))
    first_dense = int(config.get("first_k_dense_replace") or 0)
    moe = MoEArgs(num_experts=int(experts), top_k=int(config["num_experts_per_tok"]),
                  hidden_dim=int(config["moe_intermediate_size"]), norm_topk_prob=bool(config.get("norm_topk_prob")),
                  mlp_only_layers=tuple(range(first_dense)), load_balance="expert_bias", score_func="sigmoid",
                  n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                  route_scale=float(config.get("routed_scaling_factor", 1.0)),
                  num_shared_experts=int(config.get("n_shared_experts") or 0))
    mla = MLAArgs(q_lora_rank=int(config.get("q_lora_rank") or 0), kv_lora_rank=int(config["kv_lora_rank"]),
                  qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                  v_head_dim=int(config["v_head_dim"]))
    return {"moe": moe, "mla": mla}


def config_from_args(args: TransformerArgs) -> dict:
    """DeepSeek-V3's own config.json keys."""
    m, a = args.moe, args.mla
    first_dense = len(m.mlp_only_layers)
    if m.mlp_only_layers != tuple(range(first_dense)) or m.decoder_sparse_step != 1 or m.score_func != "sigmoid":
        raise ValueError("DeepSeek-V3's HF layout has dense layers only first (first_k_dense_replace) and sigmoid "
                         f"routing; this model has dense layers {m.mlp_only_layers}, score_func {m.score_func!r}")
    return {"moe_intermediate_size": m.hidden_dim, "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.num_shared_experts, "routed_scaling_factor": m.route_scale, "n_group": m.n_group,
            "topk_group": m.topk_group, "norm_topk_prob": m.norm_topk_prob, "first_k_dense_replace": first_dense,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "rope_interleave": True,
            "num_nextn_predict_layers": args.mtp_num_layers}


FAMILY = Family(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    hf=HFMapping(architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3", args_from_config=args_from_config,
                 config_from_args=config_from_args),
    moe=True,
    router_bias=True,
    mtp=True,
)
