"""Qwen3-MoE: parity with transformers, the grouped-matmul op, static-shaped training in eager and
graph mode (scanned and unrolled, with activation checkpointing), balancing, FLOPs, bad input."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest
import torch
import torch.nn.functional as F

from titan_tpu.kernels import GROUPED_MM, KernelConfig
from titan_tpu.models.common.moe import MoEArgs, aux_loss_from_stats
from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.registry import build_model, flops_per_token, get_model_args, num_active_params, num_params
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

transformers = pytest.importorskip("transformers")

from titan_tpu.models.hub.adapter import from_hf_state_dict, hf_config_from_model_args  # noqa: E402
from titan_tpu.models.hub.checkpoint import load_model_from_hf, save_hf_checkpoint  # noqa: E402


def tiny_args(**moe) -> TransformerArgs:
    return TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128,
                           ffn_hidden_dim=96, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=64,
                           moe=MoEArgs(**{"num_experts": 4, "top_k": 2, "hidden_dim": 32, **moe}))


def random_hf_model(args: TransformerArgs):
    config = transformers.Qwen3MoeConfig(**hf_config_from_model_args("qwen3_moe", args))
    config._attn_implementation = "sdpa"
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # strong random weights: a swapped gate/up or a wrong expert cannot hide
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def tokens_for(args: TransformerArgs, batch: int = 2, seq: int = 40) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def assert_close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(1.0, expected.abs().max().item()))


# ---------------------------------------------------------------------------------------------
# Hugging Face parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("mlp_only_layers", [(), (1,)])
def test_logits_and_loss_with_aux_match_transformers(norm_topk_prob, mlp_only_layers, tmp_path):
    args = tiny_args(norm_topk_prob=norm_topk_prob, mlp_only_layers=mlp_only_layers, aux_loss_coef=0.01)
    hf = random_hf_model(args)
    tokens = tokens_for(args)
    with torch.no_grad():
        want = hf(input_ids=tokens, labels=tokens, output_router_logits=True)

    # Import from transformers' in-memory (fused) experts.
    model = build_model(args)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)  # HF shifts internally
    with torch.no_grad():
        assert_close(model(tokens), want.logits)
        out = model(tokens, labels)
    mean_ce = out.ce_sum / (labels != -100).sum()
    assert_close(out.aux_loss, args.moe.aux_loss_coef * want.aux_loss)
    assert_close(mean_ce + out.aux_loss, want.loss)  # transformers' loss includes coef * aux
    assert out.expert_load.shape == (args.num_moe_layers, 4)
    assert out.expert_load.sum().item() == args.num_moe_layers * tokens.numel() * args.moe.top_k

    # Import from a directory save_pretrained wrote (the hub layout: one tensor per expert).
    hf.save_pretrained(tmp_path / "saved")
    name, args2, model2 = load_model_from_hf(tmp_path / "saved")
    assert name == "qwen3_moe" and args2.moe.norm_topk_prob == norm_topk_prob
    with torch.no_grad():
        assert_close(model2(tokens), want.logits)

    # Export writes the hub layout, and transformers loads it.
    out_dir = save_hf_checkpoint(tmp_path / "exported", name="qwen3_moe", args=args, state_dict=model.state_dict())
    index_or_file = sorted(p.name for p in out_dir.iterdir())
    weights = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"] \
        if "model.safetensors.index.json" in index_or_file else None
    if weights is not None:
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in weights
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert_close(reloaded(input_ids=tokens).logits, want.logits)


def test_expert_bias_models_are_not_exported_to_transformers():
    with pytest.raises(ValueError, match="expert_bias"):
        hf_config_from_model_args("qwen3_moe", tiny_args(load_balance="expert_bias"))


def test_published_flavors_round_trip_through_the_hf_config():
    from titan_tpu.models.hub.adapter import model_args_from_hf_config

    for flavor in ("30b_a3b", "235b_a22b"):
        args = get_model_args("qwen3_moe", flavor)
        assert model_args_from_hf_config(hf_config_from_model_args("qwen3_moe", args)) == ("qwen3_moe", args)


# ---------------------------------------------------------------------------------------------
# Grouped matmul and routing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", GROUPED_MM.available("cpu"))
def test_grouped_mm_matches_a_loop_over_experts(impl):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=g, requires_grad=True)  # stored [E, F, D]
    sizes = torch.tensor([7, 0, 15, 8])
    y = GROUPED_MM.impls[impl].fn(x, w.transpose(1, 2), sizes)
    bounds = [0, 7, 7, 22, 30]
    want = torch.cat([x[bounds[e]:bounds[e + 1]] @ w[e].t() for e in range(4)])
    torch.testing.assert_close(y, want, rtol=0, atol=1e-5)
    grad = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, w), grad)
    ref = torch.autograd.grad(want, (x, w), grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_routing_is_static_shaped_whatever_the_tokens():
    """Two batches routed very differently give graphs of the same shapes: capture once, run both."""
    from titan_tpu.graph import GraphStep

    args = tiny_args()
    model = build_model(args, seed=0)
    opt = AdamW(dict(model.named_parameters()))
    same = torch.zeros(2, 16, dtype=torch.long)
    step = GraphStep(model, opt, max_norm=1.0, example_batch=(same, same), backend="aot_eager")
    varied = tokens_for(args, seq=17)
    for batch in ((same, same), (varied[:, :-1].contiguous(), varied[:, 1:].contiguous())):
        result = step([batch], 1e-3)
        assert result.expert_load.sum().item() == 2 * 16 * args.moe.top_k * args.num_moe_layers


def test_aux_loss_is_transformers_formula():
    stats = torch.tensor([[[3.0, 1.0], [0.7, 0.3]], [[2.0, 2.0], [0.4, 0.6]]])  # 2 layers, T = 4, k = 1
    f = torch.tensor([5.0, 3.0]) / 8
    p = torch.tensor([1.1, 0.9]) / 8
    torch.testing.assert_close(aux_loss_from_stats(stats, top_k=1), 2 * (f * p).sum())


# ---------------------------------------------------------------------------------------------
# Training: eager vs graph, scanned vs unrolled, checkpointing, balancing
# ---------------------------------------------------------------------------------------------


def train(args, *, mode="eager", scan=False, ac="none", steps=6, kernels=None, micro_batches=1):
    model = build_model(args, seed=0, scan_layers=scan, ac_mode=ac, kernels=kernels)
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, args.vocab_size, (4, 33), generator=g) for _ in range(steps)]
    rows = 4 // micro_batches
    batches = [[(t[i:i + rows, :-1].contiguous(), t[i:i + rows, 1:].contiguous()) for i in range(0, 4, rows)]
               for t in data]
    if mode == "eager":
        step = EagerStep(model, opt, max_norm=1.0)
    else:
        from titan_tpu.graph import GraphStep

        step = GraphStep(model, opt, max_norm=1.0, example_batch=batches[0][0], backend=mode)
    results = [step(b, 2e-3) for b in batches]
    biases = {n: b.clone() for n, b in model.named_buffers() if "expert_bias" in n}
    return results, biases


def losses(results):
    return [(r.loss, r.aux_loss) for r in results]


@pytest.fixture(scope="module")
def reference():
    return {lb: train(tiny_args(load_balance=lb)) for lb in ("aux_loss", "expert_bias")}


@pytest.mark.parametrize("load_balance", ["aux_loss", "expert_bias"])
@pytest.mark.parametrize("mode, scan, ac", [("eager", True, "none"), ("eager", False, "full"),
                                            ("eager", True, "selective"), ("aot_eager", False, "none"),
                                            ("aot_eager", True, "none"), ("aot_eager", True, "full"),
                                            ("aot_eager", False, "selective")])
def test_moe_variants_train_like_the_unrolled_eager_model(reference, load_balance, mode, scan, ac):
    want, want_biases = reference[load_balance]
    got, got_biases = train(tiny_args(load_balance=load_balance), mode=mode, scan=scan, ac=ac)
    for (loss, aux), (w_loss, w_aux) in zip(losses(got), losses(want)):
        assert abs(loss - w_loss) <= 1e-5 and abs(aux - w_aux) <= 1e-6
    for a, b in zip(got, want):
        assert torch.equal(a.expert_load, b.expert_load)  # the same routing, step by step
    stacked = torch.cat([b.reshape(-1) for b in got_biases.values()]) if got_biases else torch.zeros(0)
    unrolled = torch.cat([b.reshape(-1) for b in want_biases.values()]) if want_biases else torch.zeros(0)
    torch.testing.assert_close(stacked, unrolled, rtol=0, atol=1e-6)


def test_balancing_does_its_job():
    aux_results, _ = train(tiny_args(load_balance="aux_loss", aux_loss_coef=0.0))
    assert all(r.aux_loss == 0.0 for r in aux_results)  # coefficient 0: the loss term is gone
    # Auxiliary-loss-free: after one step each layer's bias is rate * sign(mean load - load).
    results, biases = train(tiny_args(load_balance="expert_bias", bias_update_rate=0.01), steps=1)
    assert results[0].aux_loss == 0.0
    load_LE = results[0].expert_load
    want = 0.01 * torch.sign(load_LE.mean(dim=1, keepdim=True) - load_LE)
    assert want.abs().sum() > 0  # the random model does route unevenly
    torch.testing.assert_close(torch.stack(list(biases.values())), want, rtol=0, atol=0)


def test_kernel_choice_gives_the_same_training():
    want, _ = train(tiny_args(), kernels=KernelConfig(grouped_mm="reference"))
    got, _ = train(tiny_args(), kernels=KernelConfig(grouped_mm="torch"))
    assert max(abs(a.loss - b.loss) for a, b in zip(got, want)) <= 1e-5


# ---------------------------------------------------------------------------------------------
# FLOPs, flavors, bad input
# ---------------------------------------------------------------------------------------------


def test_flavors_have_the_published_sizes_and_active_flops():
    a3b = get_model_args("qwen3_moe", "30b_a3b")
    assert round(num_params(a3b) / 1e9, 1) == 30.5 and round(num_active_params(a3b) / 1e9, 1) == 3.4
    a22b = get_model_args("qwen3_moe", "235b_a22b")
    assert round(num_params(a22b) / 1e9) == 235 and round(num_active_params(a22b) / 1e9) == 22
    # Active FLOPs: 6 x (active non-embedding parameters) + attention.
    n_active = num_active_params(a3b, exclude_embedding=True)
    assert flops_per_token(a3b, 4096) == 6 * n_active + 6 * 48 * 32 * 128 * 4096


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_debug_flavor_trains_its_loss_down(family):
    args = dataclasses.replace(get_model_args(family, "debug"), max_seq_len=64)
    model = build_model(args, seed=0)
    step = EagerStep(model, AdamW(dict(model.named_parameters())), max_norm=1.0)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 2048, (20, 8, 1), generator=g)
    seqs = (starts + 3 * torch.arange(33)) % 2048  # a learnable rule
    results = [step([(s[:, :-1], s[:, 1:])], 3e-3) for s in seqs]
    assert results[-1].loss < results[0].loss - 1.0


@pytest.mark.parametrize("change, match", [
    (dict(top_k=5), r"moe.top_k \(5\) must be <= moe.num_experts \(4\)"),
    (dict(load_balance="switch"), "moe.load_balance must be one of aux_loss, expert_bias, none"),
    (dict(num_experts=0), "moe.num_experts must be a positive integer"),
])
def test_bad_moe_args_are_one_line_errors(change, match):
    with pytest.raises(ValueError, match=match) as err:
        tiny_args(**change)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_dense_layers_between_moe_layers_scan_as_runs(mode):
    """mlp_only_layers (1,) of 3 layers: MoE, dense, MoE scanned as three stacks, training like the
    unrolled model (routing, losses, balancing biases in layer order)."""
    args = dataclasses.replace(tiny_args(load_balance="expert_bias", mlp_only_layers=(1,)), n_layers=3)
    assert [n for n, _ in build_model(args, scan_layers=True).stacks()] == [f"layers.run{j}" for j in range(3)]
    want, want_biases = train(args)
    got, got_biases = train(args, mode=mode, scan=True, ac="full")
    for (loss, aux), (w_loss, w_aux) in zip(losses(got), losses(want)):
        assert abs(loss - w_loss) <= 1e-5 and abs(aux - w_aux) <= 1e-6
    for a, b in zip(got, want):
        assert torch.equal(a.expert_load, b.expert_load)
    assert list(got_biases) == ["layers.run0.moe.expert_bias", "layers.run2.moe.expert_bias"]
    torch.testing.assert_close(torch.cat([b.reshape(-1) for b in got_biases.values()]),
                               torch.cat([b.reshape(-1) for b in want_biases.values()]), rtol=0, atol=1e-6)


def test_grouped_mm_unavailable_here_is_one_line():
    with pytest.raises(ValueError, match="kernels.grouped_mm = ragged_dot cannot run here"):
        KernelConfig(grouped_mm="ragged_dot").check_device("cpu", documents=False)


def test_mean_cross_entropy_from_model_matches_logits():
    args = tiny_args()
    model = build_model(args, seed=0)
    tokens = tokens_for(args)
    with torch.no_grad():
        out = model(tokens[:, :-1], tokens[:, 1:])
        logits = model(tokens[:, :-1])
    want = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(out.ce_sum, want, rtol=1e-6, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Through the trainer: metrics, checkpoints with the expert bias, bitwise resume
# ---------------------------------------------------------------------------------------------


def test_trainer_logs_expert_load_and_resumes_bitwise_with_the_expert_bias(tmp_path, train_overrides, capsys):
    from pathlib import Path

    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble
    from titan_tpu.train.checkpoint import load_full_state_dict

    recipe = Path(__file__).resolve().parent.parent / "configs" / "qwen3_moe_debug.toml"
    common = dict(training__deterministic="true", validation__enabled="false", training__steps=12,
                  checkpoint__interval=6, model__moe_load_balance="expert_bias",
                  lr_scheduler__decay_ratio=0.0)  # a constant rate: 6 + 6 steps take the steps of 12
    # A warning threshold every uneven layer passes: the routing warning's path through the loop.
    straight = train_overrides(output_dir=str(tmp_path / "straight"), metrics__expert_load_warning=1.0, **common)
    assemble(build_config(recipe, straight)).train()
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["expert_load_max"] >= 1.0 >= r["expert_load_min"] >= 0.0 for r in rows)
    # Routing at a glance (loops/routing.py): per layer (blocks 0-3, all MoE), and the heat map's loads.
    for r in rows:
        assert list(r["expert_load"]) == ["layer0", "layer1", "layer2", "layer3"]
        for block, relative in enumerate(r["expert_load"].values()):
            assert len(relative) == 8 and sum(relative) == pytest.approx(8.0, abs=0.01)
            assert r[f"moe/layer{block}/load_max"] == pytest.approx(max(relative), abs=5e-4)
            assert r[f"moe/layer{block}/dead"] == relative.count(0.0)
            assert 1 / 8 <= r[f"moe/layer{block}/top_share"] <= 1 / 2  # top-2 of 8 experts
    assert max(r["expert_load_max"] for r in rows) == max(r[f"moe/layer{b}/load_max"] for r in rows for b in range(4))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == len(rows) and not [line for line in lines if "moe/" in line or "layer" in line]
    warned = re.findall(r"^warning: step (\d+): MoE layer (\d+) .*raise model.moe_bias_update_rate \(now 0.001\)",
                        out, re.MULTILINE)
    # Warned where a layer's load_max first passed 1.0, and again only after a row at or below it.
    expected, above = [], set()
    for r in rows:
        for block in range(4):
            if r[f"moe/layer{block}/load_max"] <= 1.0:
                above.discard(block)
            elif block not in above:
                above.add(block)
                expected.append((str(r["step"]), str(block)))
    assert warned == expected and len(expected) >= 4  # each layer at least once
    saved = load_full_state_dict(tmp_path / "straight" / "checkpoints" / "step-00000012")
    bias = saved["layers.0.moe.expert_bias"]
    assert bias.shape == (8,) and bias.abs().sum() > 0  # moved, and kept in the checkpoint

    # The same run in two halves: stop at 6, resume to 12; every loss bitwise equal.
    halves = train_overrides(output_dir=str(tmp_path / "halves"), **common)
    assemble(build_config(recipe, halves + ["--training.steps", "6"])).train()
    assemble(build_config(recipe, halves)).train()
    got = {json.loads(line)["step"]: json.loads(line)["loss"]
           for line in (tmp_path / "halves" / "metrics.jsonl").read_text().splitlines()}
    assert got == {r["step"]: r["loss"] for r in rows}
    resumed = load_full_state_dict(tmp_path / "halves" / "checkpoints" / "step-00000012")
    assert torch.equal(resumed["layers.0.moe.expert_bias"], bias)


# ---------------------------------------------------------------------------------------------
# Several ranks: fully_shard (SimpleFSDP shards the experts like any weight) and expert parallelism
# ---------------------------------------------------------------------------------------------


# 10 steps, as test_deepseek_v3.py's parallel runs: a rank layout that routes or reduces differently
# shows in the first step's loss, loads or biases; the spawns' time is mostly capture, the rest steps.
PARALLEL_STEPS = 10


def _expert_parallel_worker(mode: str, scan: bool, ep: int, load_balance: str, dispatch: str = "all_gather") -> dict:
    import torch.distributed as dist

    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.parallel.expert_parallel import make_dispatch
    from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
    from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init

    args = tiny_args(load_balance=load_balance)
    world = dist.get_world_size()
    dims = ParallelDims(dp_shard=world, world_size=world, ep=ep)
    mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    rank, size = dp_rank_and_size(mesh)
    with torch.device("meta"):
        model = Transformer(args, scan_layers=scan)
    model = materialize_and_init(model, mesh, mode="fully_shard", mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=0, expert_mesh=expert_mesh)
    if expert_mesh is not None:
        model.expert_dispatch.dispatch = make_dispatch(expert_mesh, dispatch)
    local_experts = model.layers["0"].moe.experts.w1.shape[0] if not scan else model.layers.moe.experts.w1.shape[1]
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, args.vocab_size, (4, 33), generator=g) for _ in range(PARALLEL_STEPS)]
    rows = 4 // size
    batches = [(t[rank * rows:(rank + 1) * rows, :-1].contiguous(), t[rank * rows:(rank + 1) * rows, 1:].contiguous())
               for t in data]
    if mode == "eager":
        step = EagerStep(model, opt, max_norm=1.0, dp_size=size)
    else:
        from titan_tpu.graph import GraphStep

        step = GraphStep(model, opt, max_norm=1.0, example_batch=batches[0], backend=mode, dp_size=size)
    results = [step([b], 2e-3) for b in batches]
    biases = {n: b.clone() for n, b in model.named_buffers() if "expert_bias" in n}
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in model.state_dict().items()}
    ep_collectives = {}
    if mode != "eager" and expert_mesh is not None:
        ep_group = expert_mesh.get_group("ep").group_name
        for module in step.captured.graph_module.modules():  # scan bodies are submodules
            for node in module.graph.nodes:
                target = str(node.target)
                if target.startswith("_c10d_functional.") and ep_group in [str(a) for a in node.args]:
                    op = target.split(".")[1]
                    ep_collectives[op] = ep_collectives.get(op, 0) + 1
    return {"losses": losses(results), "loads": [r.expert_load for r in results], "biases": biases,
            "state": full, "local_experts": local_experts, "ep_collectives": ep_collectives}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, ep, mode, scan, load_balance", [
    (2, 1, "eager", False, "aux_loss"),
    (2, 1, "aot_eager", True, "expert_bias"),
    (2, 2, "eager", False, "aux_loss"),
    (2, 2, "aot_eager", True, "expert_bias"),
    (4, 2, "eager", True, "aux_loss"),
    (4, 2, "aot_eager", False, "aux_loss"),
])
def test_several_ranks_train_like_one_process(world, ep, mode, scan, load_balance):
    """With ep > 1 each rank holds E / ep experts and tokens travel by all-gather and
    reduce-scatter. Each rank computes the balancing loss on its own rows and the ranks average it
    (as TorchTitan does), so the run equals one process taking the world's rows as `world`
    micro-batches."""
    from dist_utils import run_distributed

    want, want_biases = parallel_reference(load_balance, world)
    reference_model = build_model(tiny_args(load_balance=load_balance), seed=0)
    if (world, ep) == (2, 2):  # these runs are also the all-gather side of the all-to-all test: one spawn
        results = [rank_results[EP2_CASES.index((mode, scan, ep, load_balance, "all_gather"))]
                   for rank_results in ep2_runs()]
    else:
        results = run_distributed(_expert_parallel_worker, world_size=world, args=(mode, scan, ep, load_balance),
                                  timeout_s=400)
    for result in results:
        assert result["local_experts"] == 4 // ep
        for (loss, aux), (w_loss, w_aux) in zip(result["losses"], losses(want)):
            assert abs(loss - w_loss) <= 1e-5 and abs(aux - w_aux) <= 1e-5
        for load, w in zip(result["loads"], want):
            assert torch.equal(load, w.expert_load)
        got = torch.cat([b.reshape(-1) for b in result["biases"].values()]) if result["biases"] else torch.zeros(0)
        ref = torch.cat([b.reshape(-1) for b in want_biases.values()]) if want_biases else torch.zeros(0)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert set(results[0]["state"]) == set(reference_model.state_dict())  # per-layer names, full experts
    if mode != "eager" and 1 < ep < world:  # (with ep == world the ep group is SimpleFSDP's group too)
        # On the ep group, per MoE layer (once per scan body when scanned): the forward all-gathers
        # tokens, choices and weights and reduce-scatters outputs; the backward mirrors the two
        # differentiable ones (reduce-scatter x 2) and the combine (all-gather). Plus one all-reduce:
        # the experts' share of the gradient norm, summed over the ep axis.
        layers = 1 if scan else tiny_args().num_moe_layers
        expected = {"all_gather_into_tensor": 4 * layers, "reduce_scatter_tensor": 3 * layers, "all_reduce": 1}
        assert results[0]["ep_collectives"] == expected, results[0]["ep_collectives"]


@pytest.mark.multiprocess
def test_expert_parallel_checkpoint_resumes_on_one_process(tmp_path, data_cache):
    """2 ranks with --parallelism.ep 2 (forked: test_train_dist runs torchrun): each rank saves its
    own experts; one process resumes from that checkpoint (resharded to whole experts) and goes on."""
    from test_train_dist import losses as run_losses, overrides, train as run_train, train_forked

    from titan_tpu.train.checkpoint import load_full_state_dict

    run = tmp_path / "run"
    args = dict(model__name="qwen3_moe", checkpoint__interval=3)  # the debug flavor of qwen3_moe
    first = train_forked(2, overrides(run, data_cache, training__steps=6, training__batch_size=2,
                                      parallelism__ep=2, **args))
    assert "expert parallel: 2" in first
    saved = load_full_state_dict(run / "checkpoints" / "step-00000006")
    assert saved["layers.0.moe.experts.w1"].shape == (8, 128, 256)  # whole, gathered from both ranks
    done = run_train(1, overrides(run, data_cache, training__batch_size=4, **args))
    assert "resumed from" in done.stdout and "step-00000006" in done.stdout
    assert sorted(run_losses(run)) == list(range(1, 11))  # test_train_dist.overrides: 10 steps


def _several_cases_worker(cases: list[tuple]) -> list[dict]:
    """One spawn for several runs (starting ranks costs more than a tiny model's 20 steps)."""
    return [_expert_parallel_worker(*case) for case in cases]


@functools.cache
def parallel_reference(load_balance: str, micro_batches: int):
    """One process taking the world's rows as micro-batches: shared by every test comparing with it."""
    return train(tiny_args(load_balance=load_balance), micro_batches=micro_batches, steps=PARALLEL_STEPS)


A2A_CASES = [("eager", False, 2, "aux_loss"), ("eager", False, 2, "expert_bias"),
             ("aot_eager", True, 2, "expert_bias"), ("aot_eager", False, 2, "aux_loss")]
COMPARED_WITH_ALL_GATHER = (0, 2)  # an eager and a captured case (more would only add spawn time)
# Every 2-rank ep 2 run, in one spawn: the all-to-all cases, then the all-gather ones (those
# test_several_ranks_train_like_one_process checks against one process and this test against all-to-all).
EP2_CASES = [case + ("all_to_all",) for case in A2A_CASES] + \
    [A2A_CASES[i] + ("all_gather",) for i in COMPARED_WITH_ALL_GATHER]


@functools.cache
def ep2_runs() -> list[list[dict]]:
    from dist_utils import run_distributed

    return run_distributed(_several_cases_worker, world_size=2, args=(EP2_CASES,), timeout_s=900)


@pytest.mark.multiprocess
def test_all_to_all_dispatch_trains_like_one_process_and_like_all_gather():
    """--parallelism.ep_dispatch all_to_all (each token only to the ranks of its experts; exact
    split sizes in eager mode, a static worst-case buffer when captured) on 2 ranks with ep 2
    equals one process with 2 micro-batches, and the all-gather dispatch, step by step."""
    results = ep2_runs()
    for i, (mode, scan, ep, load_balance) in enumerate(A2A_CASES):
        want, want_biases = parallel_reference(load_balance, 2)
        for rank_results in results:
            a2a = rank_results[i]
            for (loss, aux), (w_loss, w_aux) in zip(a2a["losses"], losses(want)):
                assert abs(loss - w_loss) <= 1e-5 and abs(aux - w_aux) <= 1e-5, (mode, scan, load_balance)
            for load, w in zip(a2a["loads"], want):
                assert torch.equal(load, w.expert_load)
            got = torch.cat([b.reshape(-1) for b in a2a["biases"].values()]) if a2a["biases"] else torch.zeros(0)
            ref = torch.cat([b.reshape(-1) for b in want_biases.values()]) if want_biases else torch.zeros(0)
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
            if i in COMPARED_WITH_ALL_GATHER:
                gathered = rank_results[len(A2A_CASES) + COMPARED_WITH_ALL_GATHER.index(i)]
                for (loss, aux), (g_loss, g_aux) in zip(a2a["losses"], gathered["losses"]):
                    assert abs(loss - g_loss) <= 1e-6 and abs(aux - g_aux) <= 1e-6, (mode, scan, load_balance)
                for name, value in a2a["state"].items():
                    torch.testing.assert_close(value, gathered["state"][name], rtol=0, atol=1e-6)
            if mode != "eager":  # captured: the tokens travel by all-to-all, no all-gather of them
                assert a2a["ep_collectives"].get("all_to_all_single", 0) > 0


@pytest.mark.parametrize("num_experts, top_k, ep", [(8, 2, 2), (16, 4, 4), (128, 8, 8)])
def test_planner_counts_the_all_to_all_rows_that_random_routing_sends(num_experts, top_k, ep):
    """The planner's all-to-all count (each token once to each other rank holding one of its
    experts) against routings drawn at random: the same rule counted on real choices."""
    from titan_tpu.parallel.plan_terms import ep_dispatch_bytes

    T, dim, cb = 20000, 64, 4
    g = torch.Generator().manual_seed(0)
    chosen_TK = torch.rand(T, num_experts, generator=g).topk(top_k, dim=-1).indices
    needed_TR = torch.zeros(T, ep, dtype=torch.int64).scatter(1, chosen_TK // (num_experts // ep), 1)
    rank = 0  # every rank alike: the rows rank 0's tokens send to the other ranks
    copies = needed_TR.sum().item() - needed_TR[:, rank].sum().item()
    row = 2 * dim * cb + top_k * (8 + cb)
    planned = ep_dispatch_bytes("all_to_all", tokens=T, dim=dim, top_k=top_k, num_experts=num_experts, ep=ep,
                                compute_bytes=cb)
    assert abs(planned - (copies * row + ep * 8)) / planned < 0.02
    gathered = ep_dispatch_bytes("all_gather", tokens=T, dim=dim, top_k=top_k, num_experts=num_experts, ep=ep,
                                 compute_bytes=cb)
    assert gathered == T * (ep - 1) * row and planned < gathered
    padded = ep_dispatch_bytes("all_to_all", tokens=T, dim=dim, top_k=top_k, num_experts=num_experts, ep=ep,
                               compute_bytes=cb, padded=True)
    assert padded == gathered + ep * 8  # the static buffer sends what the all-gather does


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
    """torch.tpu.ops.ragged_all_to_all's contract (XLA's RaggedAllToAll) with gloo: rank s sends
    operand[input_offsets[r]:+send_sizes[r]] to rank r, which writes it at output_offsets[r] (an
    offset in r's output, chosen by the sender); recv_sizes[s]: rows r gets from s."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    send, recv = send_sizes.tolist(), recv_sizes.tolist()
    rows = torch.cat([operand[o:o + n] for o, n in zip(input_offsets.tolist(), send)])
    got = rows.new_empty((sum(recv),) + tuple(operand.shape[1:]))
    dist.all_to_all_single(got, rows.contiguous(), recv, send, group=group)
    where = torch.empty_like(output_offsets)
    dist.all_to_all_single(where, output_offsets.contiguous(), group=group)  # where my rows from each s go
    output = output.clone()
    for chunk, offset, n in zip(got.split(recv), where.tolist(), recv):
        output[offset:offset + n] = chunk
    return output


def _ragged_path_worker() -> dict:
    """One MoE layer (this rank's 2 of 4 experts), forward + backward, through the exact
    all-to-all and through the TPU path with ragged_all_to_all emulated."""
    import types

    import torch.distributed as dist

    from titan_tpu.models.common.moe import MoE, MoEArgs
    from titan_tpu.parallel.expert_parallel import AllToAllDispatch, build_expert_mesh

    torch.tpu = types.SimpleNamespace(ops=types.SimpleNamespace(ragged_all_to_all=_emulated_ragged_all_to_all))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = MoE(dim=16, args=MoEArgs(num_experts=4, top_k=2, hidden_dim=8, load_balance="none"))
    layer.init_weights(std=0.2, depth_std=0.2)
    for name in ("w1", "w2", "w3"):
        w = getattr(layer.experts, name)
        setattr(layer.experts, name, torch.nn.Parameter(w.detach()[2 * rank:2 * rank + 2].clone()))
    mesh = build_expert_mesh("cpu", dp_shard=2, ep=2)
    x_BSD = torch.randn(1, 24, 16, generator=torch.Generator().manual_seed(1 + rank))
    out = {}
    for ragged in (False, True):
        layer.dispatch_slot.dispatch = AllToAllDispatch(mesh, ragged=ragged)
        x = x_BSD.clone().requires_grad_()
        y, _ = layer(x)
        y.square().sum().backward()
        out[ragged] = (y.detach(), x.grad, layer.experts.w1.grad.clone())
        layer.zero_grad()
    return out


@pytest.mark.multiprocess
def test_the_tpu_ragged_path_matches_the_exact_all_to_all_with_the_op_emulated():
    """The TPU path's packing, offsets and gradient routing, run against an emulation of
    ragged_all_to_all (the op itself needs a TPU): same outputs and gradients as the exact path."""
    from dist_utils import run_distributed

    for result in run_distributed(_ragged_path_worker, world_size=2, timeout_s=300):
        for exact, ragged in zip(result[False], result[True]):
            torch.testing.assert_close(ragged, exact, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_expert_parallel_captures_with_scanned_layers_and_full_checkpointing(dispatch):
    """Scanned layers with full activation checkpointing recompute each layer under torch.func.vjp
    in the backward (models/common/scan.py), so the MoE dispatch's collectives must be autograd
    Functions torch.func accepts; torch's `*_autograd` functional collectives (torch 2.13) are not
    ("must override the setup_context staticmethod": every ep recipe of the TPU, which all scan
    with full checkpointing, failed to capture). Rank 0 of 2 under a fake process group, which
    traces the collectives as a real group does (components/world.py)."""
    import torch.fx

    from titan_tpu.components.program import capture_rank
    from titan_tpu.config import build_config
    from titan_tpu.run.resolved import Target

    cfg = build_config("configs/qwen3_moe_debug.toml", [
        "--model.dtype=float32", "--model.scan_layers=true", "--activation_checkpoint.mode=full",
        "--parallelism.dp_shard=2", "--parallelism.ep=2", f"--parallelism.ep_dispatch={dispatch}",
        "--training.batch_size=1", "--training.seq_len=16"])
    _, steps, _ = capture_rank(cfg, Target.for_jax("cpu", 2))
    step = steps["step"]
    ops = {str(node.target) for module in step.captured.graph_module.modules()
           if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes}
    assert ("_c10d_functional.all_to_all_single.default" in ops) == (dispatch == "all_to_all")
    assert "scan" in ops  # torch.ops.higher_order.scan


def test_moe_args_with_every_layer_dense_train_like_the_dense_model():
    """An HF config may list every layer as dense (mlp_only_layers, first_k_dense_replace >= layers):
    no MoE statistics at all, and the same losses as the same model without MoE args."""
    import dataclasses

    args = tiny_args(mlp_only_layers=(0, 1), load_balance="aux_loss")
    got, _ = train(args, steps=3)
    want, _ = train(dataclasses.replace(args, moe=None), steps=3)
    assert [r.loss for r in got] == [r.loss for r in want]
