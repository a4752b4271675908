"""DeepSeek-V3: parity with transformers' DeepseekV3ForCausalLM (multi-head latent attention with
and without the low-rank query, YaRN, group-limited sigmoid routing, shared experts, dense first
layers), HF round trips through files, training in eager and graph mode, FLOPs, bad input."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from data_fixtures import write_chat_tokenizer_dir

from titan_tpu.models.common.mla import MLAArgs
from titan_tpu.models.common.moe import MoEArgs
from titan_tpu.models.common.rope import RopeScaling
from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.registry import build_model, flops_per_token, get_model_args, num_active_params, num_params
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

transformers = pytest.importorskip("transformers")

from titan_tpu.models.hub.adapter import from_hf_state_dict, hf_config_from_model_args  # noqa: E402
from titan_tpu.models.hub.checkpoint import load_model_from_hf, save_hf_checkpoint  # noqa: E402

YARN = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                   mscale=0.8, mscale_all_dim=0.6)


def tiny_args(*, q_lora_rank: int = 24, rope_scaling: RopeScaling | None = YARN, **moe) -> TransformerArgs:
    """Every option on: dense layer 0, then MoE layers with 8 experts in 4 groups (top-2 groups,
    top-3 experts), a shared expert, route scale, renormalised weights; MLA with a low-rank query
    (q_lora_rank 0: without), YaRN with both mscales."""
    moe_args = {"num_experts": 8, "top_k": 3, "hidden_dim": 32, "norm_topk_prob": True, "mlp_only_layers": (0,),
                "load_balance": "expert_bias", "score_func": "sigmoid", "n_group": 4, "topk_group": 2,
                "route_scale": 2.5, "num_shared_experts": 1, **moe}
    return TransformerArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_hidden_dim=96,
                           norm_eps=1e-6, rope_theta=10000.0, rope_scaling=rope_scaling, max_seq_len=64,
                           moe=MoEArgs(**moe_args),
                           mla=MLAArgs(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16,
                                       qk_rope_head_dim=8, v_head_dim=12))


def random_hf_model(args: TransformerArgs):
    config = transformers.DeepseekV3Config(**hf_config_from_model_args("deepseek_v3", args))
    config._attn_implementation = "sdpa"
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # strong random weights: a swapped projection or a wrong expert cannot hide
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():  # a non-zero choice bias: it must reach the routing
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


# The MoE tests' tokens, tolerance and short training loop (routing, balancing bias): the same here.
from tests.test_moe import assert_close, tokens_for, train  # noqa: E402


@pytest.mark.parametrize("q_lora_rank", [24, 0])
@pytest.mark.parametrize("rope_scaling", [YARN, None], ids=["yarn", "plain_rope"])
def test_logits_match_transformers_and_round_trip_through_files(q_lora_rank, rope_scaling, tmp_path):
    args = tiny_args(q_lora_rank=q_lora_rank, rope_scaling=rope_scaling)
    hf = random_hf_model(args)
    tokens = tokens_for(args)
    with torch.no_grad():
        want = hf(input_ids=tokens).logits

    # From transformers' in-memory state dict (fused experts).
    model = build_model(args)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    with torch.no_grad():
        assert_close(model(tokens), want)

    # From the directory save_pretrained writes.
    hf.save_pretrained(tmp_path / "saved")
    name, args2, model2 = load_model_from_hf(tmp_path / "saved")
    assert name == "deepseek_v3" and args2.mla == args.mla and args2.rope_scaling == args.rope_scaling
    assert dataclasses.replace(args2.moe, load_balance="expert_bias") == args.moe
    with torch.no_grad():
        assert_close(model2(tokens), want)

    # Export: transformers loads it and computes the same logits; the state dict round trips exactly.
    out_dir = save_hf_checkpoint(tmp_path / "exported", name="deepseek_v3", args=args, state_dict=model.state_dict())
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(out_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert_close(reloaded(input_ids=tokens).logits, want)
    _, _, model3 = load_model_from_hf(out_dir)
    for key, value in model.state_dict().items():
        assert torch.equal(model3.state_dict()[key], value), key


# ---------------------------------------------------------------------------------------------
# Training: eager, graph mode, scanned, activation checkpointing; balancing bias
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return {lb: train(tiny_args(load_balance=lb)) for lb in ("expert_bias", "aux_loss")}


def per_layer_biases(biases: dict[str, torch.Tensor]) -> torch.Tensor:
    """The balancing biases of every MoE layer in layer order, flat (stacked or per layer)."""
    return torch.cat([b.reshape(-1) for b in biases.values()]) if biases else torch.zeros(0)


@pytest.mark.parametrize("load_balance", ["expert_bias", "aux_loss"])
@pytest.mark.parametrize("mode, scan, ac", [("eager", False, "full"), ("eager", False, "selective"),
                                            ("aot_eager", False, "none"), ("aot_eager", False, "full"),
                                            ("eager", True, "none"), ("eager", True, "full"),
                                            ("aot_eager", True, "none"), ("aot_eager", True, "full")])
def test_graph_mode_scan_and_checkpointing_train_like_eager(reference, load_balance, mode, scan, ac):
    """Scanned: the dense first layer and the MoE layers as two scans (models/common/scan.py)."""
    want, want_biases = reference[load_balance]
    got, got_biases = train(tiny_args(load_balance=load_balance), mode=mode, scan=scan, ac=ac)
    for a, b in zip(got, want):
        assert abs(a.loss - b.loss) <= 1e-5 and abs(a.aux_loss - b.aux_loss) <= 1e-6
        assert torch.equal(a.expert_load, b.expert_load)  # the same routing, step by step
    assert len(got_biases) == (1 if scan and load_balance == "expert_bias" else len(want_biases))
    torch.testing.assert_close(per_layer_biases(got_biases), per_layer_biases(want_biases), rtol=0, atol=1e-6)


def test_the_bias_moves_and_the_aux_loss_counts(reference):
    results, biases = reference["expert_bias"]
    assert all(r.aux_loss == 0 for r in results)
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases.values())  # the two MoE layers
    aux_results, _ = reference["aux_loss"]
    assert all(r.aux_loss > 0 for r in aux_results)  # sigmoid scores feed the balancing loss too


def test_scanned_runs_have_the_unrolled_weights_gradients_and_checkpoints():
    """Two stacks (the dense layer 0, the MoE layers 1-2), each initialised, named in state dicts
    and differentiated like the unrolled layers (fp32, 1e-5); checkpoints load across layouts."""
    args = tiny_args()
    unrolled, scanned = build_model(args, seed=0), build_model(args, seed=0, scan_layers=True)
    assert [name for name, _ in scanned.stacks()] == ["layers.run0", "layers.run1"]
    assert scanned.layers.run0.attention.wq_a.weight.shape[0] == 1
    assert scanned.layers.run1.moe.experts.w1.shape[:2] == (2, 8)
    assert scanned.expert_bias_names() == ["layers.run1.moe.expert_bias"]
    want, got = unrolled.state_dict(), scanned.state_dict()
    assert list(got) == list(want)  # the same per-layer names, in the same order
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    tokens = tokens_for(args)
    for model in (unrolled, scanned):
        out = model(tokens[:, :-1], tokens[:, 1:])
        (out.ce_sum + out.aux_loss).backward()
    grads = scanned.to_per_layer({n: p.grad for n, p in scanned.named_parameters()})
    assert grads.keys() == {n for n, _ in unrolled.named_parameters()}
    for name, p in unrolled.named_parameters():
        assert_close(grads[name], p.grad)
    # Checkpoints are interchangeable: per-layer views fill the stacks in place, as DCP loads.
    got["layers.2.moe.experts.w2"].fill_(3.0)
    assert (scanned.layers.run1.moe.experts.w2[1] == 3.0).all()
    unrolled.load_state_dict(scanned.state_dict())
    fresh = build_model(args, seed=1, scan_layers=True)
    fresh.load_state_dict(unrolled.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(tokens), scanned(tokens))
        assert_close(unrolled(tokens), scanned(tokens))  # the scanned body's real-arithmetic RoPE
    # Per-parameter dicts (the optimizer's moments) take the same per-layer names and come back.
    named = dict(scanned.named_parameters())
    back = scanned.from_per_layer(scanned.to_per_layer(named))
    assert back.keys() == named.keys() and all(torch.equal(back[n], t) for n, t in named.items())


def _captured_nodes(n_layers: int) -> tuple[int, int]:
    """(scan ops, nodes in all graphs) of the captured training step of the scanned tiny model."""
    from titan_tpu.graph import GraphStep

    args = dataclasses.replace(tiny_args(), n_layers=n_layers)
    model = build_model(args, seed=0, scan_layers=True, ac_mode="full")
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    tokens = tokens_for(args)
    step = GraphStep(model, opt, max_norm=1.0, example_batch=(tokens[:, :-1], tokens[:, 1:]), backend="aot_eager")
    step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
    graphs = list(step.captured.graph_module.modules())
    scans = sum(str(node.target) == "scan" for g in graphs for node in g.graph.nodes)
    return scans, sum(len(g.graph.nodes) for g in graphs)


def test_scanned_step_graph_does_not_grow_with_depth():
    """One body per stack: 3 and 7 layers (2 and 6 MoE layers) capture the same graphs."""
    few, many = _captured_nodes(3), _captured_nodes(7)
    assert few == many and few[0] == 4, (few, many)  # two stacks: a forward and a backward scan each


def _pipelined_bias_update(n_layers: int):
    """(biases, loads, updated, nodes of the traced update) of the scanned tiny model's MoE stack laid
    out as pipeline stages would (parallel/pipeline.py pipeline_stages): one padding row, the rows in
    a stage-by-stage order (here: the second half of the layers, then the first, then the padding row)."""
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    from titan_tpu.models.common.transformer import Transformer

    args = dataclasses.replace(tiny_args(), n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(args, scan_layers=True)
    (_, dense), (name, stack) = model.stacks()
    layers = list(stack.layer_ids)
    stack.pad_rows(len(layers) + 1)
    half = len(layers) // 2
    stack.row_layers = layers[half:] + layers[:half] + [stack.row_layers[-1]]
    model.pipeline = SimpleNamespace()  # in stages: only its presence is read by the update
    generator = torch.Generator().manual_seed(0)
    biases = {f"{name}.moe.expert_bias": torch.randn(len(layers) + 1, 8, generator=generator)}
    loads = torch.randint(0, 20, (len(layers), 8), generator=generator).float()
    graph = make_fx(lambda b, load: model.updated_expert_biases(b, load))(biases, loads)
    return biases, loads, model.updated_expert_biases(biases, loads), model, len(graph.graph.nodes)


def test_pipelined_expert_bias_update_is_each_layers_and_flat_with_depth():
    """In pipeline stages each stack row moves by its own layer's loads against that layer's mean,
    a padding row not at all, and the update's graph is the same size at any depth."""
    biases, loads, updated, model, nodes = _pipelined_bias_update(5)
    (key, bias_RE), = biases.items()
    stack, rate = model.stacks()[-1][1], model.args.moe.bias_update_rate
    row_of = {layer: i for i, layer in enumerate(stack.layer_ids)}
    for r, layer in enumerate(stack.row_layers):
        if layer in row_of:
            load_E = loads[row_of[layer]]
            torch.testing.assert_close(updated[key][r], bias_RE[r] + rate * torch.sign(load_E.mean() - load_E))
        else:
            torch.testing.assert_close(updated[key][r], bias_RE[r])
    assert _pipelined_bias_update(9)[-1] == nodes


# ---------------------------------------------------------------------------------------------
# Sizes, FLOPs, bad input
# ---------------------------------------------------------------------------------------------


def test_flavors_have_the_published_sizes():
    v3 = get_model_args("deepseek_v3", "671B")
    assert round(num_params(v3) / 1e9) == 671 and round(num_active_params(v3) / 1e9, 1) == 37.6
    moonlight = get_model_args("deepseek_v3", "16B")
    assert round(num_params(moonlight) / 1e9) == 16 and round(num_active_params(moonlight) / 1e9, 1) == 2.9
    for flavor in ("debug", "16B", "671B"):  # the count from args equals the built model's
        args = get_model_args("deepseek_v3", flavor)
        with torch.device("meta"):
            from titan_tpu.models.common.transformer import Transformer

            model = Transformer(args)
        assert sum(p.numel() for p in model.parameters()) == num_params(args), flavor


def test_flops_per_token_matches_a_count_from_the_model():
    """FlopCounterMode over a forward + backward of the debug flavor, attention by the reference
    kernel (CPU SDPA pads the values to the query-key width). With torch's grouped GEMM
    (a custom op the counter cannot see) it counts every 2-D weight's matmul and full
    (non-causal) attention, QK^T at the query-key width and PV at the value width; with the
    reference grouped matmul, which multiplies each routed row by all E experts, it counts the
    routed rows E times more: the difference over E is the routed experts' FLOPs. The formula
    counts causal attention once and the norms as parameters: the gap is exactly that."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_tpu.kernels import KernelConfig

    seq_len, batch = 64, 2
    args = dataclasses.replace(get_model_args("deepseek_v3", "debug"), max_seq_len=seq_len)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    counted = {}
    for impl in ("torch", "reference"):
        model = build_model(args, seed=0, kernels=KernelConfig(grouped_mm=impl, attention="reference"))
        counter = FlopCounterMode(display=False)
        with counter:
            model(tokens).float().logsumexp(-1).mean().backward()
        counted[impl] = counter.get_total_flops() / (batch * seq_len)

    m, a = args.moe, args.mla
    matmul_params = sum(p.numel() for name, p in model.named_parameters()
                        if p.ndim == 2 and name != "tok_embeddings.weight")
    full_attention = 6 * args.n_layers * args.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
    assert counted["torch"] == 6 * matmul_params + full_attention
    routed = (counted["reference"] - counted["torch"]) / m.num_experts
    assert routed == 6 * args.num_moe_layers * m.top_k * 3 * args.dim * m.hidden_dim
    norm_params = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    gap = counted["torch"] + routed - flops_per_token(args, seq_len)
    assert gap == pytest.approx(full_attention / 2 - 6 * norm_params, rel=1e-9)


@pytest.mark.parametrize("change, match", [
    (dict(n_group=3), r"moe.n_group \(3\) must divide num_experts \(8\)"),
    (dict(score_func="tanh"), "moe.score_func must be softmax or sigmoid"),
    (dict(n_group=4, topk_group=1), "fewer experts in topk_group groups than top_k"),
])
def test_bad_router_args_are_one_line_errors(change, match):
    with pytest.raises(ValueError, match=match) as err:
        tiny_args(**change)
    assert "\n" not in str(err.value)


def test_bad_mla_args_are_one_line_errors():
    with pytest.raises(ValueError, match="mla.qk_rope_head_dim \\(7\\) must be even") as err:
        MLAArgs(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=7, v_head_dim=8)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="n_kv_heads = n_heads"):
        dataclasses.replace(tiny_args(), n_kv_heads=2)


# ---------------------------------------------------------------------------------------------
# Through the command line: eval of an HF directory, training from it, export of the trained run
# ---------------------------------------------------------------------------------------------


def test_eval_hf_dir_runs_natively_training_starts_from_it_and_exports_back(tmp_path, train_overrides, capsys):
    import json

    import torch.nn.functional as F

    from titan_tpu.cli import main
    from titan_tpu.train.checkpoint import load_checkpoint

    debug = get_model_args("deepseek_v3", "debug")
    hf = random_hf_model(dataclasses.replace(debug, max_seq_len=128))
    with torch.no_grad():  # small weights again, so that training from them is sane
        for p in hf.parameters():
            p.mul_(0.1) if p.ndim > 1 else p.fill_(1.0)
    hf.save_pretrained(tmp_path / "hf")
    write_chat_tokenizer_dir(tmp_path / "hf")  # pretrained weights come with their tokenizer (run/setup.py)

    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (7, 30)]
    (tmp_path / "tokens.json").write_text(json.dumps(sequences))
    assert main(["eval", "--hf-dir", str(tmp_path / "hf"), "--token-file", str(tmp_path / "tokens.json"),
                 "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "native"
    with torch.no_grad():
        want = [F.cross_entropy(hf(input_ids=torch.tensor([s[:-1]])).logits[0], torch.tensor(s[1:])).item()
                for s in sequences]
    assert result["per_sequence_loss"] == pytest.approx(want, rel=1e-5, abs=1e-5)

    config = "configs/deepseek_v3_debug.toml"
    # The directory carries the routers' balancing bias: with the aux loss instead, one line says what to set.
    code = main(["train", "--config", config, *train_overrides(
        training__steps=2, validation__enabled="false", checkpoint__initial_load_path=str(tmp_path / "hf"),
        model__moe_load_balance="aux_loss", output_dir=str(tmp_path / "aux_loss_run"))])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--model.moe_load_balance expert_bias" in err, err
    code = main(["train", "--config", config, *train_overrides(
        training__steps=2, validation__enabled="false", checkpoint__initial_load_path=str(tmp_path / "hf"))])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"initial weights loaded from {tmp_path / 'hf'}" in out

    assert main(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "export"),
                 "--dtype", "float32"]) == 0
    state = load_checkpoint(tmp_path / "run/checkpoints/step-00000002")
    trained = build_model(debug)
    trained.load_state_dict(state["model"])
    assert any(b.abs().sum() > 0 for n, b in trained.named_buffers() if n.endswith("expert_bias"))  # it moved
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="sdpa")
    tokens = torch.randint(0, 2048, (1, 32), generator=g)
    with torch.no_grad():
        assert_close(reloaded.eval()(input_ids=tokens).logits, trained(tokens))


@pytest.mark.parametrize("q_lora_rank", [128, 0])
def test_planner_activation_terms_are_close_to_autograd(q_lora_rank):
    """An MLA + MoE layer's saved tensors (the difference between a 3- and a 2-layer debug model,
    layer 2 an MoE layer) against the planner's count, with the CPU kernel's padded values: exact
    but for the per-expert counts, at two lengths, so nothing grows with the square of the sequence
    (the math kernel's probabilities, were the values not padded); with full checkpointing exactly
    the block input."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_planner import _saved_bytes

    from titan_tpu.kernels import KernelConfig
    from titan_tpu.models.common.activation_memory import activation_bytes

    B = 2
    base = get_model_args("deepseek_v3", "debug")
    for ac_mode, S in (("none", 64), ("none", 256), ("full", 64)):
        sizes = {}
        for n in (2, 3):
            args = dataclasses.replace(base, n_layers=n, mla=dataclasses.replace(base.mla, q_lora_rank=q_lora_rank))
            model = build_model(args, seed=0, ac_mode=ac_mode, kernels=KernelConfig(loss="reference"))
            sizes[n] = _saved_bytes(model, torch.randint(0, args.vocab_size, (B, S)))
        predicted = activation_bytes(args, tokens=B * S, ac_mode=ac_mode, dtype_bytes=4,
                                     padded_values=True).saved_per_layer[2]
        measured = sizes[3] - sizes[2]
        if ac_mode == "full":
            assert measured == predicted
        else:
            # Not counted (test_planner.py): the MoE layer's per-expert counts, [E] int64.
            assert measured - predicted == 8 * args.moe.num_experts, (S, measured, predicted)


def test_cpu_attention_pads_narrow_values_and_equals_the_reference():
    """MLA's values are narrower than its queries; CPU SDPA pads them to the queries' width so its
    flash kernel runs (no [S, S] probabilities kept), and slices the output back: the same as the
    fp32 reference, forward and gradients, plain causal and with documents."""
    from titan_tpu.kernels.attention import pads_values, reference_attention, sdpa_attention

    assert pads_values("cpu", 48, 32) and not pads_values("cpu", 32, 32) and not pads_values("cuda", 48, 32)
    torch.manual_seed(0)
    q, k = torch.randn(2, 40, 4, 48, requires_grad=True), torch.randn(2, 40, 4, 48, requires_grad=True)
    v = torch.randn(2, 40, 4, 32, requires_grad=True)
    documents = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    for document_ids in (None, documents):
        outs, grads = [], []
        for fn in (sdpa_attention, reference_attention):
            o = fn(q, k, v, document_ids)
            outs.append(o)
            grads.append(torch.autograd.grad(o.square().sum(), (q, k, v)))
        assert outs[0].shape == (2, 40, 4, 32)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        for g_sdpa, g_ref in zip(*grads):
            torch.testing.assert_close(g_sdpa, g_ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Several ranks: SimpleFSDP, and expert parallelism with the all-to-all dispatch
# ---------------------------------------------------------------------------------------------


PARALLEL_STEPS = 10
# (mode, ep, moe.load_balance, model.mtp_num_layers, scanned: the dense layer and the MoE layers as
# two stacks); ep 2 by all_to_all. With MTP the block after the main model is an MoE layer too: its
# experts are split over ep and its tokens travel by the same dispatch, and its loss is reported
# apart from the main one.
PARALLEL_CASES = [("eager", 1, "expert_bias", 0, False), ("eager", 2, "expert_bias", 0, False),
                  ("eager", 2, "aux_loss", 0, False), ("aot_eager", 2, "expert_bias", 0, False),
                  ("eager", 2, "expert_bias", 1, False), ("aot_eager", 2, "aux_loss", 1, False)]
SCANNED_CASES = [("eager", 2, "expert_bias", 0, True), ("aot_eager", 2, "expert_bias", 0, True)]


def parallel_args(load_balance: str, mtp_num_layers: int) -> TransformerArgs:
    args = tiny_args(load_balance=load_balance)
    return dataclasses.replace(args, mtp_num_layers=mtp_num_layers, mtp_loss_scaling_factor=0.3) \
        if mtp_num_layers else args


def _parallel_worker(cases: list[tuple]) -> list[dict]:
    import torch.distributed as dist

    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.parallel.expert_parallel import make_dispatch
    from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
    from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init

    out = []
    for mode, ep, load_balance, mtp_num_layers, scan in cases:
        args = parallel_args(load_balance, mtp_num_layers)
        world = dist.get_world_size()
        dims = ParallelDims(dp_shard=world, world_size=world, ep=ep)
        mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
        rank, size = dp_rank_and_size(mesh)
        with torch.device("meta"):
            model = Transformer(args, scan_layers=scan)
        model = materialize_and_init(model, mesh, mode="fully_shard", mp=MixedPrecision(),
                                     device=torch.device("cpu"), seed=0, expert_mesh=expert_mesh)
        if expert_mesh is not None:
            model.expert_dispatch.dispatch = make_dispatch(expert_mesh, "all_to_all")
        opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
        g = torch.Generator().manual_seed(2)
        data = [torch.randint(0, args.vocab_size, (4, 33), generator=g) for _ in range(PARALLEL_STEPS)]
        rows = 4 // size
        batches = [(t[rank * rows:(rank + 1) * rows, :-1].contiguous(),
                    t[rank * rows:(rank + 1) * rows, 1:].contiguous()) for t in data]
        if mode == "eager":
            step = EagerStep(model, opt, max_norm=1.0, dp_size=size)
        else:
            from titan_tpu.graph import GraphStep

            step = GraphStep(model, opt, max_norm=1.0, example_batch=batches[0], backend=mode, dp_size=size)
        results = [step([b], 2e-3) for b in batches]
        moe_experts = [model.layers.run1.moe.experts.w1] if scan else [model.layers["1"].moe.experts.w1]
        moe_experts += [layer.block.moe.experts.w1 for layer in (model.mtp or {}).values()]
        out.append({"losses": [(r.loss, r.aux_loss, r.mtp_loss) for r in results],
                    "loads": [r.expert_load for r in results],
                    # per layer (the state dict's names) whether scanned or not
                    "biases": {n: b.clone() for n, b in model.state_dict().items() if "expert_bias" in n},
                    # a stack's experts on dim 1 (dim 0: its layers)
                    "local_experts": [_local(w).shape[1 if w.ndim == 4 else 0] for w in moe_experts]})
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@functools.cache
def parallel_reference(load_balance: str, mtp_num_layers: int) -> tuple[list, dict]:
    """One process taking both ranks' rows as 2 micro-batches, unrolled; the cases differing only in
    mode, ep or scanning share it."""
    return train(parallel_args(load_balance, mtp_num_layers), micro_batches=2, steps=PARALLEL_STEPS)


@pytest.mark.multiprocess
def test_simple_fsdp_and_all_to_all_expert_parallel_train_like_one_process():
    """2 ranks, 10 steps: SimpleFSDP alone, and with ep 2 by the all-to-all dispatch (each rank 4
    of the 8 experts; with and without the balancing bias, eager and captured; with a multi-token
    prediction block, whose experts are split too) equal one process taking the same rows as 2
    micro-batches: losses (main, balancing, MTP) within 1e-5, the same routing, biases."""
    _check_parallel_runs(PARALLEL_CASES)


@pytest.mark.multiprocess
def test_scanned_runs_with_simple_fsdp_and_expert_parallel_train_like_one_process():
    """The same with the layers scanned (two stacks, each sharded per layer and gathered layer by
    layer, its experts on the expert mesh), eager and captured: equal to one unrolled process."""
    _check_parallel_runs(SCANNED_CASES)


def _check_parallel_runs(cases: list[tuple]) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_parallel_worker, world_size=2, args=(cases,), timeout_s=900)
    for i, case in enumerate(cases):
        mode, ep, load_balance, mtp_num_layers, scan = case
        want, want_biases = parallel_reference(load_balance, mtp_num_layers)
        assert (want[0].mtp_loss is not None) == bool(mtp_num_layers)
        for rank_results in results:
            got = rank_results[i]
            for (loss, aux, mtp), w in zip(got["losses"], want, strict=True):
                assert abs(loss - w.loss) <= 1e-5 and abs(aux - w.aux_loss) <= 1e-5, case
                assert (mtp is None) if w.mtp_loss is None else abs(mtp - w.mtp_loss) <= 1e-5, case
            for load, w in zip(got["loads"], want):
                assert torch.equal(load, w.expert_load)
            assert got["biases"].keys() == want_biases.keys()
            for name, bias in got["biases"].items():
                torch.testing.assert_close(bias, want_biases[name], rtol=0, atol=1e-6)
            assert got["local_experts"] == [8 // ep] * (1 + mtp_num_layers)  # the MTP block's experts split too
