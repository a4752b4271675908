"""Context parallelism (parallel/context_parallel.py): the head-tail split and the sharded attention
in one process, parity with one process on gloo ranks (with and without document masks, in graph
mode, with scanned layers, through a checkpoint, the MoE model with each balancing), and its
one-line errors."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from parallel_helpers import (
    BATCH,
    LR,
    MAX_NORM,
    SEED,
    SEQ,
    STEPS,
    TOL,
    global_batches,
    saved_bytes_per_layer,
    tiny_args,
)

from titan_tpu.graph.compile import GraphStep
from titan_tpu.kernels.attention import document_ids_from_positions, reference_attention
from titan_tpu.models.common.transformer import Transformer, activation_bytes
from titan_tpu.models.registry import build_model
from titan_tpu.parallel.context_parallel import (
    check_context_parallel,
    context_parallel,
    cp_attention_saved_bytes,
    head_tail_positions,
    shard_attention,
)
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.plan import plan_config
from titan_tpu.plan.hardware import resolve_hardware
from titan_tpu.plan.planner import for_planning
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep


def packed_positions(steps: int) -> torch.Tensor:
    """[steps, BATCH, SEQ] positions restarting where a packed document starts: documents of 3 to
    20 tokens, so they cross the cp shards' chunk boundaries."""
    g = torch.Generator().manual_seed(1)
    out = torch.empty(steps, BATCH, SEQ, dtype=torch.long)
    for s in range(steps):
        for b in range(BATCH):
            row = []
            while len(row) < SEQ:
                length = int(torch.randint(3, 21, (), generator=g))
                row.extend(range(length))
            out[s, b] = torch.tensor(row[:SEQ])
    return out


def optimizer_for(model) -> AdamW:
    """AdamW that knows the scanned model's stacked weights (no decay on the stacked norm scales)."""
    return AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())


def args_for(model: str):
    """A model key's tiny args: a model name, or for the MoE model name:balancing ("qwen3_moe:aux_loss")."""
    name, _, load_balance = model.partition(":")
    return tiny_args(name, load_balance or None)


def train(model, *, documents: bool, dp_rank: int = 0, dp_size: int = 1, step_fn=None) -> dict:
    """Train on this data-parallel rank's rows of each global batch; returns the losses, grad
    norms, MoE balancing losses and expert loads per step, and the expert biases at the end."""
    optimizer = step_fn.optimizer if step_fn is not None else optimizer_for(model)
    step_fn = step_fn or EagerStep(model, optimizer, max_norm=MAX_NORM, dp_size=dp_size)
    batches, positions = global_batches(STEPS), packed_positions(STEPS)
    out = {"losses": [], "norms": [], "aux": [], "loads": []}
    for step in range(STEPS):
        rows = batches[step].chunk(dp_size)[dp_rank]
        batch = (rows[:, :-1], rows[:, 1:])
        if documents:
            batch += (positions[step].chunk(dp_size)[dp_rank],)
        result = step_fn([batch], LR)
        out["losses"].append(result.loss)
        out["norms"].append(result.grad_norm)
        out["aux"].append(result.aux_loss)
        out["loads"].append(result.expert_load)
    out["biases"] = {n: b.clone() for n, b in model.named_buffers() if "expert_bias" in n}
    return out


@functools.cache
def reference(name: str, documents: bool) -> dict:
    """The one-process run of a model key (`args_for`): `train`'s results and the trained model's logits."""
    model = build_model(args_for(name), seed=SEED)
    return {**train(model, documents=documents), "logits": model(global_batches(1)[0, :, :-1]).detach()}


@functools.cache
def scan_reference(documents: bool) -> dict:
    """The one-process run with scanned layers (eager, no checkpointing)."""
    model = build_model(tiny_args("llama3"), seed=SEED, scan_layers=True)
    return {**train(model, documents=documents), "logits": model(global_batches(1)[0, :, :-1]).detach()}


def build_parallel(name: str, dims: ParallelDims, *, documents: bool, ac_mode: str = "none", scan: bool = False):
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args_for(name), ac_mode=ac_mode, scan_layers=scan)
    context_parallel(model, mesh, seq_len=SEQ, documents=documents)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED)
    return model, mesh


def _run(name: str, dims: ParallelDims, *, documents: bool = False, graph: bool = False,
         ac_mode: str = "none", scan: bool = False) -> dict:
    model, mesh = build_parallel(name, dims, documents=documents, ac_mode=ac_mode, scan=scan)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    out = {"mesh": mesh.mesh_dim_names}
    step_fn = None
    if graph:
        example = torch.zeros(BATCH // dp_size, SEQ, dtype=torch.long)
        step_fn = GraphStep(model, optimizer_for(model), max_norm=MAX_NORM,
                            example_batch=(example, example) + ((example,) if documents else ()), backend="eager",
                            dp_size=dp_size)
        out["collectives"] = {op.split(".")[1]: n for op, n in step_fn.captured.collective_counts().items()}
    out.update(train(model, documents=documents, dp_rank=dp_rank, dp_size=dp_size, step_fn=step_fn))
    if not graph:
        out["logits"] = model(global_batches(1)[0, :, :-1]).detach()  # gathered in sequence order
    return out


def _saved_bytes_per_layer(name: str, dims: ParallelDims, *, documents: bool) -> int:
    """Per-parameter reads (bucket_mb 0): a bucket's flat copy of the weights is the planner's
    gathered-weights term, not an activation."""
    def build(n_layers: int):
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(args_for(name), n_layers=n_layers))
        context_parallel(model, mesh, seq_len=SEQ, documents=documents)
        return materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                    seed=SEED, bucket_mb=0)

    tokens = global_batches(1)[0, :, :-1]
    positions = packed_positions(1)[0] if documents else None
    return saved_bytes_per_layer(build, lambda model: model(tokens, tokens, positions_BS=positions))


DENSE_MODELS = ["llama3", "qwen3"]
# The MoE model with each balancing: the routing statistics they read are summed over cp.
MOE_MODELS = ["qwen3_moe:aux_loss", "qwen3_moe:expert_bias"]
GRAPH_RUNS = [("llama3", False), ("llama3", True), *((m, False) for m in MOE_MODELS)]  # (model, documents)


def _cp2_worker(models: tuple[str, ...]) -> dict:
    """These models' cp 2 runs: eager with and without documents, graph mode (GRAPH_RUNS), the
    planner's activation bytes; Qwen3 with selective checkpointing."""
    dims = ParallelDims(cp=2, world_size=dist.get_world_size())
    runs = {"saved_per_layer": {(n, d): _saved_bytes_per_layer(n, dims, documents=d)
                                for n in models for d in (False, True)}}
    for name in models:
        runs[name] = _run(name, dims)
        runs[f"{name}-docs"] = _run(name, dims, documents=True)
    for name, documents in GRAPH_RUNS:
        if name in models:
            runs[f"{name}-docs-graph" if documents else f"{name}-graph"] = _run(name, dims, documents=documents,
                                                                              graph=True)
    if "qwen3" in models:
        runs["qwen3-ac"] = _run("qwen3", dims, ac_mode="selective")
    return runs


@functools.cache
def cp2_runs(moe: bool = False) -> list[dict]:
    """One 2-rank spawn for the cp 2 tests of the dense models, one for the MoE models' (starting
    ranks costs more than the runs; apart, a -k selection of either starts only its own). A cp 2
    checkpoint resuming on one process: tests/test_train_dist.py (cp2-to-1)."""
    models = MOE_MODELS if moe else DENSE_MODELS
    return run_distributed(_cp2_worker, world_size=2, args=(tuple(models),), timeout_s=300)


def runs_of(name: str) -> list[dict]:
    return cp2_runs(moe=name in MOE_MODELS)


def _cp2_scan_worker() -> dict:
    dims = ParallelDims(cp=2, world_size=dist.get_world_size())
    return {"eager": _run("llama3", dims, scan=True),
            "eager-docs": _run("llama3", dims, scan=True, documents=True),
            "graph-full": _run("llama3", dims, scan=True, graph=True, ac_mode="full"),
            "graph-full-docs": _run("llama3", dims, scan=True, graph=True, ac_mode="full", documents=True)}


@functools.cache
def cp2_scan_runs() -> list[dict]:
    """cp 2 with scanned layers (Llama 3): one 2-rank spawn for the scan tests."""
    return run_distributed(_cp2_scan_worker, world_size=2, timeout_s=300)


def assert_matches_reference(run: dict, name: str, documents: bool, ref: dict | None = None) -> None:
    """Losses and grad norms to TOL; for an MoE model also the balancing losses (relative, TOL's
    rtol: they are ~1e-3), the expert loads of every step (the same routing) and the final expert
    biases."""
    ref = ref or reference(name, documents)
    assert ref["losses"][-1] < ref["losses"][0] - 1.0  # it learns, so a divergence would show
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), **TOL)
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), **TOL)
    torch.testing.assert_close(torch.tensor(run["aux"]), torch.tensor(ref["aux"]), rtol=TOL["rtol"], atol=1e-9)
    for load, want in zip(run["loads"], ref["loads"], strict=True):
        assert (load is None and want is None) or torch.equal(load, want), (load, want)
    assert run["biases"].keys() == ref["biases"].keys()
    for key, bias in run["biases"].items():
        torch.testing.assert_close(bias, ref["biases"][key], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# One process


def test_head_tail_split_balances_causal_work():
    S, cp = 32, 4
    shards = [head_tail_positions(S, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(shards)).values, torch.arange(S))  # a partition of the sequence
    assert shards[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]  # chunks 1 and 2 cp - 2 of 8
    # Causal (query, key) pairs per rank: sum over its queries of (position + 1), equal on every rank.
    assert len({int((s + 1).sum()) for s in shards}) == 1


@pytest.mark.parametrize("documents", [False, True])
def test_sharded_attention_equals_full_attention(documents):
    """Simulate cp ranks in one process: each rank's queries against every rank's keys in rank
    order (what the all-gather hands over) give that rank's rows of full attention."""
    torch.manual_seed(0)
    B, S, H, K, D, cp = 2, 24, 4, 2, 8, 3
    q, k, v = torch.randn(B, S, H, D), torch.randn(B, S, K, D), torch.randn(B, S, K, D)
    ids = document_ids_from_positions(packed_positions(1)[0, :B, :S]) if documents else None
    full = reference_attention(q, k, v, ids)
    shards = [head_tail_positions(S, cp, r) for r in range(cp)]
    k_pos = torch.cat(shards)
    for mine in shards:
        out = shard_attention(q[:, mine], k[:, k_pos], v[:, k_pos], q_pos_Q=mine, k_pos_S=k_pos,
                              document_ids_BQ=None if ids is None else ids[:, mine],
                              document_ids_BS=None if ids is None else ids[:, k_pos])
        torch.testing.assert_close(out, full[:, mine], rtol=1e-5, atol=1e-5)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"--training.seq_len \(30\) divisible by 2 \* cp = 4"):
        check_context_parallel(2, seq_len=30)
    with pytest.raises(ValueError, match="must equal the world size"):
        ParallelDims(dp_shard=2, cp=2, world_size=2)
    with pytest.raises(ValueError, match="must divide the world size"):
        ParallelDims(cp=2, world_size=3)
    with pytest.raises(ValueError, match="cp > 1 with --parallelism.tp > 1"):
        ParallelDims(cp=2, tp=2, world_size=4)
    with pytest.raises(ValueError, match="--parallelism.cp must be >= 1"):
        ParallelDims(cp=0, world_size=1)
    with pytest.raises(ValueError, match=r"cp > 1 with --parallelism.ep > 1 is not supported yet .*; set ep 1"):
        ParallelDims(cp=2, ep=2, world_size=4)


def test_plan_takes_moe_models_with_cp_and_refuses_ep_with_cp():
    """The planner plans what the trainer runs: an MoE model on cp 2 (its activations for half of
    each sequence), and refuses cp with ep in the trainer's words."""
    config = Path(__file__).resolve().parents[1] / "configs" / "qwen3_moe_debug.toml"
    hardware = resolve_hardware("cpu", measure=False)[0]
    one = plan_config(for_planning(config), hardware, measure=False)
    cp2 = plan_config(for_planning(config, ["--parallelism.cp", "2"]), hardware, measure=False, chips=2)
    assert cp2.memory["activations"] < one.memory["activations"]
    assert cp2.memory["parameters"] == pytest.approx(one.memory["parameters"], rel=1e-9)  # replicated over cp
    with pytest.raises(ValueError, match=r"cp > 1 with --parallelism.ep > 1 is not supported yet"):
        plan_config(for_planning(config, ["--parallelism.cp", "2", "--parallelism.ep", "2"]), hardware,
                    measure=False, chips=4)


# ---------------------------------------------------------------------------------------------
# cp 2 on two gloo ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*DENSE_MODELS, *MOE_MODELS])
@pytest.mark.parametrize("documents", [False, True])
def test_cp2_matches_one_process(name, documents):
    for rank_runs in runs_of(name):
        run = rank_runs[f"{name}-docs" if documents else name]
        assert run["mesh"] == ("cp",)
        assert_matches_reference(run, name, documents)
        torch.testing.assert_close(run["logits"], reference(name, documents)["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, documents", GRAPH_RUNS)
def test_cp2_graph_mode_matches_one_process(name, documents):
    n_layers = args_for(name).n_layers
    for rank_runs in runs_of(name):
        run = rank_runs[f"{name}-docs-graph" if documents else f"{name}-graph"]
        assert_matches_reference(run, name, documents)
        counts = run["collectives"]
        # Per block: keys and values gathered (and, with documents, the document ids); their
        # backward reduce-scatters the key and value gradients.
        assert counts["all_gather_into_tensor"] == (3 if documents else 2) * n_layers, counts
        assert counts["reduce_scatter_tensor"] == 2 * n_layers, counts
        assert counts["all_reduce"] >= 1, counts  # the loss over cp, parameter gradients over cp


@pytest.mark.multiprocess
def test_cp2_with_activation_checkpointing_matches_one_process():
    for rank_runs in cp2_runs():
        assert_matches_reference(rank_runs["qwen3-ac"], "qwen3", False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("variant", ["eager", "graph-full"])
def test_cp2_scanned_layers_match_one_process_scanned(variant, documents):
    """Scanned layers on cp 2: eager (the Python loop over the stack), and graph mode with full
    activation checkpointing (scan_op, whose backward differentiates each layer with
    torch.func.vjp through the cp gathers), against the one-process scanned run."""
    for rank_runs in cp2_scan_runs():
        run = rank_runs[f"{variant}-docs" if documents else variant]
        assert_matches_reference(run, "llama3", documents, ref=scan_reference(documents))
        if variant == "eager":
            torch.testing.assert_close(run["logits"], scan_reference(documents)["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*DENSE_MODELS, *MOE_MODELS])
@pytest.mark.parametrize("documents", [False, True])
def test_cp2_planner_activation_terms_match_autograd(name, documents):
    """The planner's per-block activation term with cp 2 (the block's terms for the rank's tokens
    plus cp_attention_saved_bytes) is what autograd keeps on each rank."""
    args = args_for(name)
    predicted = activation_bytes(args, tokens=BATCH * SEQ // 2, ac_mode="none", dtype_bytes=4).saved_per_layer[0]
    predicted += cp_attention_saved_bytes(batch_size=BATCH, seq_len=SEQ, cp=2, kv_dim=args.n_kv_heads * args.hd,
                                          dtype_bytes=4, documents=documents)
    # Not counted, as on one process (test_planner.py): the MoE per-expert counts, [E] int64.
    slack = 8 * args.moe.num_experts if args.moe is not None else 0
    for rank_runs in runs_of(name):
        assert 0 <= rank_runs["saved_per_layer"][(name, documents)] - predicted <= slack
