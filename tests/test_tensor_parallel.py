"""Tensor parallelism (parallel/tensor_parallel.py): parity with one process on gloo ranks, composed
with SimpleFSDP, in graph mode, with scanned layers, through a checkpoint, and its one-line errors."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
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
from titan_tpu.models.common.activation_memory import activation_bytes
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import build_model, get_model_args
from titan_tpu.models.spec import model_spec
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.parallel.tensor_parallel import check_tensor_parallel, tensor_parallel
from titan_tpu.plan import plan_config
from titan_tpu.plan.setting import for_planning
from titan_tpu.train.checkpoint import Checkpointer
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep


def optimizer_for(model) -> AdamW:
    """AdamW that knows the scanned model's stacked weights (no decay on the stacked norm scales)."""
    return AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())


def train(model, batches: torch.Tensor, *, dp_rank: int = 0, dp_size: int = 1, step_fn=None,
          save_at: tuple[int, str] | None = None) -> tuple[list, list]:
    """Train on this data-parallel rank's rows of each global batch; returns (losses, grad norms).
    save_at (step, directory): write a checkpoint (model and optimizer) after that many steps."""
    optimizer = step_fn.optimizer if step_fn is not None else optimizer_for(model)
    step_fn = step_fn or EagerStep(model, optimizer, max_norm=MAX_NORM, dp_size=dp_size)
    losses, norms = [], []
    for step, batch in enumerate(batches):
        rows = batch.chunk(dp_size)[dp_rank]
        result = step_fn([(rows[:, :-1], rows[:, 1:])], LR)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if save_at is not None and step + 1 == save_at[0]:
            Checkpointer(save_at[1]).save(step + 1, {"step": step + 1, "model": model.state_dict(),
                                                     "optimizer": optimizer.state_dict()})
    return losses, norms


@functools.cache
def reference(name: str) -> dict:
    """The one-process run: losses, grad norms, and the logits of the trained model."""
    model = build_model(tiny_args(name), seed=SEED)
    losses, norms = train(model, global_batches(STEPS))
    return {"losses": losses, "norms": norms, "logits": model(global_batches(1)[0, :, :-1]).detach(),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def build_parallel(name: str, dims: ParallelDims, *, ac_mode: str = "none", scan: bool = False):
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(tiny_args(name), ac_mode=ac_mode, scan_layers=scan)
    tensor_parallel(model, mesh, seq_len=SEQ)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED)
    return model, mesh


def _run(name: str, dims: ParallelDims, *, graph: bool = False, ac_mode: str = "none",
         save_dir: str | None = None, scan: bool = False) -> dict:
    model, mesh = build_parallel(name, dims, ac_mode=ac_mode, scan=scan)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    attention = model.layers.attention if scan else model.layers["0"].attention
    wq = attention.wq if attention.wq is not None else attention.wq_b  # MLA's low-rank query: wq_b
    out = {"mesh": mesh.mesh_dim_names, "wq_compute_shape": tuple(wq.weight.shape)}
    step_fn = None
    if graph:
        example = torch.zeros(BATCH // dp_size, SEQ, dtype=torch.long)
        step_fn = GraphStep(model, optimizer_for(model), max_norm=MAX_NORM,
                            example_batch=(example, example), backend="eager", dp_size=dp_size)
        out["collectives"] = {op.split(".")[1]: n for op, n in step_fn.captured.collective_counts().items()}
    out["losses"], out["norms"] = train(model, global_batches(STEPS), dp_rank=dp_rank, dp_size=dp_size,
                                        step_fn=step_fn, save_at=(STEPS // 2, save_dir) if save_dir else None)
    if not graph:
        out["logits"] = model(global_batches(1)[0, :, :-1]).detach()  # gathered over the vocabulary
    if scan:  # the checkpoint layout: per-layer global tensors, as unrolled
        out["state"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def _saved_bytes_per_layer(name: str, dims: ParallelDims) -> int:
    def build(n_layers: int):
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(tiny_args(name), n_layers=n_layers))
        tensor_parallel(model, mesh, seq_len=SEQ)
        return materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                    seed=SEED)

    tokens = global_batches(1)[0, :, :-1]
    return saved_bytes_per_layer(build, lambda model: model(tokens, tokens))


def _tp2_worker(save_dir: str) -> dict:
    dims = ParallelDims(tp=2, world_size=dist.get_world_size())
    return {"saved_per_layer": {n: _saved_bytes_per_layer(n, dims) for n in ("llama3", "qwen3", "mla", "mla_wq")},
            "llama3": _run("llama3", dims, save_dir=save_dir), "qwen3": _run("qwen3", dims),
            "mla": _run("mla", dims), "mla_wq": _run("mla_wq", dims),
            "llama3-graph": _run("llama3", dims, graph=True), "qwen3-graph": _run("qwen3", dims, graph=True),
            "mla-graph": _run("mla", dims, graph=True),
            "llama3-ac": _run("llama3", dims, ac_mode="selective"),
            "qwen3-ac-graph": _run("qwen3", dims, graph=True, ac_mode="full")}


def _tp2_scan_worker() -> dict:
    dims = ParallelDims(tp=2, world_size=dist.get_world_size())
    return {"llama3-eager": _run("llama3", dims, scan=True),
            "qwen3-graph-full": _run("qwen3", dims, scan=True, graph=True, ac_mode="full"),
            "mla-graph-full": _run("mla", dims, scan=True, graph=True, ac_mode="full")}


@functools.cache
def tp2_scan_runs() -> list[dict]:
    """tp 2 with scanned layers: one 2-rank spawn for the scan test."""
    return run_distributed(_tp2_scan_worker, world_size=2, timeout_s=300)


def _dp2_tp2_worker() -> dict:
    dims = ParallelDims(dp_shard=2, tp=2, world_size=dist.get_world_size())
    return {"unrolled": _run("llama3", dims), "scanned": _run("llama3", dims, scan=True)}


@functools.cache
def dp2_tp2_runs() -> list[dict]:
    """One 4-rank spawn for the dp_shard 2 x tp 2 tests."""
    return run_distributed(_dp2_tp2_worker, world_size=4, timeout_s=300)


@functools.cache
def tp2_runs() -> tuple[list[dict], str]:
    """One 2-rank spawn for every tp 2 test (starting ranks costs more than the runs)."""
    save_dir = tempfile.mkdtemp(prefix="tp2-ckpt-")
    return run_distributed(_tp2_worker, world_size=2, args=(save_dir,), timeout_s=300), save_dir


def assert_matches_reference(run: dict, name: str) -> None:
    ref = reference(name)
    assert ref["losses"][-1] < ref["losses"][0] - 1.0  # it learns, so a divergence would show
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), **TOL)
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), **TOL)


def local_query_shape(args) -> tuple[int, int]:
    """The compute shape of a tp 2 rank's query projection (its heads): wq, or MLA's wq_b after
    the low-rank query."""
    if args.mla is None:
        return args.n_heads * args.hd // 2, args.dim
    return args.n_heads * args.mla.qk_head_dim // 2, args.mla.q_lora_rank or args.dim


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama3", "qwen3", "mla", "mla_wq"])
def test_tp2_matches_one_process(name):
    """mla, mla_wq: multi-head latent attention split by heads (MLA_BLOCK_PLAN), with and without
    the low-rank query."""
    args = tiny_args(name)
    for rank_runs in tp2_runs()[0]:
        run = rank_runs[name]
        assert run["mesh"] == ("tp",)
        assert run["wq_compute_shape"] == local_query_shape(args)  # this rank's heads
        assert_matches_reference(run, name)
        torch.testing.assert_close(run["logits"], reference(name)["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama3", "qwen3", "mla"])
def test_tp2_graph_mode_matches_one_process(name):
    n_layers = tiny_args(name).n_layers
    for rank_runs in tp2_runs()[0]:
        run = rank_runs[f"{name}-graph"]
        assert_matches_reference(run, name)
        counts = run["collectives"]
        # Sequence parallelism: per block an all-gather before attention and before the feed-forward
        # and a reduce-scatter after each, forward and backward swapped; the embedding's
        # reduce-scatter and the gather after the final norm, each with its backward.
        assert counts["all_gather_into_tensor"] == 4 * n_layers + 2, counts
        assert counts["reduce_scatter_tensor"] == 4 * n_layers + 2, counts
        # Norm gradients (2 per block, q/k norms, the final norm) summed over tp; the loss
        # kernel's max, sum and target logit; the gradient norm and the logged loss.
        norms = 2 * n_layers + 1 + (2 * n_layers if name == "qwen3" else 0)
        if name == "mla":  # the latent norms and the replicated down-projections wq_a and wkv_a
            norms += 4 * n_layers
        assert counts["all_reduce"] == norms + 3 + 2, counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, run_name", [("llama3", "llama3-ac"), ("qwen3", "qwen3-ac-graph")])
def test_tp2_with_activation_checkpointing_matches_one_process(name, run_name):
    """Checkpointed blocks run a template of the block (functional_block.py): the plan applies to it."""
    for rank_runs in tp2_runs()[0]:
        assert_matches_reference(rank_runs[run_name], name)
    if run_name.endswith("graph"):  # the recomputed forward gathers the sequence again
        counts = tp2_runs()[0][0][run_name]["collectives"]
        assert counts["all_gather_into_tensor"] > 4 * tiny_args(name).n_layers + 2, counts


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tp2_checkpoint_resumes_on_one_process():
    """A checkpoint written by 2 tp ranks after STEPS // 2 steps, loaded by one process, continues with
    the one-process losses."""
    save_dir = tp2_runs()[1]
    model = build_model(tiny_args("llama3"), seed=SEED + 1)  # other weights: the load must replace them
    optimizer = AdamW(dict(model.named_parameters()))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    Checkpointer(save_dir).load(Checkpointer(save_dir).latest(), state)
    optimizer.step_count = state["optimizer"]["step"]
    assert optimizer.step_count == STEPS // 2
    step_fn = EagerStep(model, optimizer, max_norm=MAX_NORM)
    losses, _ = train(model, global_batches(STEPS)[STEPS // 2:], step_fn=step_fn)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference("llama3")["losses"][STEPS // 2:]), **TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, run_name", [("llama3", "llama3-eager"), ("qwen3", "qwen3-graph-full"),
                                            ("mla", "mla-graph-full")])
def test_tp2_scanned_layers_match_one_process(name, run_name):
    """Scanned layers on tp 2 (stacked weights sharded one dim in, the template block computing
    with local heads): eager, and graph mode with full activation checkpointing (the backward scan
    differentiates each layer with torch.func.vjp through the sequence collectives), against the
    unrolled one-process run (which a one-process scanned run equals, tests/test_scan_ac.py); the
    state dict is the unrolled layout of the same global tensors. mla: a dense model with
    multi-head latent attention, its stacked weights placed by MLA_BLOCK_PLAN."""
    args = tiny_args(name)
    for rank_runs in tp2_scan_runs():
        run = rank_runs[run_name]
        assert_matches_reference(run, name)
        assert run["wq_compute_shape"] == (args.n_layers, *local_query_shape(args))  # this rank's heads
        for key, value in reference(name)["state"].items():
            torch.testing.assert_close(run["state"][key], value, atol=1e-4, rtol=1e-4)
        if "logits" in run:
            torch.testing.assert_close(run["logits"], reference(name)["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layers", ["unrolled", "scanned"])
def test_dp_shard2_tp2_matches_one_process(layers):
    """Scanned: the stack sharded over dp_shard and tp on its per-layer dims, read whole before
    the loop (simple_fsdp._reshard_pieces); its state dict is the unrolled layout."""
    for rank_runs in dp2_tp2_runs():
        run = rank_runs[layers]
        assert run["mesh"] == ("dp_shard", "tp")
        assert_matches_reference(run, "llama3")
        torch.testing.assert_close(run["logits"], reference("llama3")["logits"], rtol=1e-4, atol=1e-4)
        if layers == "scanned":
            for key, value in reference("llama3")["state"].items():
                torch.testing.assert_close(run["state"][key], value, atol=1e-4, rtol=1e-4)


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
    # An MoE model's experts are whole on tp (tests/test_moe_composed.py): their widths need not
    # divide, its attention's heads must.
    moe = dataclasses.replace(get_model_args("qwen3_moe", "debug"), ffn_hidden_dim=3)
    check_tensor_parallel(moe, 2)
    with pytest.raises(ValueError, match=r"tp \(3\) must divide the model's n_heads"):
        check_tensor_parallel(moe, 3)
    check_tensor_parallel(moe, 1)  # tp 1: nothing to check


@pytest.mark.parametrize("kwargs, match", [
    (dict(dp_shard=2, tp=2, world_size=8), r"dp_replicate \(1\) \* --parallelism.dp_shard \(2\) \* "
                                           r"--parallelism.pp \(1\) \* --parallelism.cp \(1\) \* --parallelism.tp "
                                           r"\(2\) must equal the world size \(8\)"),
    (dict(tp=3, world_size=4), r"\* --parallelism.cp \(1\) \* --parallelism.tp \(3\) must divide the world size "
                               r"\(4\)"),
    (dict(tp=0, world_size=4), r"--parallelism.tp must be >= 1"),
])
def test_parallel_dims_tp_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ParallelDims(**kwargs)
    assert "\n" not in str(info.value)


def test_parallel_dims_tp_leaves_dp_shard():
    d = ParallelDims(tp=2, world_size=8)
    assert (d.dp_shard, d.dp_size, d.tp, d.mode) == (4, 4, 2, "fully_shard")
    assert ParallelDims(tp=2, world_size=2).mode == "none"
    assert ParallelDims(cp=2, tp=2, world_size=4).mode == "none"  # cp x tp (tests/test_context_parallel.py)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama3", "qwen3", "mla", "mla_wq"])
def test_tp2_planner_activation_terms_match_autograd(name):
    """The planner's per-block activation term with tp 2 (models/common/activation_memory.py
    block_saved_per_token) is what autograd keeps on each rank; MLA with its latent tensors whole on
    every rank and its values padded by the CPU attention kernel (kernels/attention.py)."""
    predicted = activation_bytes(tiny_args(name), tokens=BATCH * SEQ, ac_mode="none", dtype_bytes=4,
                                 tp=2, padded_values=True).saved_per_layer[0]
    for rank_runs in tp2_runs()[0]:
        assert rank_runs["saved_per_layer"][name] == predicted


# ---------------------------------------------------------------------------------------------
# GPU recipes with tensor parallelism, checked by the planner
# ---------------------------------------------------------------------------------------------

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name, gpus", [("llama3_70b_h100_tp", 32), ("llama3_405b_h100_tp", 128)])
def test_h100_tp_recipe(name, gpus):
    cfg = for_planning(CONFIGS / f"{name}.toml")
    p = cfg.parallelism
    assert f"{gpus} GPUs" in cfg.job.description and cfg.training.device == "cuda"
    assert p.tp == 8 and p.dp_replicate * p.dp_shard * p.tp == gpus  # tp inside an 8-GPU NVLink node
    check_tensor_parallel(model_spec(cfg.model).args, p.tp, seq_len=cfg.training.seq_len)
    plan = plan_config(cfg)
    assert (plan.hardware["name"], plan.devices, plan.mesh["tp"]) == ("h100", gpus, 8)
    assert plan.fits, f"{plan.peak_bytes / 1e9:.1f} GB per GPU at {plan.peak_phase}"
    assert any(c["axis"] == "tp" and c["bytes_per_step"] > 0 for c in plan.communication)


def test_70b_training_state_does_not_fit_8_h100():
    """Why the 70B recipe spans 4 nodes: fp32 weights, gradients and AdamW moments (16 bytes per
    parameter) need 1.1 TB, more than 8 x 80 GB, however the 8 GPUs are split."""
    for tp, dp_shard in ((8, 1), (4, 2), (2, 4)):
        cfg = for_planning(CONFIGS / "llama3_70b_h100_tp.toml",
                           ["--parallelism.tp", str(tp), "--parallelism.dp_shard", str(dp_shard)])
        plan = plan_config(cfg, chips=8)
        assert plan.devices == 8 and not plan.fits


def test_plan_divides_the_state_by_tp():
    base = for_planning(CONFIGS / "llama3_70b_h100_tp.toml")
    tp8 = plan_config(base)
    no_tp = plan_config(for_planning(CONFIGS / "llama3_70b_h100_tp.toml",
                                     ["--parallelism.tp", "1", "--parallelism.dp_shard", "32"]))
    # The same 32-way split of the state either way; tp also divides the activations.
    assert tp8.memory["parameters"] == pytest.approx(no_tp.memory["parameters"], rel=1e-9)
    assert tp8.memory["activations"] < no_tp.memory["activations"] / 4
