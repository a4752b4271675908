"""Expert parallelism composed with tensor and context parallelism (parallel/expert_parallel.py):
dp_shard 2 x ep 2 x tp 2 and dp_shard 2 x ep 2 x cp 2 on 4 gloo ranks train like one process
(losses, gradient norms, every step's expert loads, the final expert biases), eager and captured,
for Qwen3-MoE and DeepSeek-V3 (its dense first layer split by tp, its shared experts whole), and
DeepSeek-V3 scanned (a dense stack and an MoE stack) with full checkpointing under tp, as the TPU
recipes run."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from parallel_helpers import BATCH, SEED, SEQ, global_batches, saved_bytes_per_layer
from test_context_parallel import args_for, assert_matches_reference, graph_step, train

from titan_tpu.models.common.activation_memory import activation_bytes
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import num_expert_params, num_params
from titan_tpu.parallel.context_parallel import context_parallel, cp_attention_saved_bytes
from titan_tpu.parallel.expert_parallel import make_dispatch
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.parallel.tensor_parallel import tensor_parallel
from titan_tpu.plan.setting import attention_widths

# expert_bias balancing: each rank's loss and the bias update read the whole batch's loads, so a
# data-parallel run equals one process taking the batch whole (with aux_loss the ranks average
# their own rows' balancing losses: tests/test_moe.py compares that with micro-batches).
MODELS = ["qwen3_moe:expert_bias", "deepseek_v3:expert_bias"]
LAYOUTS = {"ep2_tp2": dict(dp_shard=2, ep=2, tp=2), "ep2_cp2": dict(dp_shard=2, ep=2, cp=2)}


def _build(name: str, dims: ParallelDims, *, n_layers: int | None = None, dispatch: str = "all_gather",
           bucket_mb: float = 25, scan: bool = False, ac_mode: str = "none"):
    mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    args = args_for(name)
    if n_layers is not None:
        args = dataclasses.replace(args, n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(args, ac_mode=ac_mode, scan_layers=scan)
    if dims.tp > 1:  # the trainer's order (models/spec.py): tensor parallelism, then context parallelism
        tensor_parallel(model, mesh, seq_len=SEQ)
    if dims.cp > 1:
        context_parallel(model, mesh, seq_len=SEQ, documents=False)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED, expert_mesh=expert_mesh, bucket_mb=bucket_mb)
    if expert_mesh is not None:
        model.expert_dispatch.dispatch = make_dispatch(expert_mesh, dispatch)
    return model, mesh


def _gathered_bytes(block) -> int:
    """The bytes of a block's weights as a compute read returns them where that is a gathered copy
    (not the rank's own storage): the planner's gathered-weights term, not an activation."""
    total = 0
    for module in block.modules():
        for name, param in module._parameters.items():
            if param is None:  # an absent bias
                continue
            read = getattr(module, name)
            if read.untyped_storage().data_ptr() != param.to_local().untyped_storage().data_ptr():
                total += read.untyped_storage().nbytes()
    return total


def _saved_per_moe_layer(name: str, dims: ParallelDims) -> int:
    """What autograd keeps for one MoE block on this rank (the second block: DeepSeek-V3's first is
    dense) beside its gathered weights, parameters read one by one (bucket_mb 0: a bucket's flat
    copy is a gathered weight too)."""
    rank = dist.get_rank() // (dims.world_size // dims.dp_shard)  # this rank's rows (dp_shard is outermost)
    rows = global_batches(1)[0].chunk(dims.dp_shard)[rank]
    kept = saved_bytes_per_layer(lambda n: _build(name, dims, n_layers=n, bucket_mb=0)[0],
                                 lambda model: model(rows[:, :-1], rows[:, 1:]))
    return kept - _gathered_bytes(_build(name, dims, n_layers=2, bucket_mb=0)[0].layers["1"])


def _run(name: str, dims: ParallelDims, *, graph: bool, dispatch: str = "all_gather", scan: bool = False,
         ac_mode: str = "none") -> dict:
    model, mesh = _build(name, dims, dispatch=dispatch, scan=scan, ac_mode=ac_mode)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    step_fn = graph_step(model, dp_size) if graph else None
    out = train(model, documents=False, dp_rank=dp_rank, dp_size=dp_size, step_fn=step_fn)
    if scan:
        return out
    experts = model.layers["1"].moe.experts._parameters["w1"]  # the stored DTensor (reading w1 gathers it)
    out["experts"] = (tuple(experts.device_mesh.mesh_dim_names), tuple(experts.to_local().shape))
    out["stored"] = sum(p.to_local().numel() for p in model.parameters())
    # Dense weights whole on tp (norms, routers, shared experts, MLA's down-projections): elements
    names = mesh.mesh_dim_names
    out["whole_on_tp"] = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n
                             and "tp" in names and p.placements[names.index("tp")].is_replicate())
    out["stored_experts"] = sum(p.to_local().numel() for n, p in model.named_parameters() if ".experts." in n)
    return out


def _worker(layout: str) -> dict:
    dims = ParallelDims(**LAYOUTS[layout], world_size=dist.get_world_size())
    runs = {}
    for name in MODELS:
        runs[(name, "eager")] = _run(name, dims, graph=False)
        runs[(name, "graph")] = _run(name, dims, graph=True)
    runs[(MODELS[0], "eager-all_to_all")] = _run(MODELS[0], dims, graph=False, dispatch="all_to_all")
    if dims.tp > 1:  # the stacks' tp placements (a scanned MoE stack has no dense feed-forward)
        runs[(MODELS[1], "scan-graph-full")] = _run(MODELS[1], dims, graph=True, scan=True, ac_mode="full")
    return {"runs": runs, "saved_per_moe_layer": {name: _saved_per_moe_layer(name, dims) for name in MODELS}}


@functools.cache
def layout_runs(layout: str) -> list[dict]:
    """One 4-rank spawn per layout: every model and mode of it."""
    return run_distributed(_worker, world_size=4, args=(layout,), timeout_s=600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_composes_with_tp_and_cp_like_one_process(layout):
    for rank_results in layout_runs(layout):
        for (name, mode), run in rank_results["runs"].items():
            assert_matches_reference(run, name, documents=False)
            if mode.startswith("scan"):
                continue
            mesh_names, local_shape = run["experts"]
            # experts on (dp_shard_mod_ep, ep, cp or tp): 8 experts, 4 a rank, rows over dp_shard_mod_ep (1)
            assert mesh_names == ("dp_shard_mod_ep", "ep", "tp" if "tp" in layout else "cp"), (name, mode)
            assert local_shape[0] == 4, (name, mode, local_shape)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_planner_counts_what_a_composed_rank_stores_and_keeps(layout):
    """The planner's terms (parallel/plan_terms.py Layout, activation_bytes) on these layouts: the
    experts' elements a rank stores exactly (1 / dp_shard: whole on tp and cp), all its parameters
    within what it leaves out (norms and routers whole on tp, split by tp in its count), and the
    bytes autograd keeps for an MoE block (its experts on the rank's sequence shard under tp; the
    ep group's rows; cp's gathered keys and values)."""
    dims = LAYOUTS[layout]
    plan = Layout(dp_shard=dims["dp_shard"], ep=dims["ep"], tp=dims.get("tp", 1), cp=dims.get("cp", 1))
    tokens = BATCH * SEQ // plan.dp_shard // plan.cp  # the rank's (tp ranks share theirs)
    for name in MODELS:
        args = args_for(name)
        padded = args.mla is not None  # CPU SDPA pads MLA's narrower values (kernels/attention.py)
        predicted = activation_bytes(args, tokens=tokens, ac_mode="none", dtype_bytes=4, ep=plan.ep, tp=plan.tp,
                                     padded_values=padded).saved_per_layer[-1]
        if plan.cp > 1:
            q_dim, k_dim, v_dim = attention_widths(args, plan.tp)
            predicted += cp_attention_saved_bytes(batch_size=BATCH // plan.dp_shard, seq_len=SEQ, cp=plan.cp,
                                                  q_dim=q_dim, kv_dim=k_dim, v_dim=v_dim, dtype_bytes=4,
                                                  documents=False, mask=True, padded_values=padded)
        stored = plan.stored_elements(num_params(args), num_expert_params(args))
        for rank_results in layout_runs(layout):
            # Not counted, as on one process (test_planner.py): the MoE per-expert counts, [E] int64.
            kept = rank_results["saved_per_moe_layer"][name]
            assert 0 <= kept - predicted <= 8 * args.moe.num_experts, (name, kept, predicted)
            run = rank_results["runs"][(name, "eager")]
            assert run["stored_experts"] == num_expert_params(args) // plan.dp_shard
            # The planner splits every dense weight by tp; those kept whole there are its known miss.
            missed = run["whole_on_tp"] * (1 - 1 / plan.tp) / plan.dp_shard
            assert run["stored"] == pytest.approx(stored + missed, rel=1e-9), (name, run["stored"], stored, missed)
