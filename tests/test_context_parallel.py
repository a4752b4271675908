"""Context parallelism (parallel/context_parallel.py): the head-tail split and the sharded attention
in one process, parity with one process on gloo ranks (with and without document masks, in graph
mode, with scanned layers, through a checkpoint, with tensor parallelism: cp x tp, the MoE model with
each balancing), and its
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
from titan_tpu.kernels.attention import CHUNK_ATTENTION, document_ids_from_positions, reference_attention
from titan_tpu.models.common.activation_memory import activation_bytes
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import build_model
from titan_tpu.models.spec import model_spec
from titan_tpu.parallel.context_parallel import (
    check_context_parallel,
    context_parallel,
    cp_attention_saved_bytes,
    head_tail_attention,
    head_tail_positions,
    sequence_order,
)
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.parallel.tensor_parallel import tensor_parallel
from titan_tpu.plan import plan_config
from titan_tpu.plan.hardware import resolve_hardware
from titan_tpu.plan.setting import attention_widths, for_planning
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama3_debug.toml"


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
    # Per layer (the state dict's names), whether the layers are scanned or not.
    out["biases"] = {n: b.clone() for n, b in model.state_dict().items() if "expert_bias" in n}
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


def apply_plans(model: Transformer, mesh, dims: ParallelDims, *, documents: bool) -> None:
    """The plans in the trainer's order (models/spec.py): tensor parallelism (with cp x tp), then
    context parallelism."""
    if dims.tp > 1:
        tensor_parallel(model, mesh, seq_len=SEQ)
    context_parallel(model, mesh, seq_len=SEQ, documents=documents)


def build_parallel(name: str, dims: ParallelDims, *, documents: bool, ac_mode: str = "none", scan: bool = False):
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args_for(name), ac_mode=ac_mode, scan_layers=scan)
    apply_plans(model, mesh, dims, documents=documents)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED)
    return model, mesh


def graph_step(model, dp_size: int, *, documents: bool = False) -> GraphStep:
    """`model`'s captured step (eager backend) for micro-batches of BATCH / dp_size rows."""
    example = torch.zeros(BATCH // dp_size, SEQ, dtype=torch.long)
    return GraphStep(model, optimizer_for(model), max_norm=MAX_NORM,
                     example_batch=(example, example) + ((example,) if documents else ()), backend="eager",
                     dp_size=dp_size)


def _run(name: str, dims: ParallelDims, *, documents: bool = False, graph: bool = False,
         ac_mode: str = "none", scan: bool = False) -> dict:
    model, mesh = build_parallel(name, dims, documents=documents, ac_mode=ac_mode, scan=scan)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    out = {"mesh": mesh.mesh_dim_names}
    step_fn = None
    if graph:
        step_fn = graph_step(model, dp_size, documents=documents)
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
        apply_plans(model, mesh, dims, documents=documents)
        return materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                    seed=SEED, bucket_mb=0)

    tokens = global_batches(1)[0, :, :-1]
    positions = packed_positions(1)[0] if documents else None
    return saved_bytes_per_layer(build, lambda model: model(tokens, tokens, positions_BS=positions))


DENSE_MODELS = ["llama3", "qwen3"]
# The MoE model with each balancing: the routing statistics they read are summed over cp; and
# DeepSeek-V3 (multi-head latent attention: keys 24 wide per head, values 16; a dense first layer).
MOE_MODELS = ["qwen3_moe:aux_loss", "qwen3_moe:expert_bias", "deepseek_v3:expert_bias"]
GRAPH_RUNS = [("llama3", False), ("llama3", True), ("qwen3_moe:aux_loss", False), ("qwen3_moe:expert_bias", False),
              ("deepseek_v3:expert_bias", True)]  # (model, documents)


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


def _cp2_scan_worker(deepseek: bool) -> dict:
    dims = ParallelDims(cp=2, world_size=dist.get_world_size())
    if deepseek:  # its two stacks: the dense layer, the MoE layers
        return {"graph-full-docs": _run("deepseek_v3:expert_bias", dims, scan=True, graph=True, ac_mode="full",
                                        documents=True)}
    return {"eager": _run("llama3", dims, scan=True),
            "eager-docs": _run("llama3", dims, scan=True, documents=True),
            "graph-full": _run("llama3", dims, scan=True, graph=True, ac_mode="full"),
            "graph-full-docs": _run("llama3", dims, scan=True, graph=True, ac_mode="full", documents=True)}


@functools.cache
def cp2_scan_runs(deepseek: bool = False) -> list[dict]:
    """cp 2 with scanned layers: one 2-rank spawn for Llama 3's scan tests, one for DeepSeek-V3's
    (apart, a -k selection of either starts only its own)."""
    return run_distributed(_cp2_scan_worker, world_size=2, args=(deepseek,), timeout_s=300)


def _dp2_cp2_worker() -> dict:
    dims = ParallelDims(dp_shard=2, cp=2, world_size=dist.get_world_size())
    return {"llama3": _run("llama3", dims)}


@functools.cache
def dp2_cp2_runs() -> list[dict]:
    """One 4-rank spawn for the dp_shard 2 x cp 2 test: one run, the tiny model, no documents."""
    return run_distributed(_dp2_cp2_worker, world_size=4, timeout_s=300)


def _cp2_tp2_worker() -> dict:
    dims = ParallelDims(cp=2, tp=2, world_size=dist.get_world_size())
    return {"saved_per_layer": {d: _saved_bytes_per_layer("llama3", dims, documents=d) for d in (False, True)},
            "eager": _run("llama3", dims), "graph-docs": _run("llama3", dims, documents=True, graph=True),
            "scan-graph-full-docs": _run("llama3", dims, documents=True, graph=True, ac_mode="full", scan=True)}


@functools.cache
def cp2_tp2_runs() -> list[dict]:
    """cp 2 x tp 2 (Llama 3): one 4-rank spawn for the cp x tp tests."""
    return run_distributed(_cp2_tp2_worker, world_size=4, timeout_s=300)


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


def test_sequence_order_undoes_the_head_tail_gather():
    S, cp = 24, 3
    gathered = torch.cat([head_tail_positions(S, cp, r) for r in range(cp)])  # rank order, as the gather hands it
    assert torch.equal(sequence_order(gathered.unsqueeze(0), cp)[0], torch.arange(S))


@pytest.mark.parametrize("rank_as", [int, torch.tensor], ids=["rank-int", "rank-tensor"])
@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
@pytest.mark.parametrize("documents", [False, True])
def test_sharded_attention_equals_full_attention(documents, kernel, rank_as):
    """Simulate cp ranks in one process: each rank's two chunks of queries, each against the keys
    up to its end (chunk_attention), give that rank's rows of full attention, and so do their
    gradients (with respect to the whole sequence's q, k, v, summed over ranks). A tensor rank is
    one program's form (the JAX lowering): every chunk against all keys, its start a value."""
    torch.manual_seed(0)
    B, S, H, K, D, cp = 2, 24, 4, 2, 8, 3
    q, k, v = (torch.randn(B, S, n, D, requires_grad=True) for n in (H, K, K))
    ids = document_ids_from_positions(packed_positions(1)[0, :B, :S]) if documents else None
    full = reference_attention(q, k, v, ids)
    grad = torch.randn_like(full)
    want = torch.autograd.grad(full, (q, k, v), grad)
    out = torch.empty_like(full)
    for rank in map(rank_as, range(cp)):
        mine = head_tail_positions(S, cp, rank)
        out[:, mine] = head_tail_attention(CHUNK_ATTENTION.impls[kernel].fn, q[:, mine], k, v, cp=cp, rank=rank,
                                           document_ids_BQ=None if ids is None else ids[:, mine],
                                           document_ids_BS=ids)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _plan_traffic(cp: int, tp: int) -> dict[tuple[str, str], float]:
    """Bytes per step of each collective the planner counts for llama3 debug on cp x tp ranks."""
    cfg = for_planning(CONFIG, ["--parallelism.cp", str(cp), "--parallelism.tp", str(tp),
                                "--parallelism.dp_shard", "1"])
    return {(c["axis"], c["purpose"]): c["bytes_per_step"] for c in plan_config(cfg, chips=cp * tp).communication}


def test_plan_cp_x_tp_shares_each_plans_traffic():
    """cp x tp in the planner: tp's sequence collectives and loss move a cp rank's tokens (1 / cp),
    cp's gathers a tp rank's kv heads (1 / tp), and the gradients over cp a tp shard (1 / tp)."""
    both, tp_only, cp_only = _plan_traffic(2, 2), _plan_traffic(1, 2), _plan_traffic(2, 1)
    assert set(both) == set(tp_only) | set(cp_only)
    for key, nbytes in {**tp_only, **cp_only}.items():
        assert both[key] == pytest.approx(nbytes / 2), key


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"--training.seq_len \(30\) divisible by 2 \* cp = 4"):
        check_context_parallel(2, seq_len=30)
    with pytest.raises(ValueError, match="must equal the world size"):
        ParallelDims(dp_shard=2, cp=2, world_size=2)
    with pytest.raises(ValueError, match="must divide the world size"):
        ParallelDims(cp=2, world_size=3)
    with pytest.raises(ValueError, match=r"x tp \(4\) needs --training.seq_len / cp \(6\) divisible by tp"):
        check_context_parallel(2, seq_len=12, tp=4)
    with pytest.raises(ValueError, match="--parallelism.cp must be >= 1"):
        ParallelDims(cp=0, world_size=1)
    # cp x ep runs (tests/test_moe_composed.py); ep is still carved out of dp_shard alone
    with pytest.raises(ValueError, match=r"--parallelism.ep \(2\) must divide --parallelism.dp_shard \(1\)"):
        ParallelDims(cp=2, ep=2, world_size=2)


def test_plan_takes_moe_models_with_cp_with_and_without_ep():
    """The planner plans what the trainer runs: an MoE model on cp 2 (its activations for half of
    each sequence), and with ep 2 beside it (tests/test_moe_composed.py checks the terms against a
    rank): the parameters replicated over cp, the dispatch of the rank's own tokens."""
    config = Path(__file__).resolve().parents[1] / "configs" / "qwen3_moe_debug.toml"
    hardware = resolve_hardware("cpu", measure=False)[0]
    one = plan_config(for_planning(config), hardware, measure=False)
    cp2 = plan_config(for_planning(config, ["--parallelism.cp", "2"]), hardware, measure=False, chips=2)
    assert cp2.memory["activations"] < one.memory["activations"]
    assert cp2.memory["parameters"] == pytest.approx(one.memory["parameters"], rel=1e-9)  # replicated over cp
    ep2 = ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]
    without_cp = plan_config(for_planning(config, ep2), hardware, measure=False, chips=2)
    with_cp = plan_config(for_planning(config, [*ep2, "--parallelism.cp", "2"]), hardware, measure=False, chips=4)
    assert with_cp.memory["parameters"] == pytest.approx(without_cp.memory["parameters"], rel=1e-9)
    assert 0 < with_cp.memory["moe_dispatch"] == pytest.approx(without_cp.memory["moe_dispatch"] / 2, rel=1e-9)


def test_plan_counts_mla_keys_and_values_at_their_widths():
    """DeepSeek-V3 on cp 2 (the trainer runs it, with ep 1): the planner's key/value traffic is the
    other rank's keys (heads x (qk_nope + qk_rope)) and values (heads x v_head_dim), each way."""
    config = Path(__file__).resolve().parents[1] / "configs" / "deepseek_v3_debug.toml"
    cfg = for_planning(config, ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--parallelism.ep", "1"])
    plan = plan_config(cfg, resolve_hardware("cpu", measure=False)[0], measure=False, chips=2)
    args, t = model_spec(cfg.model).args, cfg.training
    kv = [c for c in plan.communication if c["axis"] == "cp" and c["purpose"].startswith("keys and values")]
    forwards = 1 if cfg.activation_checkpoint.mode == "none" else 2
    per_token = args.n_heads * (args.mla.qk_head_dim + args.mla.v_head_dim)
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    want = tokens * per_token * 4 // 2 * args.n_layers * (forwards + 1)  # fp32, (cp - 1) / cp of them
    assert [c["bytes_per_step"] for c in kv] == [pytest.approx(want)]


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
def test_dp_shard2_cp2_matches_one_process():
    """Four ranks: each dp_shard rank trains on half the batch's rows, each cp rank of a pair on half
    of every sequence. Parameters are sharded over dp_shard and replicated over cp: each gradient is
    reduce-scattered over dp_shard and all-reduced over cp."""
    for rank_runs in dp2_cp2_runs():
        run = rank_runs["llama3"]
        assert run["mesh"] == ("dp_shard", "cp")
        assert_matches_reference(run, "llama3", False)
        torch.testing.assert_close(run["logits"], reference("llama3", False)["logits"], rtol=1e-4, atol=1e-4)


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
def test_cp2_scanned_deepseek_v3_matches_one_unrolled_process():
    """DeepSeek-V3 scanned as two stacks (the dense layer, the MoE layers) on cp 2, graph mode with
    full checkpointing and documents, against the one-process unrolled run: losses, norms, the
    same expert loads every step, the biases per layer."""
    for rank_runs in cp2_scan_runs(deepseek=True):
        assert_matches_reference(rank_runs["graph-full-docs"], "deepseek_v3:expert_bias", True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*DENSE_MODELS, *MOE_MODELS])
@pytest.mark.parametrize("documents", [False, True])
def test_cp2_planner_activation_terms_match_autograd(name, documents):
    """The planner's per-block activation term with cp 2 (the block's terms for the rank's tokens
    plus cp_attention_saved_bytes) is what autograd keeps on each rank."""
    args = args_for(name)
    # The last layer's: the measured one (DeepSeek-V3's first layer is dense, the second MoE).
    padded = args.mla is not None  # CPU SDPA pads MLA's narrower values (kernels/attention.py)
    predicted = activation_bytes(args, tokens=BATCH * SEQ // 2, ac_mode="none", dtype_bytes=4,
                                 padded_values=padded).saved_per_layer[-1]
    q_dim, k_dim, v_dim = attention_widths(args)
    predicted += cp_attention_saved_bytes(batch_size=BATCH, seq_len=SEQ, cp=2, q_dim=q_dim, kv_dim=k_dim,
                                          v_dim=v_dim, dtype_bytes=4, documents=documents, mask=True,
                                          padded_values=padded)
    # Not counted, as on one process (test_planner.py): the MoE per-expert counts, [E] int64.
    slack = 8 * args.moe.num_experts if args.moe is not None else 0
    for rank_runs in runs_of(name):
        assert 0 <= rank_runs["saved_per_layer"][(name, documents)] - predicted <= slack


# ---------------------------------------------------------------------------------------------
# cp 2 x tp 2 on four gloo ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["eager", "graph-docs", "scan-graph-full-docs"])
def test_cp2_tp2_matches_one_process(variant):
    """cp's hooks around tp's (a cp rank's S / cp tokens sharded again over tp between blocks):
    eager with the gathered logits; graph mode with document masks, counting both plans'
    collectives; scanned layers in graph mode with full checkpointing (the backward scan's vjp
    through both plans' collectives), against the one-process scanned run."""
    documents, scan = "docs" in variant, "scan" in variant
    ref = scan_reference(documents) if scan else reference("llama3", documents)
    n_layers = tiny_args("llama3").n_layers
    for rank_runs in cp2_tp2_runs():
        run = rank_runs[variant]
        assert run["mesh"] == ("cp", "tp")
        assert_matches_reference(run, "llama3", documents, ref=ref)
        if "logits" in run:
            torch.testing.assert_close(run["logits"], ref["logits"], rtol=1e-4, atol=1e-4)
        if variant == "graph-docs":  # tp's sequence collectives (tests/test_tensor_parallel.py) and cp's above
            counts = run["collectives"]
            assert counts["all_gather_into_tensor"] == (4 * n_layers + 2) + 3 * n_layers, counts
            assert counts["reduce_scatter_tensor"] == (4 * n_layers + 2) + 2 * n_layers, counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("documents", [False, True])
def test_cp2_tp2_planner_activation_terms_match_autograd(documents):
    """The planner's per-block terms under cp x tp: tp's for the rank's S / cp tokens, plus the cp
    attention's gathered keys and values of the rank's kv heads (kv dim / tp) and its mask."""
    args = tiny_args("llama3")
    predicted = activation_bytes(args, tokens=BATCH * SEQ // 2, ac_mode="none", dtype_bytes=4, tp=2).saved_per_layer[0]
    predicted += cp_attention_saved_bytes(batch_size=BATCH, seq_len=SEQ, cp=2, q_dim=args.n_heads * args.hd // 2,
                                          kv_dim=args.n_kv_heads * args.hd // 2, dtype_bytes=4, documents=documents,
                                          mask=True)
    for rank_runs in cp2_tp2_runs():
        assert rank_runs["saved_per_layer"][documents] == predicted
