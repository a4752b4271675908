"""Shared by the tensor- and context-parallel tests: a tiny model, learnable batches, and what
autograd keeps per block on a rank."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable

import torch

from titan_tpu.models.common.mla import MLAArgs
from titan_tpu.models.registry import get_model_args

SEED = 3
# 10 steps: a layout that computes another gradient differs from one process in its first step; the
# references still learn (each drops its loss by more than 1.0, which the tests check); 20 steps made
# test_tensor_parallel.py 67 s and test_context_parallel.py 79 s instead of 35 s and 62 s.
STEPS = 10
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


class _Saved:
    """What the saved-tensor hook hands autograd instead of a tensor: alive exactly as long as the
    graph node that saved it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def kept_saved_bytes(run: Callable[[], object], exclude: set[int]) -> int:
    """Bytes of the distinct storages (data pointers not in `exclude`) autograd still keeps for the
    backward when `run()` has returned, its result held. Tensors saved by nodes that died during the
    forward (an output used only through its indices, as routing's top-k values) are not counted,
    whether or not the allocator gave their memory to a later tensor: counting storages as they were
    saved made the total depend on that reuse."""
    boxes = []

    def pack(t: torch.Tensor) -> _Saved:
        box = _Saved(t)
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        result = run()
    kept = {}
    for ref in boxes:
        box = ref()
        if box is not None and box.tensor.untyped_storage().data_ptr() not in exclude:
            kept[box.tensor.untyped_storage().data_ptr()] = box.tensor.untyped_storage().nbytes()
    del result
    return sum(kept.values())


def saved_bytes_per_layer(build: Callable[[int], torch.nn.Module], forward: Callable[[torch.nn.Module], object]) -> int:
    """Bytes autograd keeps for the backward of one block on this rank: what `forward(model)`
    keeps (`kept_saved_bytes`) with a 2-layer model (`build(2)`) minus a 1-layer one, parameters'
    storages left out."""
    sizes = []
    for n_layers in (1, 2):
        model = build(n_layers)
        own = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
        sizes.append(kept_saved_bytes(functools.partial(forward, model), own))
    return sizes[1] - sizes[0]
