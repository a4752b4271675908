"""Shared by the tensor- and context-parallel tests: a tiny model, learnable batches, and what
autograd keeps per block on a rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from titan_tpu.models.registry import get_model_args

SEED = 3
STEPS = 20
BATCH = 4  # global batch (rows)
SEQ = 32
LR = 3e-3
MAX_NORM = 1.0
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_args(name: str, load_balance: str | None = None):
    """The model's debug flavor, shrunk; an MoE model's experts (8, top-2) kept, with the
    `load_balance` given (aux_loss, expert_bias), else the flavor's."""
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128, max_seq_len=SEQ)
    if name in ("qwen3", "qwen3_moe"):
        args["head_dim"] = 16  # explicit, as Qwen3 sets it; q/k norms on
    model_args = dataclasses.replace(get_model_args(name, "debug"), **args)
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
