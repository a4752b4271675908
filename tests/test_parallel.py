"""Device mesh sizes, SimpleFSDP sharded init, numerics and memory on local gloo ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.distributed.tensor import Replicate, Shard

from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import build_model, get_model_args
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import (
    MixedPrecision,
    data_parallel,
    default_mixed_precision,
    local_bytes,
    materialize_and_init,
)
from titan_tpu.train.optim import AdamW, clip_grad_norm_

SEED = 3
STEPS = 20
BATCH_PER_RANK = 2
SEQ = 32
LR = 3e-3
MAX_NORM = 1.0


def tiny_args(vocab_size: int = 256):
    return dataclasses.replace(get_model_args("llama3", "debug"), dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               vocab_size=vocab_size, ffn_hidden_dim=128, max_seq_len=SEQ)


def global_batches(dp_size: int, steps: int, vocab: int = 256) -> torch.Tensor:
    """[steps, dp_size * BATCH_PER_RANK, SEQ + 1] tokens, the same on every process: each sequence
    follows x[t+1] = (5 x[t] + 1) mod V from a random start, a rule the model learns in a few steps
    (so the loss moves and diverging runs would show)."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (steps, dp_size * BATCH_PER_RANK), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 1) % vocab)
    return torch.stack(tokens, dim=-1)


def train(model, batches: torch.Tensor, *, dp_rank: int = 0, dp_size: int = 1, comm_log: list | None = None):
    """The eager step on this rank's rows of each global batch; returns (losses, grad_norms).

    The loss is summed over this rank's tokens and divided by the global token count, so the
    data-parallel gradient reduction (a sum) yields the single-process gradient."""
    from torch.distributed.tensor.debug import CommDebugMode

    params = dict(model.named_parameters())
    opt = AdamW(params)
    losses, norms = [], []
    for step, batch in enumerate(batches):
        per_rank = batch.shape[0] // dp_size
        rows = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        inputs, labels = rows[:, :-1], rows[:, 1:]
        record = comm_log is not None and step == 0
        with CommDebugMode() if record else contextlib.nullcontext() as comm, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CommDebugMode's module tracker warns about backward hooks
            loss = model(inputs, labels).ce_sum / (labels.numel() * dp_size)
            loss.backward()
        if record:
            comm_log.append({str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()})
            comm_log.append({n: tuple(p.grad.placements) == tuple(p.placements) for n, p in params.items()})
        grads = {n: p.grad for n, p in params.items()}
        norms.append(clip_grad_norm_(grads, MAX_NORM).item())
        opt.step(grads, lr=LR)
        for p in params.values():
            p.grad = None
        loss = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(loss)
        losses.append(loss.item())
    return losses, norms, opt


# ---------------------------------------------------------------------------------------------
# Rank workers (module level so spawned processes can import them)
# ---------------------------------------------------------------------------------------------


def _sharded_run(mode: str, dp_replicate: int, steps: int, vocab: int) -> dict:
    dims = ParallelDims(dp_replicate=dp_replicate, world_size=dist.get_world_size())
    assert dims.mode == mode
    mesh = dims.build_mesh("cpu")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    if mode == "replicate":
        # The other entry point: a model built whole, then made data parallel (rank 0's values).
        model = data_parallel(build_model(tiny_args(vocab), seed=SEED), mesh, mode=mode, mp=MixedPrecision())
    else:
        with torch.device("meta"):
            model = Transformer(tiny_args(vocab))
        model = materialize_and_init(model, mesh, mode=mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                     seed=SEED)
    init = {n: p.full_tensor().clone() for n, p in model.state_dict().items()}  # no alias
    # A local shard that is a view of a full-size tensor would keep the full tensor alive.
    storage_is_local = all(p.to_local().untyped_storage().nbytes() == local_bytes([p]) for p in model.parameters())
    comm_log = []
    losses, norms, opt = train(model, global_batches(dp_size, steps, vocab), dp_rank=dp_rank, dp_size=dp_size,
                               comm_log=comm_log)
    # Mixed precision: bf16 compute, gradients reduced and stored in fp32 on the fp32 master weights.
    data_parallel(model, mesh, mode=mode, mp=MixedPrecision(param_dtype=torch.bfloat16))
    inputs = global_batches(dp_size, 1, vocab)[0, :BATCH_PER_RANK, :-1]
    bf16_weight_dtype = model.layers["0"].attention.wq.weight.dtype
    logits = model(inputs)
    logits.float().sum().backward()
    p = model.layers["0"].attention.wq._parameters["weight"]
    wrong_mode = "replicate" if mode != "replicate" else "fully_shard"
    try:
        data_parallel(model, mesh, mode=wrong_mode, mp=MixedPrecision())
        wrong_mode_error = None
    except ValueError as e:
        wrong_mode_error = str(e)
    return {
        "dp": (dp_rank, dp_size),
        "mesh_dim_names": mesh.mesh_dim_names,
        "init": init,
        "storage_is_local": storage_is_local,
        "losses": losses,
        "norms": norms,
        "comm_counts": comm_log[0],
        "grad_placements_match": all(comm_log[1].values()),
        "param_opt_bytes": local_bytes(list(model.parameters()) + list(opt.state["exp_avg"].values())
                                       + list(opt.state["exp_avg_sq"].values())),
        "wrong_mode_error": wrong_mode_error,
        "bf16": (bf16_weight_dtype, logits.dtype, p.dtype, p.grad.dtype, tuple(p.grad.placements)),
        "placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
    }


@functools.cache
def sharded_run(mode: str, world_size: int, dp_replicate: int = 1, steps: int = STEPS, vocab: int = 256) -> list[dict]:
    """One spawn per configuration, shared by the init, numerics and memory tests."""
    return run_distributed(_sharded_run, world_size=world_size, args=(mode, dp_replicate, steps, vocab))


@functools.cache
def reference_run(steps: int, dp_size: int, vocab: int = 256):
    model = build_model(tiny_args(vocab), seed=SEED)
    params_bytes = local_bytes(model.parameters())
    losses, norms, _ = train(model, global_batches(dp_size, steps, vocab))
    return losses, norms, params_bytes


CONFIGS = {  # id: (mode, world_size, dp_replicate, steps)
    "fully_shard-2": ("fully_shard", 2, 1, STEPS),
    "replicate-2": ("replicate", 2, 2, STEPS),
    "hybrid_shard-2x2": ("hybrid_shard", 4, 2, 10),  # 4 ranks on 2 cores: fewer steps
}


# ---------------------------------------------------------------------------------------------
# ParallelDims
# ---------------------------------------------------------------------------------------------


def test_parallel_dims_resolves_dp_shard_and_mode():
    assert ParallelDims(world_size=1).dp_shard == 1
    assert ParallelDims(world_size=1).mode == "none"
    assert ParallelDims(world_size=8).dp_shard == 8
    assert ParallelDims(world_size=8).mode == "fully_shard"
    d = ParallelDims(dp_replicate=2, world_size=8)
    assert (d.dp_shard, d.dp_size, d.mode) == (4, 8, "hybrid_shard")
    assert ParallelDims(dp_replicate=4, world_size=4).mode == "replicate"
    assert ParallelDims(dp_replicate=1, dp_shard=2, world_size=2).mode == "fully_shard"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dp_replicate=0, world_size=2), r"--parallelism.dp_replicate must be >= 1"),
        (dict(dp_shard=0, world_size=2), r"--parallelism.dp_shard must be >= 1 or -1"),
        (dict(dp_shard=-2, world_size=2), r"--parallelism.dp_shard must be >= 1 or -1"),
        (dict(dp_replicate=3, world_size=4), r"dp_replicate \(3\) \* --parallelism.pp \(1\) \* --parallelism.cp "
                                             r"\(1\) \* --parallelism.tp \(1\) must divide the world size \(4\)"),
        (dict(dp_replicate=2, dp_shard=2, world_size=8), r"\(2\) \* --parallelism.dp_shard \(2\) \* --parallelism.pp "
                                                         r"\(1\) \* --parallelism.cp \(1\) \* --parallelism.tp \(1\) "
                                                         r"must equal the world size \(8\)"),
        (dict(world_size=0), r"world size must be >= 1"),
        (dict(world_size=4, ep=3), r"--parallelism.ep \(3\) must divide --parallelism.dp_shard \(4\)"),
        (dict(world_size=4, dp_replicate=2, ep=2), r"--parallelism.ep > 1 with --parallelism.dp_replicate > 1"),
        (dict(world_size=2, ep=0), r"--parallelism.ep must be >= 1"),
    ],
)
def test_parallel_dims_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ParallelDims(**kwargs)
    assert "\n" not in str(info.value)


def test_single_process_needs_no_mesh():
    assert ParallelDims(world_size=1).build_mesh("cpu") is None
    assert dp_rank_and_size(None) == (0, 1)
    assert default_mixed_precision("cpu") == MixedPrecision(torch.float32, torch.float32)
    assert default_mixed_precision("cuda") == MixedPrecision(torch.bfloat16, torch.float32)
    with torch.device("meta"):
        model = Transformer(tiny_args())
    model = materialize_and_init(model, None, mode="none", mp=MixedPrecision(), device=torch.device("cpu"), seed=SEED)
    expected = build_model(tiny_args(), seed=SEED).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    torch.testing.assert_close(model.rope_cache, build_model(tiny_args(), seed=SEED).rope_cache, rtol=0, atol=0)
    with pytest.raises(ValueError, match="data parallel mode must be one of"):
        materialize_and_init(model, None, mode="zero3", mp=MixedPrecision(), device="cpu", seed=0)


# ---------------------------------------------------------------------------------------------
# Sharded runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["fully_shard-2", "hybrid_shard-2x2", "replicate-2"])
def test_sharded_init_is_bitwise_single_process(config):
    mode, world_size, dp_replicate, steps = CONFIGS[config]
    results = sharded_run(mode, world_size, dp_replicate, steps)
    expected = build_model(tiny_args(), seed=SEED).state_dict()
    for rank, result in enumerate(results):
        assert result["init"].keys() == expected.keys()  # original names, no parametrization keys
        for name, value in expected.items():
            assert torch.equal(result["init"][name], value), f"rank {rank}: {name}"
        assert result["storage_is_local"]
    assert [r["dp"] for r in results] == [(rank, world_size) for rank in range(world_size)]
    assert results[0]["mesh_dim_names"] == {"fully_shard": ("dp_shard",), "replicate": ("dp_replicate",),
                                            "hybrid_shard": ("dp_replicate", "dp_shard")}[mode]


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["fully_shard-2", "replicate-2", "hybrid_shard-2x2"])
def test_sharded_training_matches_single_process(config):
    mode, world_size, dp_replicate, steps = CONFIGS[config]
    results = sharded_run(mode, world_size, dp_replicate, steps)
    ref_losses, ref_norms, _ = reference_run(steps, world_size)
    assert ref_losses[-1] < ref_losses[0] - 0.3  # it trains, so a mismatch would show
    for result in results:
        torch.testing.assert_close(result["losses"], ref_losses, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["norms"], ref_norms, rtol=1e-5, atol=1e-5)
        assert result["grad_placements_match"]

    # The collectives really ran: one all-gather per bucket in the forward (5 buckets, the default
    # bucket_mb: embedding, 2 blocks, norm, output; parallel/buckets.py), the matching gradient
    # reduction in the backward, and, re-sharded after the forward (the default), block 0 gathered
    # again in the backward (the last block stays gathered: its backward comes first).
    counts = results[0]["comm_counts"]
    n_buckets, regathered = 5, 1
    expected = {
        "replicate": {"all_reduce": n_buckets},
        "fully_shard": {"all_gather_into_tensor": n_buckets + regathered, "reduce_scatter_tensor": n_buckets},
        # reduce-scatter within each shard group, then all-reduce across the replicas
        "hybrid_shard": {"all_gather_into_tensor": n_buckets + regathered, "reduce_scatter_tensor": n_buckets,
                         "all_reduce": n_buckets},
    }[mode]
    assert counts == expected


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["fully_shard-2", "hybrid_shard-2x2"])
def test_bf16_compute_keeps_fp32_master_weights_and_grads(config):
    mode, world_size, dp_replicate, steps = CONFIGS[config]
    for result in sharded_run(mode, world_size, dp_replicate, steps):
        weight, logits, master, grad, grad_placements = result["bf16"]
        assert (weight, logits, master, grad) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
        assert grad_placements[-1].is_shard()


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["fully_shard-2", "replicate-2"])
def test_data_parallel_rejects_a_second_layout(config):
    for result in sharded_run(*CONFIGS[config]):
        assert "is already distributed as" in result["wrong_mode_error"]
        assert "\n" not in result["wrong_mode_error"]


@pytest.mark.multiprocess
def test_fully_shard_halves_parameter_and_optimizer_memory():
    (mode, world_size, dp_replicate, steps) = CONFIGS["fully_shard-2"]
    results = sharded_run(mode, world_size, dp_replicate, steps)
    _, _, unsharded_param_bytes = reference_run(steps, world_size)
    unsharded = 3 * unsharded_param_bytes  # parameters + two AdamW moments of the same size
    for result in results:
        assert result["param_opt_bytes"] / unsharded == pytest.approx(0.5, abs=0.01)


@pytest.mark.multiprocess
def test_a_dim_0_the_ranks_do_not_divide_is_sharded_on_another_dim_with_the_same_numbers():
    """A vocabulary of 255 rows over 2 ranks would split 128 + 127: the embedding and output are
    sharded on their model dim instead (every rank an equal block, which the JAX path's one program
    needs: simple_fsdp._even_blocks), the other weights on dim 0 as before; init and training
    equal one process's."""
    vocab, steps = 255, 10
    results = sharded_run("fully_shard", 2, 1, steps, vocab)
    expected = build_model(tiny_args(vocab), seed=SEED).state_dict()
    ref_losses, ref_norms, _ = reference_run(steps, 2, vocab)
    for result in results:
        for name, value in expected.items():
            assert torch.equal(result["init"][name], value), name
        torch.testing.assert_close(result["losses"], ref_losses, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["norms"], ref_norms, rtol=1e-5, atol=1e-5)
        assert result["grad_placements_match"]
        placements = result["placements"]
        assert placements["tok_embeddings.weight"] == placements["output.weight"] == (Shard(1),)
        assert placements["layers.0.attention.wq.weight"] == (Shard(0),)
    assert results[0]["local_shapes"] == results[1]["local_shapes"]
    assert results[0]["local_shapes"]["output.weight"] == (vocab, 32)


def test_a_weight_no_dim_of_which_divides_is_whole_on_every_rank():
    """SigLIP's pooling probe [1, 1, D] over 2 ranks is sharded on D; a [3] bias stays whole (Replicate);
    every rank's blocks have the same shapes (captured on a fake 2-rank group)."""
    from titan_tpu.components.world import fake_world

    shapes = []
    for rank in range(2):
        with fake_world(2, rank):
            mesh = ParallelDims(world_size=2).build_mesh("cpu")
            module = torch.nn.Module()
            module.probe = torch.nn.Parameter(torch.zeros(1, 1, 8))
            module.bias = torch.nn.Parameter(torch.zeros(3))
            module.weight = torch.nn.Parameter(torch.zeros(4, 8))
            data_parallel(module, mesh, mode="fully_shard", mp=MixedPrecision())
            params = dict(module.named_parameters())
            assert {n: tuple(p.placements) for n, p in params.items()} == {
                "probe": (Shard(2),), "bias": (Replicate(),), "weight": (Shard(0),)}
            shapes.append({n: tuple(p.to_local().shape) for n, p in params.items()})
    assert shapes[0] == shapes[1] == {"probe": (1, 1, 4), "bias": (3,), "weight": (2, 8)}


def _gloo_worker_threads() -> dict:
    """The rank harness made every gloo group single-threaded; count the workers of two groups."""
    import os

    world_subgroup = dist.new_group([0, 1])  # a second group, made the way DeviceMesh makes its subgroups
    total = torch.ones(3)
    dist.all_reduce(total, group=world_subgroup)
    # A worker names itself ("pt_gloo_runloop") once it runs; a collective on each group is the proof
    # that it has, so the count below does not race a busy machine's thread start (it read 1 of 2).
    dist.all_reduce(torch.ones(1))
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return {"runloops": names.count("pt_gloo_runloop"), "total": total}


@pytest.mark.multiprocess
def test_gloo_groups_run_one_worker_thread_each():
    """Two collectives of one gloo group running at once on its two default worker threads can
    corrupt the heap inside gloo's TCP transport (docs/known-issues.md, 1d); every group we create
    gets one worker. A torch upgrade that stops honouring titan_tpu.parallel.gloo fails here."""
    for result in run_distributed(_gloo_worker_threads, world_size=2):
        assert result["runloops"] == 2  # the default group and the subgroup, one worker each (4 by default)
        assert torch.equal(result["total"], torch.full((3,), 2.0))


def _what_a_rank_sees() -> dict:
    import os
    import sys

    return {"env": os.environ.get("TITAN_TPU_TEST_RANK_ENV"), "cwd": os.getcwd(), "path": list(sys.path)}


@pytest.mark.multiprocess
def test_ranks_see_the_callers_environment_of_the_call(monkeypatch, tmp_path):
    """Ranks fork from a server started once per process (parallel/spawn.py), not from the caller:
    what the caller set before this call (environment, working directory, sys.path) must reach
    them as it did when every rank was a fresh interpreter."""
    import os

    run_distributed(_gloo_worker_threads, world_size=2)  # the fork server runs before the changes below
    monkeypatch.setenv("TITAN_TPU_TEST_RANK_ENV", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for result in run_distributed(_what_a_rank_sees, world_size=2):
        assert result["env"] == "set after the server started"
        assert os.path.samefile(result["cwd"], tmp_path)
        assert str(tmp_path) in result["path"], result["path"]


def test_trainer_makes_gloo_groups_single_threaded_before_joining(monkeypatch):
    """Under torchrun the trainer joins the default group itself: the single-thread gloo class must
    be in place by then (the multi-process test above checks the class's effect)."""
    import torch.distributed.distributed_c10d as c10d

    from titan_tpu.components.runtime import init_distributed
    from titan_tpu.device import get_backend

    monkeypatch.setattr(c10d, "ProcessGroupGloo", c10d.ProcessGroupGloo)  # restored after the test
    joined = {}

    def fake_init_process_group(backend):
        joined["backend"] = backend
        joined["single_thread"] = getattr(c10d.ProcessGroupGloo, "_titan_single_thread", False)

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", fake_init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: "backend" in joined)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert init_distributed(get_backend("cpu")) == (1, 2)
    assert joined == {"backend": "gloo", "single_thread": True}
