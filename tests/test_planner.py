"""The planner (titan_tpu/plan): its terms against the code they describe.

FLOPs are the trainer's own count; parameter counts are the real model's (built on meta);
activation and loss terms are autograd's saved tensors of real forwards; bad input is one line.
The end-to-end check (predicted vs measured peak memory and tokens/s of real runs) is
`titan-tpu plan --calibrate` (docs/planner.md): it times things, so it is not a test."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from parallel_helpers import kept_saved_bytes

from titan_tpu.cli import main
from titan_tpu.config import build_config
from titan_tpu.kernels import KernelConfig
from titan_tpu.kernels.loss import loss_memory_bytes
from titan_tpu.models.common.activation_memory import activation_bytes
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import (
    MODEL_FLAVORS,
    build_model,
    get_model_args,
    num_expert_params,
    recomputed_flops_per_token,
)
from titan_tpu.models.spec import model_spec
from titan_tpu.plan import plan_config, resolve_hardware
from titan_tpu.plan.setting import for_planning

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CPU = resolve_hardware("cpu", measure=False)[0]
RECIPES = ("qwen3_8b_graph_tpu", "llama3_405b_tpu", "qwen3_235b_a22b_tpu")


@pytest.mark.parametrize("recipe,overrides", [
    ("llama3_debug", []), ("qwen3_debug", ["--training.seq_len", "1024"]), ("qwen3_moe_debug", []),
    ("qwen3_0.6b_cpu", []), ("llama3_405b_tpu", []), ("qwen3_235b_a22b_tpu", []),
])
def test_flops_are_the_trainers(recipe, overrides):
    cfg = for_planning(CONFIGS / f"{recipe}.toml", overrides)
    plan = plan_config(cfg, CPU if "cpu" in recipe or "debug" in recipe else None, measure=False)
    # The trainer's MFU numerator: trainer.py asks the model spec with these arguments (native
    # models count from their args, not the built model).
    want, _ = model_spec(cfg.model).flops_per_token(None, cfg.training.seq_len)
    assert plan.flops["per_token"] == want
    t = cfg.training
    assert plan.flops["model_per_step_per_device"] == want * t.batch_size * t.seq_len * t.grad_accum_steps


@pytest.mark.parametrize("name,flavor", [(n, f) for n, flavors in MODEL_FLAVORS.items() for f in flavors])
def test_parameter_counts_are_the_models(name, flavor):
    args = get_model_args(name, flavor)
    with torch.device("meta"):
        model = Transformer(args)
    numel = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    cfg = build_config(None, ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", "128"])
    plan = plan_config(cfg, CPU, measure=False)
    assert plan.params["total"] == numel
    assert num_expert_params(args) == experts


def _saved_bytes(model, tokens_BS) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of model(tokens, labels)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return kept_saved_bytes(lambda: model(tokens_BS, tokens_BS), own)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_activation_terms_match_autograd(name, ac_mode):
    # Per layer: the difference between a 2-layer and a 1-layer model; the rest: the head and the
    # materialised loss. (Selective mode keeps its tensors inside torch.utils.checkpoint, out of
    # the hooks' sight; the calibration runs check it.)
    B, S = 2, 64
    sizes = {}
    for n_layers in (1, 2):
        args = dataclasses.replace(get_model_args(name, "debug"), n_layers=n_layers)
        torch.manual_seed(0)
        model = build_model(args, seed=0, ac_mode=ac_mode, kernels=KernelConfig(loss="reference"))
        sizes[n_layers] = _saved_bytes(model, torch.randint(0, args.vocab_size, (B, S)))
    args = get_model_args(name, "debug")
    predicted = activation_bytes(args, tokens=B * S, ac_mode=ac_mode, dtype_bytes=4)
    kept, _ = loss_memory_bytes("reference", tokens=B * S, vocab_size=args.vocab_size, dim=args.dim, dtype_bytes=4)
    per_layer = sizes[2] - sizes[1]
    # Not counted: tensors of a fixed size, not per token (the MoE per-expert counts, [E] int64;
    # a 0-dim scalar of the loss).
    assert 0 <= per_layer - predicted.saved_per_layer[0] <= (64 if name == "qwen3_moe" else 0)
    assert 0 <= (sizes[1] - per_layer) - (predicted.head + kept) <= 128  # MoE: the aux loss's statistics


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("ac_mode", ["none", "selective"])
def test_scan_autograd_terms_match_the_captured_graph(name, ac_mode):
    """Scanned layers in graph mode without full checkpointing: scan's own autograd. The forward
    scan returns what its backward needs, stacked per layer (activations by the modules'
    partitioned counts, RoPE's values; no weight copies: the linears' backward reads the stack's
    slice), the backward scan reads flipped copies of those and of the stacked weights, and writes
    the stacked weight gradients: each equal, byte for byte, to the planner's terms
    (models/common/scan.py scan_autograd_memory)."""
    from titan_tpu.graph.capture import capture_train_step
    from titan_tpu.parallel.plan_terms import Layout
    from titan_tpu.plan.memory import scanned_autograd_memory
    from titan_tpu.train.optim import AdamW

    B, S = 2, 64
    args = dataclasses.replace(get_model_args(name, "debug"), n_layers=2, max_seq_len=S)
    model = build_model(args, seed=0, scan_layers=True, ac_mode=ac_mode)
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    example = torch.zeros(B, S, dtype=torch.long)
    captured = capture_train_step(model, max_norm=1.0, adamw_hparams=opt.hparams, decay=opt.decay,
                                  example_batch=(example, example))
    forward, backward = [n for n in captured.graph_module.graph.nodes
                         if n.op == "call_function" and n.target is torch.ops.higher_order.scan]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    outputs = forward.meta["val"]
    saved = nbytes(outputs[2:])  # after the final h and the blocks' statistics (no kept inputs without full AC)
    flipped = nbytes(x.meta["val"] for x in backward.args[2])  # the backward's xs
    gradients = nbytes(backward.meta["val"][2:])  # after the gradients of h and of the RoPE rows
    assert all(x.target is torch.ops.aten.flip.default for x in backward.args[2])

    acts = activation_bytes(args, tokens=B * S, ac_mode=ac_mode, dtype_bytes=4, partitioned=True)
    want = scanned_autograd_memory(args, layout=Layout(), acts=acts, seq_len=S, gradient_stack=True)
    assert (saved, flipped, gradients) == (want.saved, want.flipped, want.gradients)
    assert want.weight_copies == 0  # a copy of every layer's weights per step before _LinearSavingItsWeight
    # The captured graph (what every backend receives) flips; under Inductor graph/reverse_scan.py
    # removes every flip (tests/test_reverse_scan.py), and the planner counts none there.
    flips = {backend: plan_config(build_config(CONFIGS / f"{name}_debug.toml", [
        "--model.scan_layers", "true", "--training.mode", "graph", "--activation_checkpoint.mode", ac_mode,
        "--compile.backend", backend]), CPU, measure=False).memory["scan_flipped"] for backend in ("inductor", "eager")}
    assert flips["inductor"] == 0 < flips["eager"]
    # Not the eager count: the partitioner keeps other values than autograd does layer by layer.
    eager = activation_bytes(args, tokens=B * S, ac_mode="none", dtype_bytes=4)
    assert want.activations != eager.saved


def _forward_scan_saved(name: str, n_layers: int = 2) -> tuple[list[torch.Tensor], object]:
    """The per-layer values the forward scan of a captured scanned step saves for its backward
    (after the final h and the blocks' statistics; no kept inputs without full AC), and the model args."""
    from titan_tpu.graph.capture import capture_train_step
    from titan_tpu.train.optim import AdamW

    B, S = 2, 64
    args = dataclasses.replace(get_model_args(name, "debug"), n_layers=n_layers, max_seq_len=S)
    model = build_model(args, seed=0, scan_layers=True)
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    example = torch.zeros(B, S, dtype=torch.long)
    captured = capture_train_step(model, max_norm=1.0, adamw_hparams=opt.hparams, decay=opt.decay,
                                  example_batch=(example, example))
    forward = next(n for n in captured.graph_module.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.higher_order.scan)
    return list(forward.meta["val"][2:]), args


def test_scanned_moe_saves_no_copy_of_the_expert_weights(monkeypatch):
    """kernels/grouped_mm.py `with_linear_layout`: the experts' grouped matmuls read the stored
    weights in the backward, so the forward scan saves no [L, E, ...] copy of them (it saved a
    transposed copy of each of w1, w2, w3 before). The difference is the planner's expert term."""
    from titan_tpu.models.common import moe
    from titan_tpu.parallel.plan_terms import Layout
    from titan_tpu.plan.memory import scanned_autograd_memory

    def expert_copies(saved, args):
        E, D, F = args.moe.num_experts, args.dim, args.moe.hidden_dim
        return [t for t in saved if tuple(t.shape[1:]) in ((E, F, D), (E, D, F))]

    saved, args = _forward_scan_saved("qwen3_moe")
    assert expert_copies(saved, args) == []
    # Without it (the transposed view, as every other kernel gets): one copy per expert weight.
    monkeypatch.setattr(moe, "with_linear_layout",
                        lambda fn: lambda x, w, sizes: fn(x, w.transpose(1, 2), sizes))
    saved_before, _ = _forward_scan_saved("qwen3_moe")
    assert len(expert_copies(saved_before, args)) == 3
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    acts = activation_bytes(args, tokens=2 * 64, ac_mode="none", dtype_bytes=4, partitioned=True)
    terms = {copied: scanned_autograd_memory(args, layout=Layout(), acts=acts, seq_len=64, gradient_stack=True,
                                             experts_copied=copied) for copied in (True, False)}
    assert terms[False].weight_copies == 0
    copies = nbytes(expert_copies(saved_before, args))
    assert nbytes(saved_before) - nbytes(saved) == terms[True].weight_copies == copies


def test_chunked_loss_keeps_its_gradients():
    torch.manual_seed(0)
    n, v, d = 300, 512, 32
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    from titan_tpu.kernels.loss import chunked_linear_cross_entropy

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_linear_cross_entropy(h, w, torch.randint(0, v, (n,)), chunk_tokens=128)
    kept, _ = loss_memory_bytes("chunked", tokens=n, vocab_size=v, dim=d, dtype_bytes=4, chunk_tokens=128)
    assert sum(seen.values()) == kept


def _alloc_peak(fn) -> int:
    """Peak bytes allocated by fn() above what was live before it (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for _, delta in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                           if e.self_cpu_memory_usage):
        now += delta
        peak = max(peak, now)
    return peak


def test_update_buffers_are_what_adamw_allocates():
    """The optimizer moment's extra buffers (train/optim.py update_buffers), in parameter sizes:
    the in-place update's temporaries peak at one parameter set; the out-of-place form (traced by
    the graph trainer) returns fresh parameters and moments, three sets that share no storage with
    its inputs, beside the same temporary."""
    from titan_tpu.train.optim import adamw_init, adamw_update, adamw_update_, update_buffers

    gen = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(256, 64 * (i + 1), generator=gen) for i in range(3)}
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    state = adamw_init(params)
    hparams = dict(step=3, lr=1e-3, decay={n: True for n in params})
    one_set = sum(p.numel() * p.element_size() for p in params.values())
    inplace = _alloc_peak(lambda: adamw_update_(params, grads, state, **hparams))
    assert inplace == pytest.approx(update_buffers(out_of_place=False) * one_set, rel=0.01)

    new_params, new_state = adamw_update(params, grads, state, **hparams)
    inputs = {t.untyped_storage().data_ptr() for d in (params, grads, *state.values()) for t in d.values()}
    fresh = [t for d in (new_params, *new_state.values()) for t in d.values()
             if t.untyped_storage().data_ptr() not in inputs]
    fresh_sets = sum(t.numel() * t.element_size() for t in fresh) / one_set
    assert fresh_sets + update_buffers(out_of_place=False) == update_buffers(out_of_place=True)


def test_eager_time_fit_recovers_the_constants_it_was_made_with():
    """calibrate.fit_eager_time: step times built from known efficiencies (matmul 0.7, elementwise
    0.25) over runs with different shares of elementwise work give those efficiencies back."""
    from titan_tpu.plan.calibrate import fit_eager_time

    runs = [(c, e, c / 0.7 + e / 0.25) for c, e in ((0.2, 0.02), (0.3, 0.05), (0.07, 0.03), (1.5, 0.1))]
    efficiency, elementwise = fit_eager_time(runs)
    assert efficiency == pytest.approx(0.7) and elementwise == pytest.approx(0.25)


def _collective_rate_worker() -> dict:
    from titan_tpu.plan.collective_rate import measure_collective_rate

    return measure_collective_rate(reps=3)


@pytest.mark.multiprocess
def test_collective_rate_is_gloos_not_the_copy_rate():
    """The CPU's interconnect (plan/collective_rate.py): the bytes a rank sends over the median
    times of gloo's collectives (as recorded beside it, by kind and size), and far below this
    machine's copy rate (the planner assumed a quarter of it before; measured: a 25th to a 50th)."""
    from dist_utils import run_distributed

    from titan_tpu.plan.hardware import measure_cpu_memory_bandwidth

    result = run_distributed(_collective_rate_worker, world_size=2)[0]
    sizes = result["by_size"]
    assert [(r["kind"], r["mb_per_rank"]) for r in sizes] == [
        ("all_gather", 1.048576), ("reduce_scatter", 1.048576), ("all_gather", 4.194304), ("reduce_scatter", 4.194304)]
    sent = sum(r["mb_per_rank"] * 1e6 for r in sizes)  # two ranks: each sends its whole shard
    assert result["bytes_per_s"] == pytest.approx(sent / sum(r["median_ms"] / 1e3 for r in sizes))
    assert result["bytes_per_s"] < measure_cpu_memory_bandwidth() / 4
    # A 4 KB call's median time: the per-call cost beside the bytes, below a 4 MB call's (a 1 MB
    # call can take as long: at these sizes gloo's time is mostly the synchronisation).
    assert 0 < result["latency_s"] < max(r["median_ms"] for r in sizes) / 1e3


def test_cpu_collectives_take_gloos_rate():
    """The planner's collective time is each collective's bytes at the hardware's interconnect rate,
    which for the CPU is gloo's measured rate, plus each call's latency: expert parallelism's token
    dispatch on two ranks then takes the time its bytes and calls take through gloo."""
    from titan_tpu.plan.hardware import CPU_COLLECTIVE_BANDWIDTH, CPU_COLLECTIVE_LATENCY

    cfg = build_config(CONFIGS / "qwen3_moe_debug.toml", ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"])
    plan = plan_config(cfg, CPU, measure=False)
    assert CPU.interconnect_bandwidth == CPU_COLLECTIVE_BANDWIDTH
    dispatch = [c for c in plan.communication if c["axis"] == "ep"]
    assert len(dispatch) == 1 and dispatch[0]["bytes_per_step"] > 0
    total = sum(c["bytes_per_step"] for c in plan.communication)
    calls = sum(c["calls"] for c in plan.communication)
    assert dispatch[0]["calls"] > 0 and CPU.collective_latency == CPU_COLLECTIVE_LATENCY > 0
    assert plan.time["collectives_s"] == pytest.approx(total / CPU_COLLECTIVE_BANDWIDTH
                                                       + calls * CPU_COLLECTIVE_LATENCY)
    assert plan.time["step_s"] == pytest.approx(plan.time["compute_s"] + plan.time["elementwise_s"]
                                                + plan.time["collectives_s"])  # eager: no overlap


def test_plan_grows_the_right_terms():
    base = plan_config(build_config(CONFIGS / "llama3_debug.toml"), CPU, measure=False)
    full = plan_config(build_config(CONFIGS / "llama3_debug.toml", ["--activation_checkpoint.mode", "full"]), CPU,
                       measure=False)
    assert full.memory["activations"] < base.memory["activations"] / 5
    executed = "executed_per_step_per_device"
    # The blocks' forward again (recomputed_flops_per_token, checked against torch's counter in
    # test_flops.py), not the output projection: less than a third more.
    cfg = build_config(CONFIGS / "llama3_debug.toml")
    tokens = cfg.training.batch_size * cfg.training.seq_len * cfg.training.grad_accum_steps
    args = get_model_args(cfg.model.name, cfg.model.flavor)
    assert full.flops[executed] - base.flops[executed] == pytest.approx(
        recomputed_flops_per_token(args, cfg.training.seq_len) * tokens)
    assert full.flops[executed] < 4 / 3 * base.flops[executed]
    sharded = plan_config(build_config(CONFIGS / "llama3_debug.toml", ["--parallelism.dp_shard", "2"]), CPU,
                          measure=False)
    assert sharded.memory["parameters"] == pytest.approx(base.memory["parameters"] / 2)
    assert sharded.memory["gathered_weights"] > 0 and base.memory["gathered_weights"] == 0
    kinds = {c["kind"] for c in sharded.communication}
    assert kinds == {"all_gather", "reduce_scatter"}


def test_unknown_hardware_lists_the_known(capsys):
    with pytest.raises(ValueError, match="known: v4, v5e, v5p, v6e, v7, h100, h200, b200, cpu"):
        resolve_hardware("v9x")
    assert main(["plan", "--config", str(CONFIGS / "llama3_debug.toml"), "--hardware", "a100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown hardware 'a100'" in err


def test_mesh_that_does_not_match_the_chips_is_one_line(capsys):
    code = main(["plan", "--config", str(CONFIGS / "llama3_debug.toml"), "--hardware", "v5p-16",
                 "--parallelism.dp_shard", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert ("--parallelism.dp_replicate (1) * --parallelism.dp_shard (3) * --parallelism.pp (1) * "
            "--parallelism.cp (1) * --parallelism.tp (1) must equal the world size (8)") in err
    code = main(["plan", "--config", str(CONFIGS / "llama3_debug.toml"), "--hardware", "v6e-6",
                 "--parallelism.dp_replicate", "4"])
    assert code == 2 and "must divide the world size (6)" in capsys.readouterr().err


def test_json_output(capsys):
    assert main(["plan", "--config", str(CONFIGS / "qwen3_235b_a22b_tpu.toml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["devices"] == 512 and plan["mesh"] == {"dp_replicate": 1, "dp_shard": 512, "ep": 8, "tp": 1, "cp": 1,
                                                       "pp": 1, "slices": 1, "mode": "fully_shard", "gather": "layer",
                                                       "code_gather": "layer"}
    assert plan["hardware"]["name"] == "v5p" and plan["hardware"]["source"].startswith("https://")
    for key in ("parameters", "gradients", "optimizer_state", "activations", "gathered_weights", "moe_dispatch"):
        assert plan["memory"][key] >= 0
    assert {c["kind"] for c in plan["communication"]} == {"all_gather", "reduce_scatter", "all_gather+reduce_scatter"}
    assert plan["peak_bytes"] == max(plan["memory"]["phases"].values())
    assert 0 < plan["mfu"] < 100 and plan["tokens_per_s"] > 0


def test_explain_names_every_term(capsys):
    """Every memory term a plan can print has a meaning for --explain (a new term needs one), and a cp
    recipe's batch is said to be split over its cp devices, not held per device."""
    from titan_tpu.plan.text import TERMS

    recipe = str(CONFIGS / "llama3_8b_128k_cp_tpu.toml")
    plan = plan_config(for_planning(recipe))
    assert set(plan.memory) - {"phases"} <= set(TERMS)
    assert main(["plan", "--config", recipe, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "terms (bytes per device):" in out and TERMS["gathered_weights"] in out
    assert "per data-parallel rank (its 8 cp x tp devices each hold 1/8 of every sequence)" in out
    assert main(["plan", "--config", recipe]) == 0
    assert "titan-tpu plan --explain" in capsys.readouterr().out


def test_no_speed_for_eager_mode_on_a_tpu(capsys):
    """Eager mode on a TPU has no measured basis for a step time: the plan says so instead of printing
    one (memory is still planned), --search refuses to rank by it, and graph mode names its assumption."""
    overrides = ["--training.mode", "eager"]
    eager = plan_config(for_planning(CONFIGS / "qwen3_8b_graph_tpu.toml", overrides))
    graph = plan_config(for_planning(CONFIGS / "qwen3_8b_graph_tpu.toml"))
    assert eager.speed_basis is None and eager.tokens_per_s is None and eager.mfu is None
    assert eager.peak_bytes > 0 and "assumption" in graph.speed_basis and graph.tokens_per_s > 0
    assert main(["plan", "--config", str(CONFIGS / "qwen3_8b_graph_tpu.toml"), *overrides]) == 0
    out = capsys.readouterr().out
    assert "predicted: no step time: eager mode on a TPU" in out and "MFU" not in out
    code = main(["plan", "--search", "--config", str(CONFIGS / "qwen3_8b_graph_tpu.toml"), *overrides])
    assert code == 2 and "eager mode on a TPU has no basis" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_fit_once_weights_are_regathered_per_layer(recipe):
    """SimpleFSDP re-shards after the forward (parallel/reshard.py: block weights gathered again
    in the backward, a scanned stack gathered and reduce-scattered per layer) where the memory
    needs it, which the default (auto) picks for these recipes: they fit with the code as it is.
    Keeping every gathered weight from the forward to the backward
    (--parallelism.reshard_after_forward false, or the what-if --gather model), the gathered
    weights are the whole model in bf16 (the blocks, the embedding, the output projection) and
    they do not."""
    cfg = for_planning(CONFIGS / f"{recipe}.toml")
    today = plan_config(cfg)
    assert today.mesh["gather"] == today.mesh["code_gather"] == "layer"
    assert today.fits, today.peak_bytes / 1e9
    args = model_spec(cfg.model).args
    with torch.device("meta"):
        layers = Transformer(args).layers
    experts = sum(p.numel() for n, p in layers.named_parameters() if ".experts." in n)
    block = sum(p.numel() for p in layers.parameters()) - experts + experts / cfg.parallelism.ep
    kept = plan_config(cfg, gather="model")
    head = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    assert kept.memory["gathered_weights"] == (block + head) * 2  # bf16
    assert not kept.fits
    off = plan_config(for_planning(CONFIGS / f"{recipe}.toml", ["--parallelism.reshard_after_forward", "false"]))
    assert off.mesh["code_gather"] == "model" and not off.fits
    assert kept.flops == today.flops
    # The backward's re-gathers are on the bill: one more all-gather of the block weights.
    gathers = [c for c in today.communication if c["kind"] == "all_gather" and c["axis"] == "dp_shard"]
    assert len(gathers) == 2 and gathers[1]["purpose"].startswith("block weights again")


def test_checkpoint_time_and_the_grace_budget(capsys):
    """A checkpoint holds each parameter once and its two AdamW moments, at master precision; the local
    tier is a device's own shards. Llama 3 8B on 64 v5p chips: 96 GB take 96 s at 1 GB/s, so a 30 s
    preemption notice needs the local tier (1.5 GB per chip)."""
    cfg = for_planning(CONFIGS / "llama3_8b_tpu.toml", ["--checkpoint.grace_seconds", "30"])
    plan = plan_config(cfg, measure=False)
    c = plan.checkpoint
    assert c["bytes_total"] == 3 * 4 * plan.params["total"]
    assert c["bytes_per_device"] == pytest.approx(c["bytes_total"] / plan.devices, rel=1e-3)
    assert c["persistent_s"] == pytest.approx(c["bytes_total"] / 1e9)
    assert c["verdict"].startswith("the 30 s grace budget needs the local tier")
    assert main(["plan", "--config", str(CONFIGS / "llama3_8b_tpu.toml"), "--checkpoint.grace_seconds", "30",
                 "--storage-gbps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "to storage; local tier" in out and "the 30 s grace budget holds a full save" in out


def test_only_a_seeded_attention_kernel_is_counted_kept_by_a_traced_checkpointed_block():
    """`Setting.traced`: a traced checkpointed block keeps its attention output only where the op may
    draw random numbers (activation_checkpoint.py `_policy`), as SDPA's CPU op is tagged; auto picks
    splash on a TPU, which is recomputed with its block (XLA's live values of the pipelined recipe)."""
    from titan_tpu.plan.setting import SEEDED_ATTENTION, attention_impl

    sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert torch.Tag.nondeterministic_seeded in sdpa_cpu.tags
    assert attention_impl("auto", "cpu", documents=True) in SEEDED_ATTENTION
    assert attention_impl("auto", "v5p", documents=False) == "splash" not in SEEDED_ATTENTION
