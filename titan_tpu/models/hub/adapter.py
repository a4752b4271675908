"""Hugging Face <-> native mapping: config.json fields and state-dict names/layouts.

Pure mapping: no file I/O and no transformers import (see checkpoint.py for safetensors I/O).

Layout difference: HF Llama/Qwen3 apply RoPE in the "rotate half" convention, pairing element i
of a head with element i + hd/2; the native model pairs (2i, 2i+1). Permuting the rows of each
head of wq and wk (HF row j -> native row 2j, HF row j + hd/2 -> native row 2j + 1) makes both
models compute identical attention scores, since q.k is unchanged when q and k are permuted alike.
Qwen3's q_norm/k_norm weights act per element of head_dim, so they get the same permutation.

Qwen3-MoE experts: hub checkpoints store one tensor per expert
(`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`); transformers 5.x keeps them fused in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]).
Both import; the native model stacks them per expert (`moe.experts.w1/w3` [E, I, H], `w2` [E, H, I])
and export writes the hub layout. The router is `mlp.gate.weight` <-> `moe.router.gate.weight`.
"""

import dataclasses

import torch
from torch import Tensor

from titan_tpu.models.common.transformer import RopeScaling, TransformerArgs
from titan_tpu.models.family import Family
from titan_tpu.models.hub.sources import (
    InMemory,
    Narrowed,
    RowsPermuted,
    Selected,
    Stacked,
    TensorSource,
    full_index,
    interleaved_to_rotate_half,
)
from titan_tpu.models.registry import FAMILIES

# (hub name under mlp.experts.{j}., native stacked name under moe.experts.)
_EXPERT_NAMES = [("gate_proj.weight", "w1"), ("up_proj.weight", "w3"), ("down_proj.weight", "w2")]

# Per-layer name pairs (HF suffix, native suffix) under model.layers.{i}. / layers.{i}.: the Llama
# layout every native family shares (the Transformer has one block shape).
_LAYER_NAMES = [
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("self_attn.q_norm.weight", "attention.q_norm.weight"),
    ("self_attn.k_norm.weight", "attention.k_norm.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
]


def model_args_from_hf_config(config: dict) -> tuple[str, TransformerArgs]:
    """HF config.json dict -> (model name, TransformerArgs). Reads both the transformers 4.x
    keys (rope_theta, rope_scaling) and the 5.x key (rope_parameters); the family's record
    (models/family.py) says which family it is and reads the family's own keys."""
    family = _family_of(config)
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                    ("use_sliding_window", False)):
        if config.get(key, ok) != ok:
            raise ValueError(f"HF config has {key}={config[key]!r}; only {ok!r} is supported")
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "yarn":
        scaling = _yarn_scaling(rope, config)
    elif rope_type == "default":
        scaling = None
    else:
        raise ValueError(f"HF config has rope type {rope_type!r}; supported: 'default', 'llama3', 'yarn'")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    # Llama flavors leave head_dim implicit; keep it explicit only where it matters.
    if not family.hf.explicit_head_dim and head_dim == dim // n_heads:
        head_dim = None
    args = TransformerArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        head_dim=head_dim,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        qk_norm=family.qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        **family.hf.args_from_config(config),
    )
    if scaling is not None and scaling.rope_type == "yarn" and args.mla is None:
        # YaRN is checked against transformers with multi-head latent attention (DeepSeek-V3) only.
        raise ValueError(f"HF config has rope type 'yarn' on {family.name}; YaRN is supported with multi-head latent "
                         "attention (deepseek_v3) only; use 'default' or 'llama3' rope scaling")
    return family.name, args


def _yarn_scaling(rope: dict, config: dict) -> RopeScaling:
    """YaRN's keys (DeepSeek-V3), with transformers' defaults for the absent ones."""
    if rope.get("attention_factor") is not None:
        raise ValueError("HF config sets rope attention_factor; only YaRN's derived one (mscale, mscale_all_dim) "
                         "is supported")
    # transformers reads the pre-extension length from max_position_embeddings when the key is absent
    original = int(rope.get("original_max_position_embeddings") or config["max_position_embeddings"])
    factor = rope.get("factor")
    return RopeScaling(rope_type="yarn", original_max_position_embeddings=original,
                       factor=float(factor if factor is not None else config["max_position_embeddings"] / original),
                       beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                       mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                       truncate=bool(rope.get("truncate", True)))


def _rope_scaling_config(s: RopeScaling | None) -> dict | None:
    """config.json's rope_scaling (transformers 4.x form) for the native scaling."""
    if s is None:
        return None
    if s.rope_type == "yarn":
        out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings":
               s.original_max_position_embeddings, "beta_fast": s.beta_fast, "beta_slow": s.beta_slow}
        out.update({k: v for k, v in (("mscale", s.mscale), ("mscale_all_dim", s.mscale_all_dim)) if v})
        return out if s.truncate else {**out, "truncate": False}
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}


def _family_of(config: dict) -> Family:
    for arch in config.get("architectures") or []:
        for family in FAMILIES.values():
            if arch == family.hf.architecture:
                return family
    for family in FAMILIES.values():
        if config.get("model_type") == family.hf.model_type:
            return family
    raise ValueError(
        f"unsupported HF model (architectures={config.get('architectures')}, "
        f"model_type={config.get('model_type')!r}); supported: "
        f"{', '.join(family.hf.architecture for family in FAMILIES.values())}"
    )


def hf_config_from_model_args(
    name: str, args: TransformerArgs, *, torch_dtype: str = "float32"
) -> dict:
    """Native args -> HF config.json dict, loadable by transformers 4.x and 5.x (rope written
    in the 4.x form, which 5.x still reads)."""
    if name not in FAMILIES:
        raise ValueError(f"cannot export model {name!r} to HF; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    if args.qk_norm != family.qk_norm:
        raise ValueError(f"model {name!r} with qk_norm={args.qk_norm} has no HF equivalent")
    if (args.moe is not None) != family.moe:
        raise ValueError(f"model {name!r} with moe={args.moe} has no HF equivalent")
    if args.mtp_num_layers and not family.mtp:
        raise ValueError(f"model {name!r} with mtp_num_layers={args.mtp_num_layers} has no HF equivalent")
    if args.moe is not None and args.moe.load_balance == "expert_bias" and not family.router_bias:
        raise ValueError("a model trained with moe.load_balance expert_bias routes with a per-expert bias that "
                         "Hugging Face's Qwen3-MoE does not have; export models trained with aux_loss or none")
    s = args.rope_scaling
    config = {
        "architectures": [family.hf.architecture],
        "model_type": family.hf.model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.hd,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling_config(s),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": torch_dtype,  # transformers 4.x key
        "dtype": torch_dtype,  # transformers >= 4.56 key
    }
    config.update(family.hf.config_from_args(args))
    return config


def hf_param_shapes(args: TransformerArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this model holds, with its shape. For tied models
    lm_head.weight is listed too, though checkpoints usually omit it."""
    native = native_param_shapes(args)
    native[""] = native["tok_embeddings.weight"]  # tied lm_head (see _name_pairs)
    shapes = {hf_name: native[native_name] for hf_name, native_name in _name_pairs(args)}
    for hf_name, native_name, expert in _expert_names(args):
        shapes[hf_name] = native[native_name][1:]
    for hf_name in _zero_router_biases(args):
        shapes[hf_name] = (args.moe.num_experts,)
    for hf_name, native_name in _mtp_shared_copies(args):
        shapes[hf_name] = native[native_name]
    return shapes


def hf_fused_expert_shapes(args: TransformerArgs) -> dict[str, tuple[int, ...]]:
    """The expert tensors of transformers 5.x's fused layout (what its save_pretrained may write
    instead of one tensor per expert): gate_up_proj [E, 2I, H] and down_proj [E, H, I] per MoE layer."""
    args = _blocks_args(args)
    shapes = {}
    for i in range(args.n_layers):
        if args.is_moe_layer(i):
            m = args.moe
            shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (m.num_experts, 2 * m.hidden_dim, args.dim)
            shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (m.num_experts, args.dim, m.hidden_dim)
    return shapes


def fuse_experts(hf_sd: dict[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """Hub layout (one tensor per expert) -> transformers 5.x's fused layout; the inverse of
    reading (`_fused_expert_sources`)."""
    args = _blocks_args(args)
    out = dict(hf_sd)
    for i in range(args.n_layers):
        if not args.is_moe_layer(i):
            continue
        prefix = f"model.layers.{i}.mlp.experts."
        experts = range(args.moe.num_experts)
        gate = [out.pop(f"{prefix}{j}.gate_proj.weight") for j in experts]
        up = [out.pop(f"{prefix}{j}.up_proj.weight") for j in experts]
        down = [out.pop(f"{prefix}{j}.down_proj.weight") for j in experts]
        out[prefix + "gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        out[prefix + "down_proj"] = torch.stack(down)
    return out


def native_param_shapes(args: TransformerArgs) -> dict[str, tuple[int, ...]]:
    """Native state-dict names -> shapes, computed from the args (no model needed)."""
    if args.mtp_num_layers:
        d, blocks = args.dim, native_param_shapes(_blocks_args(args))
        shapes = {_native_block_name(name, args): shape for name, shape in blocks.items()}
        shapes.update((native, (d, 2 * d) if native.endswith("eh_proj.weight") else (d,))
                      for _, native in _mtp_pairs(args))
        return shapes
    d, hd, f = args.dim, args.hd, args.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        if args.mla is not None:
            shapes.update(_mla_shapes(args, p + "attention."))
        else:
            shapes[p + "attention.wq.weight"] = (args.n_heads * hd, d)
            shapes[p + "attention.wk.weight"] = (args.n_kv_heads * hd, d)
            shapes[p + "attention.wv.weight"] = (args.n_kv_heads * hd, d)
            shapes[p + "attention.wo.weight"] = (d, args.n_heads * hd)
        if args.qk_norm:
            shapes[p + "attention.q_norm.weight"] = (hd,)
            shapes[p + "attention.k_norm.weight"] = (hd,)
        if args.is_moe_layer(i):
            m = args.moe
            shapes[p + "moe.router.gate.weight"] = (m.num_experts, d)
            shapes[p + "moe.experts.w1"] = (m.num_experts, m.hidden_dim, d)
            shapes[p + "moe.experts.w2"] = (m.num_experts, d, m.hidden_dim)
            shapes[p + "moe.experts.w3"] = (m.num_experts, m.hidden_dim, d)
            if m.num_shared_experts:
                shared = m.num_shared_experts * m.hidden_dim
                shapes[p + "moe.shared_experts.w1.weight"] = (shared, d)
                shapes[p + "moe.shared_experts.w2.weight"] = (d, shared)
                shapes[p + "moe.shared_experts.w3.weight"] = (shared, d)
            if m.load_balance == "expert_bias" and m.score_func == "sigmoid":  # HF's e_score_correction_bias
                shapes[p + "moe.expert_bias"] = (m.num_experts,)
        else:
            shapes[p + "feed_forward.w1.weight"] = (f, d)
            shapes[p + "feed_forward.w2.weight"] = (d, f)
            shapes[p + "feed_forward.w3.weight"] = (f, d)
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


def _mla_shapes(args: TransformerArgs, p: str) -> dict[str, tuple[int, ...]]:
    """Native shapes of one MLA layer (models/common/mla.py), names under `p`."""
    m, d, H = args.mla, args.dim, args.n_heads
    shapes = {}
    if m.q_lora_rank:
        shapes[p + "wq_a.weight"] = (m.q_lora_rank, d)
        shapes[p + "q_norm.weight"] = (m.q_lora_rank,)
        shapes[p + "wq_b.weight"] = (H * m.qk_head_dim, m.q_lora_rank)
    else:
        shapes[p + "wq.weight"] = (H * m.qk_head_dim, d)
    shapes[p + "wkv_a.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, d)
    shapes[p + "kv_norm.weight"] = (m.kv_lora_rank,)
    shapes[p + "wkv_b.weight"] = (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes[p + "wo.weight"] = (d, H * m.v_head_dim)
    return shapes


# MLA's (HF suffix under self_attn., native suffix under attention.); the query's depend on q_lora_rank.
_MLA_QUERY_NAMES = [("q_proj.weight", "wq.weight")]
_MLA_LORA_QUERY_NAMES = [("q_a_proj.weight", "wq_a.weight"), ("q_a_layernorm.weight", "q_norm.weight"),
                         ("q_b_proj.weight", "wq_b.weight")]
_MLA_KV_NAMES = [("kv_a_proj_with_mqa.weight", "wkv_a.weight"), ("kv_a_layernorm.weight", "kv_norm.weight"),
                 ("kv_b_proj.weight", "wkv_b.weight"), ("o_proj.weight", "wo.weight")]
_SHARED_EXPERT_NAMES = [("gate_proj.weight", "w1.weight"), ("up_proj.weight", "w3.weight"),
                        ("down_proj.weight", "w2.weight")]


def _zero_router_biases(args: TransformerArgs) -> list[str]:
    """HF names of the router biases a sigmoid-routed model without expert_bias exports as zeros
    (transformers' DeepSeek-V3 always has e_score_correction_bias)."""
    m, args = args.moe, _blocks_args(args)
    if m is None or m.score_func != "sigmoid" or m.load_balance == "expert_bias":
        return []
    return [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(args.n_layers) if args.is_moe_layer(i)]


def _name_pairs(args: TransformerArgs) -> list[tuple[str, str]]:
    """(HF name, native name) for every tensor mapped one to one (experts: `_expert_names`); for
    tied models lm_head maps to nothing ("")."""
    if args.mtp_num_layers:
        pairs = [(hf, _native_block_name(native, args)) for hf, native in _name_pairs(_blocks_args(args))]
        return pairs + _mtp_pairs(args)
    pairs = [("model.embed_tokens.weight", "tok_embeddings.weight")]
    for i in range(args.n_layers):
        for hf_suffix, native_suffix in _LAYER_NAMES:
            if "_norm." in hf_suffix and not args.qk_norm:
                continue
            if hf_suffix.startswith("mlp.") and args.is_moe_layer(i):
                continue
            if hf_suffix.startswith("self_attn.") and args.mla is not None:
                continue
            pairs.append((f"model.layers.{i}.{hf_suffix}", f"layers.{i}.{native_suffix}"))
        if args.mla is not None:
            query = _MLA_LORA_QUERY_NAMES if args.mla.q_lora_rank else _MLA_QUERY_NAMES
            pairs += [(f"model.layers.{i}.self_attn.{hf}", f"layers.{i}.attention.{native}")
                      for hf, native in query + _MLA_KV_NAMES]
        if args.is_moe_layer(i):
            pairs.append((f"model.layers.{i}.mlp.gate.weight", f"layers.{i}.moe.router.gate.weight"))
            m = args.moe
            if m.num_shared_experts:
                pairs += [(f"model.layers.{i}.mlp.shared_experts.{hf}", f"layers.{i}.moe.shared_experts.{native}")
                          for hf, native in _SHARED_EXPERT_NAMES]
            if m.load_balance == "expert_bias" and m.score_func == "sigmoid":
                pairs.append((f"model.layers.{i}.mlp.gate.e_score_correction_bias", f"layers.{i}.moe.expert_bias"))
    pairs.append(("model.norm.weight", "norm.weight"))
    pairs.append(("lm_head.weight", "" if args.tie_embeddings else "output.weight"))
    return pairs


def _expert_names(args: TransformerArgs) -> list[tuple[str, str, int]]:
    """(HF hub name, native stacked name, expert index) for every expert weight of an MoE model."""
    if args.mtp_num_layers:
        return [(hf, _native_block_name(native, args), j) for hf, native, j in _expert_names(_blocks_args(args))]
    out = []
    for i in range(args.n_layers):
        if args.is_moe_layer(i):
            for j in range(args.moe.num_experts):
                for hub, native in _EXPERT_NAMES:
                    out.append((f"model.layers.{i}.mlp.experts.{j}.{hub}", f"layers.{i}.moe.experts.{native}", j))
    return out


def _fused_expert_sources(sources: dict[str, TensorSource], args: TransformerArgs) -> dict[str, TensorSource]:
    """The native stacked experts of every layer stored in transformers 5.x's fused layout
    (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]), by native name; their HF
    tensors are taken out of `sources`. The native w1 / w3 are the two halves of gate_up_proj, w2 is
    down_proj as it is."""
    natives: dict[str, dict[str, str]] = {}  # layer prefix -> hub suffix -> native name
    for hf, native, _ in _expert_names(args):
        prefix, _, rest = hf.partition(".mlp.experts.")
        natives.setdefault(prefix + ".mlp.experts.", {})[rest.split(".", 1)[1]] = native
    out = {}
    for prefix, by_hub in natives.items():
        if prefix + "gate_up_proj" not in sources:
            continue
        gate_up = sources.pop(prefix + "gate_up_proj")
        down = sources.pop(prefix + "down_proj", None)
        if down is None:
            raise ValueError(f"tensor {prefix + 'down_proj'!r} is missing from the HF state dict")
        hidden = gate_up.shape[1] // 2
        out[by_hub["gate_proj.weight"]] = Narrowed(gate_up, dim=1, start=0, length=hidden)
        out[by_hub["up_proj.weight"]] = Narrowed(gate_up, dim=1, start=hidden, length=hidden)
        out[by_hub["down_proj.weight"]] = down
    return out


def _permute(native_name: str, args: TransformerArgs):
    """(heads to permute over) for tensors whose rows follow RoPE's layout, else None. MLA's
    RoPE parts are interleaved in DeepSeek's layout too (transformers' rope_interleave): none."""
    if args.mla is not None:
        return None
    if native_name.endswith("attention.wq.weight"):
        return args.n_heads
    if native_name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    if native_name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def from_hf_state_dict(hf_sd: dict[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """HF names/layout -> native, every tensor in memory: `native_sources_from_hf` read whole.
    Raises ValueError on a missing or unexpected tensor."""
    sources = native_sources_from_hf({k: InMemory(v) for k, v in hf_sd.items()}, args)
    return {name: source.read(full_index(source.shape)) for name, source in sources.items()}


def native_sources_from_hf(sources: dict[str, TensorSource], args: TransformerArgs) -> dict[str, TensorSource]:
    """HF name -> source, to native name -> source (models/hub/sources.py): the names mapped, wq and
    wk's rows (and the q/k norms) put in the native RoPE layout, the experts stacked. Nothing is read
    but the routers' zero biases. Raises ValueError on a missing or unexpected tensor.

    Tied models: lm_head.weight may be present (it is the embedding) and is dropped. Legacy
    `rotary_emb.inv_freq` buffers found in old checkpoints are ignored. MoE experts are read in
    the hub layout (one tensor per expert) or transformers 5.x's fused one."""
    pairs = _name_pairs(args)
    experts = _expert_names(args)
    copies = {hf for hf, _ in _mtp_shared_copies(args)}  # the shared embedding and head, read once
    sources = {k: v for k, v in sources.items() if k not in copies and not k.endswith("rotary_emb.inv_freq")}
    for name in _zero_router_biases(args):
        bias = sources.pop(name, None)
        if bias is not None and bool(bias.read(full_index(bias.shape)).any()):
            raise ValueError(f"{name} is not zero: the model routes with it; set model.moe_load_balance = "
                             "\"expert_bias\" to keep it")
    fused = _fused_expert_sources(sources, args) if experts else {}
    known = {hf for hf, _ in pairs} | {hf for hf, _, _ in experts}
    unexpected = [k for k in sources if k not in known]
    if unexpected:
        raise ValueError(
            f"unexpected tensor {unexpected[0]!r} in HF state dict ({len(unexpected)} in all); "
            "the checkpoint does not match its config.json"
        )
    out: dict[str, TensorSource] = {}
    for hf_name, native_name in pairs:
        if not native_name:
            continue  # tied lm_head
        if hf_name not in sources:
            raise ValueError(f"tensor {hf_name!r} is missing from the HF state dict")
        heads = _permute(native_name, args)
        out[native_name] = sources[hf_name] if heads is None else RowsPermuted(sources[hf_name], heads)
    per_expert: dict[str, list[TensorSource]] = {}
    for hf_name, native_name, _ in experts:  # in expert order
        if native_name in fused:
            continue
        if hf_name not in sources:
            raise ValueError(f"tensor {hf_name!r} is missing from the HF state dict")
        per_expert.setdefault(native_name, []).append(sources[hf_name])
    out.update((name, Stacked(parts)) for name, parts in per_expert.items())
    out.update(fused)
    return out


def to_hf_state_dict(sd: dict[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """Native names/layout -> HF, every tensor in memory: `hf_sources_from_native` read whole.
    Tied models get no lm_head.weight (as HF saves them). Raises ValueError on a missing or
    unexpected tensor."""
    sources = hf_sources_from_native({k: InMemory(v) for k, v in sd.items()}, args)
    # contiguous copies: safetensors refuses tensors sharing storage (DeepSeek's MTP copies of the head)
    return {name: source.read(full_index(source.shape)).clone() for name, source in sources.items()}


def hf_sources_from_native(sources: dict[str, TensorSource], args: TransformerArgs) -> dict[str, TensorSource]:
    """Native name -> source, to HF name -> source (the inverse of `native_sources_from_hf`): wq
    and wk's rows back in HF's rotate-half layout, each expert of a stack its own tensor (the hub
    layout), the routers' zero biases, DeepSeek's MTP copies of the embedding and head. Tied
    models get no lm_head.weight. Raises ValueError on a missing or unexpected tensor."""
    pairs = _name_pairs(args)
    experts = _expert_names(args)
    known = {native for _, native in pairs if native} | {native for _, native, _ in experts}
    unexpected = [k for k in sources if k not in known]
    if unexpected:
        raise ValueError(
            f"unexpected tensor {unexpected[0]!r} in the native state dict "
            f"({len(unexpected)} in all); it does not match the model args"
        )
    missing = sorted(known - set(sources))
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is missing from the native state dict")
    out: dict[str, TensorSource] = {}
    for hf_name, native_name in pairs:
        if not native_name:
            continue
        heads = _permute(native_name, args)
        source = sources[native_name]
        out[hf_name] = source if heads is None else RowsPermuted(source, heads, to_native=False)
    for hf_name, native_name, expert in experts:
        out[hf_name] = Selected(sources[native_name], expert)
    for hf_name in _zero_router_biases(args):
        out[hf_name] = InMemory(torch.zeros(args.moe.num_experts, dtype=torch.float32))
    for hf_name, native_name in _mtp_shared_copies(args):  # as DeepSeek publishes them
        out[hf_name] = sources[native_name]
    return out


# Multi-token prediction (models/common/mtp.py) in DeepSeek-V3's layout: depth k is HF layer
# n_layers + k, its block under the usual layer names, beside enorm, hnorm, eh_proj and
# shared_head.norm, and copies of the shared embedding (embed_tokens) and output (shared_head.head).


def _blocks_args(args: TransformerArgs) -> TransformerArgs:
    """The args with the MTP blocks counted as layers, as the HF layout numbers them."""
    if not args.mtp_num_layers:
        return args
    return dataclasses.replace(args, n_layers=args.n_layers + args.mtp_num_layers, mtp_num_layers=0)


def _native_block_name(name: str, args: TransformerArgs) -> str:
    """`layers.{n_layers + k}.x` (a name of `_blocks_args`) -> `mtp.{k}.block.x`; others unchanged."""
    if not name.startswith("layers."):
        return name
    index, rest = name[len("layers."):].split(".", 1)
    k = int(index) - args.n_layers
    return name if k < 0 else f"mtp.{k}.block.{rest}"


def _mtp_pairs(args: TransformerArgs) -> list[tuple[str, str]]:
    """(HF name, native name) of each MTP depth's own tensors besides its block."""
    pairs = []
    for k in range(args.mtp_num_layers):
        hf, native = f"model.layers.{args.n_layers + k}.", f"mtp.{k}."
        pairs += [(hf + "enorm.weight", native + "enorm.weight"), (hf + "hnorm.weight", native + "hnorm.weight"),
                  (hf + "eh_proj.weight", native + "eh_proj.weight"),
                  (hf + "shared_head.norm.weight", native + "norm.weight")]
    return pairs


def _mtp_shared_copies(args: TransformerArgs) -> list[tuple[str, str]]:
    """(HF name, native name) of the copies of the shared embedding and output projection that
    DeepSeek's checkpoint stores under each MTP layer: written on export, ignored on import."""
    output = "tok_embeddings.weight" if args.tie_embeddings else "output.weight"
    return [pair for k in range(args.mtp_num_layers)
            for pair in ((f"model.layers.{args.n_layers + k}.embed_tokens.weight", "tok_embeddings.weight"),
                         (f"model.layers.{args.n_layers + k}.shared_head.head.weight", output))]


def adapters_to_hf(adapters: dict[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """LoRA adapters (models/lora.py) by native name (`layers.0.attention.wq.lora_B`) -> by HF
    name (`model.layers.0.self_attn.q_proj.lora_B`). B's rows are the output rows of the weight,
    so they take the weight's RoPE permutation; A's columns are the unchanged input."""
    hf_of = {native[: -len("weight")]: hf[: -len("weight")] for hf, native in _name_pairs(args) if native}
    out = {}
    for name, t in adapters.items():
        module, _, leaf = name.rpartition(".")
        if f"{module}." not in hf_of:
            raise ValueError(f"LoRA adapter {name!r} sits on a layer the HF layout has no one-to-one tensor for")
        heads = _permute(f"{module}.weight", args)
        out[f"{hf_of[module + '.']}{leaf}"] = t if heads is None or leaf == "lora_A" else \
            interleaved_to_rotate_half(t, heads)
    return out
