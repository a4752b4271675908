"""Sharded checkpoints on 2 gloo ranks: save/load DTensors, resharding 2 <-> 1, async save; the
local tier (train/local_tier.py) the same ways.

One spawned 2-rank job runs every multi-rank scenario (starting processes costs more than the tests);
the single-process halves run in the pytest process itself.
"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from titan_tpu.train.checkpoint import Checkpointer, load, load_full_state_dict, rng_state
from titan_tpu.train.local_tier import LocalTier
from titan_tpu.train.signals import GracefulShutdown

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.multiprocess]

WORLD = 2


def full_state(step: int) -> dict:
    """The global (unsharded) values of a checkpoint; 5 rows shard unevenly over 2 ranks."""
    return {
        "step": step,
        "model": {"tok_embeddings.weight": torch.arange(20.0).reshape(5, 4) + step,
                  "layers.0.attention.wq.weight": torch.linspace(-1, 1, 32).reshape(8, 4) * step},
        "optimizer": {"step": step,
                      "exp_avg": {"layers.0.attention.wq.weight": torch.full((8, 4), 0.1 * step)},
                      "exp_avg_sq": {"layers.0.attention.wq.weight": torch.full((8, 4), 0.01 * step)}},
        "data": {"samples_consumed": 4 * step},
        "model_name": "llama3",
        "model_args": {"dim": 4},
    }


def map_tensors(state: dict, fn) -> dict:
    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return fn(x) if isinstance(x, torch.Tensor) else x
    return walk(state)


def leaves(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], x


def assert_state_equal(actual: dict, expected: dict) -> None:
    """The model and optimizer parts hold the expected values (DTensors compared as full tensors)."""
    from torch.distributed.tensor import DTensor

    got = dict(leaves({k: actual[k] for k in ("model", "optimizer")}))
    want = dict(leaves({k: expected[k] for k in ("model", "optimizer")}))
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            full = got[key].full_tensor() if isinstance(got[key], DTensor) else got[key]
            torch.testing.assert_close(full, value, rtol=0, atol=0, msg=key)
        else:
            assert got[key] == value, key


def _worker(root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))

    def sharded(state: dict) -> dict:
        return map_tensors(state, lambda t: distribute_tensor(t, mesh, [Shard(0)]))

    def zeros_target(step: int) -> dict:
        target = sharded(map_tensors(full_state(step), torch.zeros_like))
        target["optimizer"]["step"] = -1
        return target

    # 1 -> 2: a checkpoint saved by one process loads into Shard(0) DTensors.
    target = zeros_target(1)
    rest = load(os.path.join(root, "one", "step-00000001"), target)
    assert_state_equal(target, full_state(1))
    assert rest["step"] == 1 and rest["world_size"] == 1 and rest["rng"] is None  # other world size

    # 2 -> 2: each rank writes its own shard and its own RNG state.
    torch.manual_seed(100 + rank)
    state = {**sharded(full_state(2)), "rng": rng_state()}
    path = Checkpointer(os.path.join(root, "two")).save(2, state)
    assert sorted(p for p in os.listdir(path) if p.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p for p in os.listdir(path) if p.startswith("rng-")) == ["rng-rank0.pt", "rng-rank1.pt"]
    target = zeros_target(2)
    weight = target["model"]["tok_embeddings.weight"]
    storage = weight.to_local().data_ptr()
    rest = load(path, target)
    assert target["model"]["tok_embeddings.weight"] is weight and weight.to_local().data_ptr() == storage
    assert_state_equal(target, full_state(2))
    assert torch.equal(rest["rng"]["torch"], state["rng"]["torch"])
    assert rest["data"] == {"samples_consumed": 8}

    # Across layouts: saved sharded on columns (as SimpleFSDP places the 5-row embedding, whose dim 0
    # 2 ranks do not divide: simple_fsdp._even_blocks), loaded into row shards; and the other way.
    def on_columns(state: dict) -> dict:
        return map_tensors(state, lambda t: distribute_tensor(t, mesh, [Shard(1)]))

    path = Checkpointer(os.path.join(root, "columns")).save(7, on_columns(full_state(7)))
    target = zeros_target(7)
    load(path, target)
    assert_state_equal(target, full_state(7))
    target = on_columns(map_tensors(full_state(2), torch.zeros_like))
    load(os.path.join(root, "two", "step-00000002"), target)
    assert target["model"]["tok_embeddings.weight"].placements == (Shard(1),)
    assert_state_equal(target, full_state(2))

    # Async: training mutates the tensors right after save(); the checkpoint holds the values at save().
    with Checkpointer(os.path.join(root, "async"), keep_latest_k=1, async_save=True) as ckpt:
        for step in (3, 4):
            state = sharded(full_state(step))
            ckpt.save(step, state)
            for t in state["model"].values():
                t.to_local().fill_(-1.0)
    assert ckpt.latest().name == "step-00000004"
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000004"]
    target = zeros_target(4)
    load(ckpt.latest(), target)
    assert_state_equal(target, full_state(4))

    # The local tier: 1 -> 2 (each rank cuts its shard out of the one file), 2 -> 2 (each rank reads
    # its own file), and below 2 -> 1.
    tier = LocalTier(os.path.join(root, "local_one"), log=print)
    assert tier.newest()[0] == 5
    target = zeros_target(5)
    rest = tier.load(tier.newest()[1], target)
    assert_state_equal(target, full_state(5))
    assert rest["step"] == 5 and rest["world_size"] == 1 and rest["rng"] is None
    tier = LocalTier(os.path.join(root, "local_two"), log=print)
    state = {**sharded(full_state(6)), "rng": rng_state()}
    tier.save(6, state)
    target = zeros_target(6)
    rest = tier.load(tier.newest()[1], target)
    assert_state_equal(target, full_state(6))
    assert torch.equal(rest["rng"]["torch"], state["rng"]["torch"]) and rest["data"] == {"samples_consumed": 24}

    # A signal on one rank stops every rank at the same step.
    with GracefulShutdown() as shutdown:
        assert not shutdown.should_stop()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        assert shutdown.should_stop()


def test_sharded_save_load_reshard_and_async(tmp_path):
    # 1 process saves plain tensors; the 2 ranks load them sharded (1 -> 2) and save their own.
    Checkpointer(tmp_path / "one").save(1, full_state(1))
    LocalTier(tmp_path / "local_one", log=print).save(5, full_state(5))
    run_distributed(_worker, world_size=WORLD, args=(str(tmp_path),))

    # 2 -> 1: the 2-rank checkpoints load into plain tensors here, without a process group.
    target = map_tensors(full_state(2), torch.zeros_like)
    rest = load(tmp_path / "two" / "step-00000002", target)
    assert_state_equal(target, full_state(2))
    assert rest["world_size"] == 2 and rest["rng"] is None
    full = load_full_state_dict(tmp_path / "two" / "step-00000002")
    for name, value in full_state(2)["model"].items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0)
    tier = LocalTier(tmp_path / "local_two", log=print)
    target = map_tensors(full_state(6), torch.zeros_like)
    rest = tier.load(tier.newest()[1], target)
    assert_state_equal(target, full_state(6))
    assert rest["world_size"] == 2 and rest["rng"] is None
    async_latest = Checkpointer(tmp_path / "async").latest()
    torch.testing.assert_close(load_full_state_dict(async_latest)["tok_embeddings.weight"],
                               full_state(4)["model"]["tok_embeddings.weight"], rtol=0, atol=0)
