"""Pipeline stages of MoE models with expert parallelism inside each stage (parallel/pipeline.py,
parallel/expert_parallel.py): pp 2 x dp_shard 2 with ep 2 on 4 gloo ranks trains like one process
(losses and gradient norms to 1e-5, the balancing loss, every step's expert loads, the final expert
biases), eager and captured, for Qwen3-MoE (4 MoE layers, 2 a stage) and DeepSeek-V3 (its dense first
layer whole on every stage ahead of the stages, then 3 MoE layers padded to 4 rows: stage 1 holds a
padding row), and a circular schedule. And the planner's terms for a stage: the expert weights a rank
stores, exactly.

The references: with expert_bias balancing one process takes the global batch whole (the loads are
summed over the micro-batches, the stages and the ranks); with aux_loss each data-parallel rank's
balancing loss is of its own rows, all of its micro-batches together (as one process computes it
for a batch), so one process accumulates the two ranks' rows as two micro-batches."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from parallel_helpers import BATCH, LR, MAX_NORM, SEED, STEPS, global_batches
from test_context_parallel import args_for, assert_matches_reference, graph_step, optimizer_for, train

from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import build_model, num_expert_params, num_params
from titan_tpu.parallel.expert_parallel import make_dispatch
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.pipeline import PipelineSchedule, pipeline_stages, pipelined_layers
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.plan.pipeline_terms import shared_params, stage_args
from titan_tpu.train.step import EagerStep

LAYERS = 4  # Qwen3-MoE: 4 MoE layers; DeepSeek-V3: 1 dense, then 3 MoE layers
DIMS = dict(pp=2, dp_shard=2, ep=2)
# "circular": 2 repeats of 1-row chunks, eager: of DeepSeek-V3's 3 MoE layers in 4 rows, stage 0 holds the
# stack's layers 0 and 2, stage 1 layer 1 and a padding row (its second chunk: no routing statistics).
RUNS = [("qwen3_moe:aux_loss", "eager"), ("qwen3_moe:aux_loss", "graph"), ("qwen3_moe:expert_bias", "eager"),
        ("deepseek_v3:expert_bias", "eager"), ("deepseek_v3:expert_bias", "graph"), ("deepseek_v3:aux_loss", "eager"),
        ("deepseek_v3:aux_loss", "circular")]


def _args(name: str):
    return dataclasses.replace(args_for(name), n_layers=LAYERS)


def _build(name: str, dims: ParallelDims, micro_batches: int, repeats: int = 1):
    mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    args = _args(name)
    schedule = PipelineSchedule(stages=dims.pp, micro_batches=micro_batches, repeats=repeats,
                                n_layers=pipelined_layers(args))
    with torch.device("meta"):
        model = Transformer(args, scan_layers=True)
    pipeline_stages(model, mesh, schedule)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED, expert_mesh=expert_mesh, bucket_mb=0)
    model.expert_dispatch.dispatch = make_dispatch(expert_mesh, "all_gather")
    return model, mesh


def _run(name: str, dims: ParallelDims, *, graph: bool, repeats: int = 1) -> dict:
    model, mesh = _build(name, dims, micro_batches=BATCH // dims.dp_shard, repeats=repeats)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    step_fn = graph_step(model, dp_size) if graph else None
    out = train(model, documents=False, dp_rank=dp_rank, dp_size=dp_size, step_fn=step_fn)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    out["experts"] = (tuple(experts[0].device_mesh.mesh_dim_names), tuple(experts[0].to_local().shape))
    out["stored_experts"] = sum(p.to_local().numel() for p in experts)
    out["stored"] = sum(p.to_local().numel() for p in model.parameters())
    return out


def _worker() -> dict:
    dims = ParallelDims(**DIMS, world_size=dist.get_world_size())
    return {(name, mode): _run(name, dims, graph=mode == "graph", repeats=2 if mode == "circular" else 1)
            for name, mode in RUNS}


@functools.cache
def stage_runs() -> list[dict]:
    """One 4-rank spawn: every model and mode."""
    return run_distributed(_worker, world_size=4, timeout_s=900)


@functools.cache
def reference(name: str) -> dict:
    """One process, the same weights and rows: the global batch whole (expert_bias), or each
    data-parallel rank's rows as a micro-batch of their own (aux_loss: the module docstring)."""
    model = build_model(_args(name), seed=SEED)
    if name.endswith("expert_bias"):
        return train(model, documents=False)
    step_fn = EagerStep(model, optimizer_for(model), max_norm=MAX_NORM)
    out = {"losses": [], "norms": [], "aux": [], "loads": []}
    for rows in global_batches(STEPS):
        result = step_fn([(r[:, :-1], r[:, 1:]) for r in rows.chunk(DIMS["dp_shard"])], LR)
        for key, value in (("losses", result.loss), ("norms", result.grad_norm), ("aux", result.aux_loss),
                           ("loads", result.expert_load)):
            out[key].append(value)
    out["biases"] = {n: b.clone() for n, b in model.state_dict().items() if "expert_bias" in n}
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, mode", RUNS, ids=[f"{name}-{mode}" for name, mode in RUNS])
def test_moe_stages_with_expert_parallelism_equal_one_process(name, mode):
    ref = reference(name)
    if name.endswith("aux_loss"):
        assert min(ref["aux"]) > 0  # the balancing loss is trained and reported
    ranks = stage_runs()
    # A stage's state dict holds its own layers' expert biases (parallel/pipeline.py row_views).
    biases = {key: bias for rank in ranks for key, bias in rank[(name, mode)]["biases"].items()}
    for rank in ranks:
        run = {**rank[(name, mode)], "biases": biases}
        assert_matches_reference(run, name, documents=False, ref=ref)
        # experts on (dp_shard_mod_ep, ep, pp): 8 experts, 4 a rank; the stage's 2 rows of the stack (2 chunks of
        # 1 row circular)
        assert run["experts"][0] == ("dp_shard_mod_ep", "ep", "pp"), run["experts"]
        assert run["experts"][1][:2] == (2, 4), run["experts"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["qwen3_moe:aux_loss", "deepseek_v3:expert_bias"])
def test_the_planner_counts_what_a_stage_rank_stores(name):
    """The planner's stage (plan/pipeline_terms.py `stage_args`: the dense layers ahead of the
    stages whole, the stage's rows of the MoE stack with their experts and routers, padding rows
    included) and its layout's stored elements equal what each rank holds, experts and all, exactly."""
    args = _args(name)
    schedule = PipelineSchedule(stages=DIMS["pp"], micro_batches=BATCH // DIMS["dp_shard"],
                                n_layers=pipelined_layers(args))
    stage = stage_args(args, schedule)
    assert stage.num_moe_layers == schedule.rows // schedule.stages  # 2 MoE rows a stage (DeepSeek-V3: 1 padding)
    plan = Layout(**DIMS)
    # The weights every stage holds whole: embedding, norm, output, and DeepSeek-V3's dense first layer.
    outside = args.dim + args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    ahead = num_params(dataclasses.replace(args, n_layers=1)) - outside if name.startswith("deepseek") else 0
    assert shared_params(stage, schedule) == outside + ahead
    for rank in stage_runs():
        run = rank[(name, "eager")]
        assert run["stored_experts"] == num_expert_params(stage) // plan.dp_shard
        assert run["stored"] == plan.stored_elements(num_params(stage), num_expert_params(stage))
