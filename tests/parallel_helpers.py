"""Shared by the tensor- and context-parallel tests: a tiny model, learnable batches, and what
autograd keeps per block on a rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from titan_tpu.models.common.mla import MLAArgs
from titan_tpu.models.registry import get_model_args

SEED = 3
STEPS = 20
BATCH = 4  # global batch (rows)
SEQ = 32
LR = 3e-3
MAX_NORM = 1.0
TOL = dict(rtol=1e-5, atol=1e-5)


# Multi-head latent attention, shrunk (q/k head 16 + 8 RoPE, values 16): deepseek_v3 (its dense
# first layer, then MoE layers); mla and mla_wq dense, with and without the low-rank query.
_MLA = MLAArgs(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
MLA_MODELS = {"deepseek_v3": _MLA, "mla": _MLA, "mla_wq": dataclasses.replace(_MLA, q_lora_rank=0)}


def tiny_args(name: str, load_balance: str | None = None):
    """The model's debug flavor, shrunk; an MoE model's experts (8, top-2) kept, with the
    `load_balance` given (aux_loss, expert_bias), else the flavor's. `MLA_MODELS`: DeepSeek-V3's
    debug flavor with multi-head latent attention shrunk, its MoE layers dropped for mla and mla_wq."""
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128, max_seq_len=SEQ)
    if name in ("qwen3", "qwen3_moe"):
        args["head_dim"] = 16  # explicit, as Qwen3 sets it; q/k norms on
    family = name
    if name in MLA_MODELS:
        args.update(n_kv_heads=4, head_dim=8, mla=MLA_MODELS[name])
        family = "deepseek_v3"
    model_args = dataclasses.replace(get_model_args(family, "debug"), **args)
    if name in ("mla", "mla_wq"):
        model_args.moe = None
    if load_balance is not None:
        model_args.moe = dataclasses.replace(model_args.moe, load_balance=load_balance)
    return model_args


def global_batches(steps: int) -> torch.Tensor:
    """[steps, BATCH, SEQ + 1] tokens following x[t+1] = (5 x[t] + 1) mod V (learnable, so the loss moves)."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (steps, BATCH), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 1) % 256)
    return torch.stack(tokens, dim=-1)


def saved_bytes_per_layer(build: Callable[[int], torch.nn.Module], forward: Callable[[torch.nn.Module], object]) -> int:
    """Bytes autograd keeps for the backward of one block on this rank: what `forward(model)`
    saves with a 2-layer model (`build(2)`) minus a 1-layer one, parameters' storages left out."""
    sizes = []
    for n_layers in (1, 2):
        model = build(n_layers)
        own = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in own:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward(model)
        sizes.append(sum(seen.values()))
    return sizes[1] - sizes[0]
