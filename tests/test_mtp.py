"""DeepSeek-V3 multi-token prediction (models/common/mtp.py): the loss against an independent
computation whose MTP block is transformers' own decoder layer, the main loss untouched, graph
mode and checkpointing like eager, the HF layout under DeepSeek's published names, the config
keys and their refusals, the sizes the planner and FLOPs count."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from titan_tpu.models.registry import build_model, flops_per_token, get_model_args, num_params

transformers = pytest.importorskip("transformers")

from tests.test_deepseek_v3 import random_hf_model, tiny_args  # noqa: E402
from tests.test_moe import train  # noqa: E402
from titan_tpu.models.hub.checkpoint import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402


def mtp_args(depth: int = 1, **moe) -> dataclasses.dataclass:
    return dataclasses.replace(tiny_args(**moe), mtp_num_layers=depth, mtp_loss_scaling_factor=0.3)


def batch(args, *, B=2, S=24, seed=1):
    t = torch.randint(0, args.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_equals_an_independent_computation(depth, tmp_path):
    """The exported checkpoint loaded by transformers with num_hidden_layers = n_layers + depth
    holds each MTP block as an ordinary decoder layer: the main model's final hidden states
    (transformers' own forward of the first n_layers), then per depth plain torch around that
    layer (norms, concatenation, projection, the shared head, shifted targets) give the loss."""
    args = mtp_args(depth)
    model = build_model(args, seed=0)
    with torch.no_grad():  # a non-zero choice bias in the MTP block's router too
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=torch.Generator().manual_seed(len(name))))
    inputs, labels = batch(args)
    out = model(inputs, labels)

    out_dir = save_hf_checkpoint(tmp_path / "hf", name="deepseek_v3", args=args, state_dict=model.state_dict())
    config = json.loads((out_dir / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == depth
    config["num_hidden_layers"] += depth
    (out_dir / "config.json").write_text(json.dumps(config))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out_dir, attn_implementation="sdpa").eval()
    from safetensors.torch import load_file

    sd = {k: v for shard in out_dir.glob("*.safetensors") for k, v in load_file(shard).items()}  # as written
    L, S, eps = args.n_layers, inputs.shape[1], args.norm_eps
    with torch.no_grad():
        x = hf.model.embed_tokens(inputs)
        position_ids = torch.arange(S)[None]
        rope = hf.model.rotary_emb(x, position_ids)
        for layer in hf.model.layers[:L]:
            x = layer(x, position_embeddings=rope, position_ids=position_ids)
        h = hf.model.norm(x)
        main = F.cross_entropy((h @ sd["lm_head.weight"].T).flatten(0, 1), labels.flatten(), reduction="sum")
        torch.testing.assert_close(main, out.ce_sum, rtol=1e-5, atol=1e-4)
        window = torch.cat([inputs, labels[:, -1:]], dim=1)  # t_0 .. t_S
        losses = []
        for k in range(1, depth + 1):
            p = f"model.layers.{L + k - 1}."
            next_tokens = torch.cat([window[:, k:], window.new_zeros(2, k - 1)], dim=1)[:, :S]
            e = sd["model.embed_tokens.weight"][next_tokens]
            x = torch.cat([_rms(e, sd[p + "enorm.weight"], eps), _rms(h, sd[p + "hnorm.weight"], eps)], -1)
            h = hf.model.layers[L + k - 1](x @ sd[p + "eh_proj.weight"].T, position_embeddings=rope,
                                           position_ids=position_ids)
            logits = _rms(h, sd[p + "shared_head.norm.weight"], eps) @ sd["lm_head.weight"].T
            # Position i predicts t_{i+k+1} = labels[i+k]; the last k positions have no target.
            losses.append(F.cross_entropy(logits[:, :S - k].flatten(0, 1), labels[:, k:].flatten(), reduction="sum"))
    torch.testing.assert_close(out.mtp_ce_sum, torch.stack(losses).mean(), rtol=1e-5, atol=1e-4)
    assert out.mtp_weight == 0.3
    assert out.expert_load.shape[0] == args.num_moe_layers + depth  # the MTP blocks' loads appended


def test_mtp_targets_stop_at_document_starts_and_the_window_end():
    from titan_tpu.models.common.mtp import mtp_tokens

    inputs = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[11, 12, 13, 14, 15, 16]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # a document starts at index 3
    tokens, targets = mtp_tokens(inputs, labels, positions, depth=1)
    assert tokens.tolist() == [[11, 12, 13, 14, 15, 16]]
    # i=2: its input t_3 starts the next document, so its target would be predicted across it; i=1
    # predicts that start itself, as the main loss does at a document's last token.
    assert targets.tolist() == [[12, 13, -100, 15, 16, -100]]
    tokens, targets = mtp_tokens(inputs, labels, None, depth=2)
    assert tokens.tolist() == [[12, 13, 14, 15, 16, 0]] and targets.tolist() == [[13, 14, 15, 16, -100, -100]]


def test_main_loss_is_unchanged_by_mtp_and_mtp_off_trains_as_before():
    """The main model's weights are drawn as without MTP (its layer is initialised last), its
    cross-entropy is bitwise the same, and the step reports it apart from the MTP loss."""
    base, with_mtp = tiny_args(), mtp_args()
    off, on = build_model(base, seed=0), build_model(with_mtp, seed=0)
    for name, p in off.state_dict().items():
        assert torch.equal(on.state_dict()[name], p), name
    inputs, labels = batch(base)
    a, b = off(inputs, labels), on(inputs, labels)
    assert torch.equal(a.ce_sum, b.ce_sum) and a.mtp_ce_sum is None and b.mtp_ce_sum > 0
    results_off, _ = train(base, steps=2)
    results_on, _ = train(with_mtp, steps=2)
    assert results_off[0].loss == results_on[0].loss  # step 1: the same weights, the main loss alone
    assert results_off[0].mtp_loss is None and results_on[0].mtp_loss > 0
    assert results_off[1].loss != results_on[1].loss  # the MTP loss's gradient reached the shared weights


@pytest.fixture(scope="module")
def eager_reference():
    return train(mtp_args(), steps=4)


@pytest.mark.parametrize("mode, scan, ac", [("eager", False, "full"), ("eager", False, "selective"),
                                            ("aot_eager", False, "none"), ("aot_eager", False, "full"),
                                            ("eager", True, "none"), ("aot_eager", True, "full")])
def test_graph_mode_scan_and_checkpointing_train_like_eager(eager_reference, mode, scan, ac):
    """Scanned: the trunk as two scans (dense layer 0, MoE layers 1-2), the MTP depth after them
    unrolled; its bias follows the stacked ones in expert_load's order."""
    want, want_biases = eager_reference
    got, got_biases = train(mtp_args(), mode=mode, scan=scan, ac=ac, steps=4)
    for a, b in zip(got, want):
        assert abs(a.loss - b.loss) <= 1e-5 and abs(a.mtp_loss - b.mtp_loss) <= 1e-5
        assert torch.equal(a.expert_load, b.expert_load)
    assert "mtp.0.block.moe.expert_bias" in want_biases
    assert want_biases["mtp.0.block.moe.expert_bias"].abs().sum() > 0  # the MTP block's bias moves too
    if scan:
        assert list(got_biases) == ["layers.run1.moe.expert_bias", "mtp.0.block.moe.expert_bias"]
    else:
        assert got_biases.keys() == want_biases.keys()
    torch.testing.assert_close(torch.cat([b.reshape(-1) for b in got_biases.values()]),
                               torch.cat([b.reshape(-1) for b in want_biases.values()]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The HF layout
# ---------------------------------------------------------------------------------------------


def test_hf_export_uses_deepseeks_names_and_round_trips_exactly(tmp_path):
    from safetensors import safe_open

    args = mtp_args()
    model = build_model(args, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out_dir = save_hf_checkpoint(tmp_path / "hf", name="deepseek_v3", args=args, state_dict=model.state_dict())
    names = set()
    for shard in out_dir.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names |= set(f.keys())
    mtp = {n.removeprefix("model.layers.3.") for n in names if n.startswith("model.layers.3.")}
    # As in DeepSeek-V3's published index (model.layers.61.*), at this model's depth 3.
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_a_proj.weight", "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight",
            "mlp.shared_experts.up_proj.weight"} <= mtp
    _, _, native = load_hf_checkpoint(out_dir, mtp_num_layers=1)
    assert native.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(native[key], value), key
    # MTP off: the directory loads as the main model; transformers loads it too (skipping layer 3).
    _, main_args, main_only = load_hf_checkpoint(out_dir)
    assert main_args.mtp_num_layers == 0 and not any(k.startswith("mtp.") for k in main_only)
    tokens, _ = batch(args)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens), rtol=1e-5, atol=1e-4)


def test_a_directory_without_mtp_weights_is_a_one_line_error_when_mtp_is_on(tmp_path):
    hf = random_hf_model(tiny_args())
    hf.save_pretrained(tmp_path / "hf")
    _, args, _ = load_hf_checkpoint(tmp_path / "hf")  # MTP off: loads
    with pytest.raises(ValueError, match="has no multi-token-prediction weights .*set model.mtp_num_layers to 0") \
            as err:
        load_hf_checkpoint(tmp_path / "hf", mtp_num_layers=1)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Config, refusals, sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    (["--model.name", "llama3", "--model.mtp_num_layers", "1"], "applies to deepseek_v3"),
    (["--model.name", "hf", "--model.hf_config", "llama", "--model.mtp_num_layers", "1"],
     "needs --model.name deepseek_v3"),
    (["--model.name", "deepseek_v3", "--model.mtp_num_layers", "1", "--parallelism.tp", "2"],
     "not split by tensor or context parallelism"),
    (["--model.name", "deepseek_v3", "--model.mtp_num_layers=-1"], "must be >= 0"),
])
def test_config_refusals_are_one_line(overrides, match):
    from titan_tpu.config import build_config
    from titan_tpu.models.spec import model_spec

    cfg = build_config(None, overrides)
    with pytest.raises(ValueError, match=match) as err:
        model_spec(cfg.model).check(cfg)
    assert "\n" not in str(err.value)


def test_sizes_and_flops_count_the_mtp_layer():
    debug = get_model_args("deepseek_v3", "debug")
    args = dataclasses.replace(debug, mtp_num_layers=1)
    with torch.device("meta"):
        from titan_tpu.models.common.transformer import Transformer

        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    moe = args.moe
    unused = (moe.num_experts - moe.top_k) * 3 * args.dim * moe.hidden_dim
    attention = 6 * args.n_heads * (args.mla.qk_head_dim + args.mla.v_head_dim) / 2 * 128
    assert flops_per_token(args, 128) - flops_per_token(debug, 128) == pytest.approx(
        6 * (mtp - unused + args.dim * args.vocab_size) + attention)


SMALL = {"training__seq_len": 32, "training__batch_size": 2}


def test_train_logs_the_mtp_loss_exports_it_and_starts_again_from_the_export(tmp_path, train_overrides, capsys):
    from titan_tpu.cli import main

    config = "configs/deepseek_v3_debug.toml"
    assert main(["train", "--config", config, *train_overrides(
        training__steps=2, validation__enabled="false", model__mtp_num_layers=1, **SMALL)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r and "mtp_loss" in r]
    assert len(trained) == 2 and all(r["mtp_loss"] > 0 for r in trained)
    assert main(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "export")]) == 0
    index = json.loads((tmp_path / "export/config.json").read_text())
    assert index["num_nextn_predict_layers"] == 1
    capsys.readouterr()
    code = main(["train", "--config", config, *train_overrides(
        training__steps=1, validation__enabled="false", model__mtp_num_layers=1,
        checkpoint__initial_load_path=str(tmp_path / "export"), output_dir=str(tmp_path / "again"), **SMALL)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"initial weights loaded from {tmp_path / 'export'}" in out
    again = [json.loads(line) for line in (tmp_path / "again/metrics.jsonl").read_text().splitlines()]
    again = next(r for r in again if "mtp_loss" in r)
    assert again["mtp_loss"] < trained[0]["mtp_loss"]  # it starts from the trained MTP layer, not a fresh one
