"""FLOPs per trained token of an HF-backend model (MFU and the throughput log)."""

from __future__ import annotations

from titan_tpu.models.hf.config import _moe_shape, text_config
from titan_tpu.models.hf.model import HFCausalLM


def hf_flops_per_token(model: HFCausalLM, seq_len: int) -> tuple[float, str]:
    """(FLOPs per trained token, how they were counted): 6 x the non-embedding parameters a token
    uses (the output projection counted; MoE experts scaled by top_k / experts, an estimate) plus
    6 x layers x heads x head_dim x seq_len for causal attention, from the config when it names
    them."""
    text = text_config(model.hf_model.config)
    embeddings = model.hf_model.get_input_embeddings()
    output = model.hf_model.get_output_embeddings()
    # The stored weights: reading `.weight` under data parallelism or a compute cast returns a new
    # (gathered, cast) tensor each time.
    stored_embeddings = embeddings._parameters.get("weight") if embeddings is not None else None
    skip = {id(stored_embeddings)} if stored_embeddings is not None else set()
    tied = (output is not None and stored_embeddings is not None
            and output._parameters.get("weight") is stored_embeddings)
    moe = _moe_shape(text)
    n = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        share = moe[1] / moe[0] if moe is not None and ".experts." in f".{name}." else 1.0
        n += p.numel() * share
    if tied:
        n += embeddings.weight.numel()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (
        text.hidden_size // heads if heads and hasattr(text, "hidden_size") else None)
    how = "6N + 6 L H hd S from the config"
    attention = 0.0
    if layers and heads and head_dim:
        attention = 6.0 * layers * heads * head_dim * seq_len
    else:
        how = "6N only (the config names no attention shape)"
    if moe is not None:
        how += "; MoE experts counted at top_k / experts (an estimate)"
    return 6.0 * n + attention, how
