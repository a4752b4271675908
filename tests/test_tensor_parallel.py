"""Tensor parallelism (parallel/tensor_parallel.py): parity with one process on gloo ranks, composed
with SimpleFSDP, in graph mode, through a checkpoint, and its one-line errors."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import build_model, get_model_args
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.parallel.tensor_parallel import check_tensor_parallel, tensor_parallel
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

SEED = 3
STEPS = 20
BATCH = 4  # global batch (rows)
SEQ = 32
LR = 3e-3
MAX_NORM = 1.0
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_args(name: str):
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128, max_seq_len=SEQ)
    if name == "qwen3":
        args["head_dim"] = 16  # explicit, as Qwen3 sets it; q/k norms on
    return dataclasses.replace(get_model_args(name, "debug"), **args)


def global_batches(steps: int) -> torch.Tensor:
    """[steps, BATCH, SEQ + 1] tokens following x[t+1] = (5 x[t] + 1) mod V (learnable, so the loss moves)."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (steps, BATCH), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 1) % 256)
    return torch.stack(tokens, dim=-1)


def train(model, batches: torch.Tensor, *, dp_rank: int = 0, dp_size: int = 1) -> tuple[list, list]:
    step_fn = EagerStep(model, AdamW(dict(model.named_parameters())), max_norm=MAX_NORM, dp_size=dp_size)
    losses, norms = [], []
    for batch in batches:
        rows = batch.chunk(dp_size)[dp_rank]
        result = step_fn([(rows[:, :-1], rows[:, 1:])], LR)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return losses, norms


@functools.cache
def reference(name: str, steps: int = STEPS) -> tuple[list, list]:
    return train(build_model(tiny_args(name), seed=SEED), global_batches(steps))


def build_parallel(name: str, dims: ParallelDims):
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(tiny_args(name))
    tensor_parallel(model, mesh, seq_len=SEQ)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED)
    return model, mesh


def _eager_worker(name: str, dp_shard: int, tp: int, steps: int) -> dict:
    dims = ParallelDims(dp_shard=dp_shard, tp=tp, world_size=dist.get_world_size())
    model, mesh = build_parallel(name, dims)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    wq = model.layers["0"].attention.wq
    local_shape = tuple(wq.weight.shape)  # as computed with: this rank's heads, data axes gathered
    losses, norms = train(model, global_batches(steps), dp_rank=dp_rank, dp_size=dp_size)
    return {"losses": losses, "norms": norms, "mesh": mesh.mesh_dim_names, "wq_compute_shape": local_shape,
            "logits": model(global_batches(1)[0, :, :-1]).detach()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_tp2_matches_one_process(name):
    results = run_distributed(_eager_worker, world_size=2, args=(name, 1, 2, STEPS))
    ref_losses, ref_norms = reference(name)
    assert ref_losses[-1] < ref_losses[0] - 1.0  # it learns, so divergence would show
    ref_model = build_model(tiny_args(name), seed=SEED)
    train(ref_model, global_batches(STEPS))
    ref_logits = ref_model(global_batches(1)[0, :, :-1]).detach()
    for r in results:
        assert r["mesh"] == ("tp",)
        assert r["wq_compute_shape"] == (tiny_args(name).n_heads * tiny_args(name).hd // 2, 64)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), **TOL)
        torch.testing.assert_close(r["logits"], ref_logits, rtol=1e-4, atol=1e-4)  # gathered over the vocabulary


@pytest.mark.multiprocess
def test_dp_shard2_tp2_matches_one_process():
    results = run_distributed(_eager_worker, world_size=4, args=("llama3", 2, 2, STEPS), timeout_s=240)
    ref_losses, ref_norms = reference("llama3")
    for r in results:
        assert r["mesh"] == ("dp_shard", "tp")
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), **TOL)


# ---------------------------------------------------------------------------------------------
# Bad input: one line each
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    (dict(n_heads=6, n_kv_heads=2, dim=96), r"tp \(4\) must divide the model's n_heads \(6\)"),
    (dict(n_heads=8, n_kv_heads=2), r"tp \(4\) must divide the model's n_kv_heads \(2\)"),
    (dict(n_heads=8, n_kv_heads=4, ffn_hidden_dim=130), r"tp \(4\) must divide the model's ffn_hidden_dim \(130\)"),
    (dict(n_heads=8, n_kv_heads=4, vocab_size=258), r"tp \(4\) must divide the model's vocab_size \(258\)"),
])
def test_tp_must_divide_the_model(change, match):
    args = dataclasses.replace(tiny_args("llama3"), **change)
    with pytest.raises(ValueError, match=match) as info:
        check_tensor_parallel(args, 4, seq_len=SEQ)
    assert "\n" not in str(info.value)


def test_tp_errors_for_seq_len_and_moe():
    with pytest.raises(ValueError, match=r"tp \(2\) must divide --training.seq_len \(31\)"):
        check_tensor_parallel(tiny_args("llama3"), 2, seq_len=31)
    moe = get_model_args("qwen3_moe", "debug")
    with pytest.raises(ValueError, match=r"experts are parallelised over ep only"):
        check_tensor_parallel(moe, 2)
    check_tensor_parallel(moe, 1)  # tp 1: nothing to check


@pytest.mark.parametrize("kwargs, match", [
    (dict(dp_shard=2, tp=2, world_size=8), r"dp_replicate \(1\) \* --parallelism.dp_shard \(2\) \* cp \(1\) \* "
                                           r"tp \(2\) must equal the world size \(8\)"),
    (dict(tp=3, world_size=4), r"\* cp \(1\) \* tp \(3\) must divide the world size \(4\)"),
    (dict(tp=0, world_size=4), r"--parallelism.tp must be >= 1"),
    (dict(cp=2, world_size=4), r"context parallelism is not implemented yet"),
    (dict(tp=2, ep=2, world_size=8), r"MoE models use ep only"),
])
def test_parallel_dims_tp_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ParallelDims(**kwargs)
    assert "\n" not in str(info.value)


def test_parallel_dims_tp_leaves_dp_shard():
    d = ParallelDims(tp=2, world_size=8)
    assert (d.dp_shard, d.dp_size, d.tp, d.mode) == (4, 4, 2, "fully_shard")
    assert ParallelDims(tp=2, world_size=2).mode == "none"
