"""The Transformers backend (models/hf/): any HF causal LM under our trainer.

The fixed subset of `titan-tpu hf-sweep` runs here (the whole sweep does not: docs/hf_models.md):
our loss and gradients against transformers' own forward and backward, the captured graph step
against the eager step, and 2 fully_shard ranks against one process. Then what a user does with
an HF directory: train from it, resume, export it back and load the export with from_pretrained.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from titan_tpu.cli import main  # noqa: E402
from titan_tpu.models.hf.config import hf_args_from_config, hf_args_from_spec, load_hf_config  # noqa: E402
from titan_tpu.models.hf.model import build_hf_model  # noqa: E402
from titan_tpu.models.hf.weights import load_pretrained_weights  # noqa: E402
from titan_tpu.parallel.simple_fsdp import materialize_and_init  # noqa: E402
from titan_tpu.tools import hf_sweep  # noqa: E402
from titan_tpu.train.checkpoint import load_full_state_dict  # noqa: E402

SUBSET = ["llama", "qwen3", "gemma3_text", "mistral", "phi3", "gpt2", "olmo2", "qwen3_moe", "mixtral", "mamba"]
TINY_LLAMA = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=512")


@pytest.mark.parametrize("model_type", SUBSET)
def test_loss_and_gradients_match_transformers(model_type):
    note = hf_sweep.check_eager(hf_sweep.tiny_config(model_type))
    if model_type in ("llama", "qwen3", "qwen3_moe", "mistral"):
        assert note == "chunked loss"  # their logits are lm_head(hidden): our loss kernel runs


# Models whose attention cannot take our kernel keep their own (sdpa) and still match: Falcon picks
# attention classes from a table of its own, Doge adds a learned mask to the causal one, DeepSeek
# V3.2's indexer hands its top-k selection to implementations other than eager and sdpa.
@pytest.mark.parametrize("model_type", ["falcon", "doge", "deepseek_v32"])
def test_models_that_keep_their_own_attention_match_transformers(model_type):
    hf_sweep.check_eager(hf_sweep.tiny_config(model_type))


# qwen3_next: gated delta rule (linear attention); softplus_backward's fake kernel disagrees with
# the real one on the output layout, so it is traced as its decomposition (graph/capture.py).
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", "qwen3_moe", "mamba", "qwen3_next"])
def test_captured_step_matches_eager_step(model_type):
    hf_sweep.check_graph(hf_sweep.tiny_config(model_type))


def test_graph_safe_dbrx_experts_equal_its_own_loop():
    """GRAPH_SAFE_FORWARDS["DbrxExperts"] against the unmodified class's forward (a loop over
    nonzero()'s experts): output and gradients, with top 2 of 4 experts and one expert unused."""
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    from titan_tpu.models.hf.hooks import GRAPH_SAFE_FORWARDS

    ffn = hf_sweep.tiny_config("dbrx").ffn_config
    torch.manual_seed(0)
    experts = DbrxExperts(ffn)
    for w in (experts.mlp.w1, experts.mlp.v1, experts.mlp.w2):
        torch.nn.init.normal_(w, std=0.1)
    hidden_BSD = torch.randn(2, 5, ffn.hidden_size)
    index_TK = torch.randint(0, 3, (10, 2))  # expert 3 gets no token
    index_TK[:, 1] = (index_TK[:, 0] + 1) % 3
    grads = _assert_same_output_and_grads(DbrxExperts.forward, GRAPH_SAFE_FORWARDS["DbrxExperts"], experts,
                                          hidden_BSD, index_TK, torch.rand(10, 2))
    assert grads[0].view(4, -1, ffn.hidden_size)[3].abs().max() == 0  # the unused expert


def _assert_same_output_and_grads(theirs_fn, ours_fn, module, hidden, index_TK, weights_TK) -> list[torch.Tensor]:
    """The outputs and parameter gradients of two forwards agree (gradients relative to the largest:
    they sum over tokens in another order); our gradients."""
    outputs, grads = [], []
    for forward in (theirs_fn, ours_fn):
        module.zero_grad()
        out = forward(module, hidden, index_TK, weights_TK)
        out.square().sum().backward()
        outputs.append(out)
        grads.append([p.grad.clone() for p in module.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(grads[1], grads[0]):
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    return grads[1]


def test_graph_safe_longcat_flash_experts_equal_its_own_loop():
    """GRAPH_SAFE_FORWARDS["LongcatFlashExperts"] against the class's own forward: routed experts
    and identity ("zero-computation") experts mixed in one token's top-k."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    from titan_tpu.models.hf.hooks import GRAPH_SAFE_FORWARDS

    config = hf_sweep.tiny_config("longcat_flash")
    torch.manual_seed(0)
    experts = LongcatFlashExperts(config)
    for w in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(w, std=0.1)
    hidden_TD = torch.randn(12, config.hidden_size)
    routed, total = experts.num_routed_experts, experts.total_experts
    index_TK = torch.stack([torch.randint(0, routed, (12,)), torch.randint(routed, total, (12,))], dim=1)
    index_TK[::3] = index_TK[::3].flip(1)  # zero experts first in some tokens' top-k
    index_TK[1, 1] = (index_TK[1, 0] + 1) % routed  # two routed experts for one token
    _assert_same_output_and_grads(LongcatFlashExperts.forward, GRAPH_SAFE_FORWARDS["LongcatFlashExperts"],
                                  experts, hidden_TD, index_TK, torch.rand(12, 2))


def test_checkpointed_layers_recompute_with_the_forward_context():
    """Activation checkpointing recomputes a decoder layer in the backward, after the model's call
    has returned: the recomputation must take the forward's path (our attention with the batch's
    documents), else its saved tensors differ and the backward fails or its gradients do."""
    from titan_tpu.models.hf.model import build_hf_model

    args = hf_args_from_config(hf_sweep.tiny_config("qwen3"))
    inputs, labels = hf_sweep.sweep_batch()
    positions = torch.arange(hf_sweep.SEQ // 2).repeat(2).expand(inputs.shape[0], -1)  # two documents a row
    grads = []
    for ac_mode in ("none", "full"):
        model = materialize_and_init(build_hf_model(args, ac_mode=ac_mode), None, mode="none", mp=None,
                                     device="cpu", seed=0)
        model(inputs, labels, positions_BS=positions).ce_sum.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-6)


def test_tiny_configs_keep_one_layer_of_every_kind():
    assert hf_sweep.tiny_config("gemma3_text").layer_types == ["sliding_attention", "full_attention"]
    assert hf_sweep.tiny_config("qwen3_next").layer_types == ["linear_attention", "full_attention"]
    lara = hf_sweep.tiny_config("lara_mini")  # three kinds: three layers
    assert sorted(lara.layer_types) == ["full_attention", "linear_attention", "sliding_attention"]
    assert lara.num_hidden_layers == 3


def test_composite_overrides_reach_the_text_config_through_the_constructor():
    # Dots 3 Note: the text model's per-layer table is cut to the new depth, and the composite's
    # own check (its adapters as wide as the text model) runs on the result.
    config = hf_sweep.tiny_config("dots3_note")
    text = config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers) == (64, 2)
    assert config.vision_config.adapter_out_dim == 64
    with pytest.raises(ValueError, match="adapter output width must match"):
        load_hf_config("dots3_note", {"hidden_size": 64, "num_hidden_layers": 2})


def test_a_directory_config_gets_its_per_layer_entries_cut_to_the_new_depth(tmp_path):
    # A saved 4-layer config trained at 2 layers: its per-layer list and {layer: ...} table follow
    # the new depth; id2label (keyed by label, not layer) is left alone.
    config = hf_sweep.tiny_config("qwen3")
    config.num_hidden_layers = 4
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.use_sliding_window, config.sliding_window = True, 8
    config.moe_layer_table = {str(i): i % 2 == 0 for i in range(4)}  # an extra key, as some models keep
    config.id2label = {0: "a", 1: "b", 2: "c"}
    config.save_pretrained(tmp_path)
    loaded = load_hf_config(str(tmp_path), {"num_hidden_layers": 2})
    assert loaded.layer_types == ["sliding_attention", "full_attention"]
    assert loaded.moe_layer_table == {"0": True, "1": False}
    assert len(loaded.id2label) == 3


def test_moe_balancing_loss_is_transformers_own_when_the_config_asks():
    config = hf_sweep.tiny_config("qwen3_moe")
    config.output_router_logits = True  # transformers adds the balancing loss only then
    ours = hf_sweep._our_model(hf_args_from_config(config))
    ref = hf_sweep._reference_model(config, ours.state_dict())
    inputs, labels = hf_sweep.sweep_batch()
    expected = config.router_aux_loss_coef * ref(input_ids=inputs, use_cache=False).aux_loss
    torch.testing.assert_close(ours(inputs, labels).aux_loss, expected, rtol=1e-5, atol=1e-7)
    config.output_router_logits = False
    assert hf_sweep._our_model(hf_args_from_config(config))(inputs, labels).aux_loss.item() == 0.0


def _moe_with_balancing():
    config = hf_sweep.tiny_config("qwen3_moe")
    config.output_router_logits = True
    return config


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_two_fully_shard_ranks_match_one_process(model_type):
    from dist_utils import require_multiprocess_marker

    require_multiprocess_marker()
    # MoE with its balancing loss: each rank's loss over its own rows, as micro-batches of one process.
    hf_sweep.check_fsdp2(_moe_with_balancing() if model_type == "qwen3_moe" else hf_sweep.tiny_config(model_type))


def _tied_rank(args):
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import MixedPrecision

    mesh = ParallelDims(dp_shard=2, world_size=2).build_mesh("cpu")
    model = materialize_and_init(build_hf_model(args), mesh, mode="fully_shard", mp=MixedPrecision(),
                                 device="cpu", seed=0)
    hf = model.hf_model
    return {"tied": hf.lm_head._parameters["weight"] is hf.model.embed_tokens._parameters["weight"],
            "names": [n for n, _ in model.named_parameters()],
            "state_keys": list(model.state_dict())}


@pytest.mark.multiprocess
def test_tied_embeddings_stay_one_parameter_when_sharded():
    from dist_utils import run_distributed

    config = hf_sweep.tiny_config("qwen3")
    config.tie_word_embeddings = True
    results = run_distributed(_tied_rank, world_size=2, args=(hf_args_from_config(config),))
    for r in results:
        assert r["tied"]
        assert "hf_model.lm_head.weight" not in r["names"]  # one parameter, one optimizer entry
        assert "hf_model.model.embed_tokens.weight" in r["names"]


def _save_tiny_llama(path: Path, **config_changes) -> None:
    from transformers import AutoModelForCausalLM

    config = load_hf_config("llama", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                                      "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64},
                                      **config_changes})
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))


def test_loaded_model_logits_equal_transformers_from_pretrained(tmp_path):
    """The meta-build trap: RoPE inv_freq (here with Llama 3.1 scaling) must be right after loading."""
    from transformers import AutoModelForCausalLM

    _save_tiny_llama(tmp_path / "hf")
    args = hf_args_from_spec(str(tmp_path / "hf"))
    ours = materialize_and_init(build_hf_model(args), None, mode="none", mp=None, device="cpu", seed=0)
    load_pretrained_weights(ours, tmp_path / "hf")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(tokens), ref(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "bloom"])
def test_model_without_sdpa_loads_from_a_directory(tmp_path, model_type):
    """Issue 24: reading the weights asked transformers for sdpa, which Gemma 2 and BLOOM refuse; the
    error blamed the weights. Now they load (logits equal transformers' from_pretrained) and train."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_sweep.tiny_config(model_type)).save_pretrained(str(tmp_path / "hf"))
    ours = materialize_and_init(build_hf_model(hf_args_from_spec(str(tmp_path / "hf"))), None, mode="none", mp=None,
                                device="cpu", seed=1)
    load_pretrained_weights(ours, tmp_path / "hf")
    ours.eval()
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    if model_type == "gemma2":
        rows = _train(tmp_path / "run", tmp_path / "cache", str(tmp_path / "hf"), "--training.steps", "3")
        assert len([r for r in rows if "loss" in r]) == 3


def _train(run_dir: Path, cache: Path, hf_config: str, *extra: str) -> list[dict]:
    args = ["train", "--model.name", "hf", "--model.hf_config", hf_config, "--output_dir", str(run_dir),
            "--data.cache_dir", str(cache), "--data.max_bytes", "400000", "--training.batch_size", "2",
            "--training.seq_len", "32", "--training.steps", "20", "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_ratio", "0", "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
            "--validation.enabled", "false", "--checkpoint.interval", "10", "--training.device", "cpu", *extra]
    assert main(args) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_directory_round_trip_train_resume_export(tmp_path):
    """save_pretrained -> train 20 steps from it (resuming at 10 gives the same losses) -> export ->
    from_pretrained of the export holds exactly the trained weights."""
    from transformers import AutoModelForCausalLM

    from titan_tpu.data.tokenizer import train_bpe_tokenizer

    hf_dir, cache = tmp_path / "hf", tmp_path / "cache"
    _save_tiny_llama(hf_dir)
    # The directory's own tokenizer.json (trained on other text) is the one the run uses and exports.
    train_bpe_tokenizer(["a tokenizer of the model directory, not of the corpus"] * 20, vocab_size=512,
                        save_path=hf_dir / "tokenizer.json")
    straight = _train(tmp_path / "run", cache, str(hf_dir))
    assert straight[0]["loss"] < 6.4  # the saved weights were loaded: log(512) = 6.24 for a fresh init
    assert not (cache / "tokenizers").exists()  # no tokenizer was trained on the corpus
    # Resume from the step-10 checkpoint: steps 11..20 again, bitwise.
    import shutil

    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-00000010", tmp_path / "resumed" / "checkpoints" /
                    "step-00000010")
    resumed = _train(tmp_path / "resumed", cache, str(hf_dir))
    assert [r["loss"] for r in resumed if "loss" in r] == [r["loss"] for r in straight if "loss" in r][10:]

    assert main(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "export"),
                 "--dtype", "float32"]) == 0
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    trained = load_full_state_dict(tmp_path / "run" / "checkpoints" / "step-00000020")
    for name, value in exported.state_dict().items():
        if f"hf_model.{name}" in trained:
            assert torch.equal(value, trained[f"hf_model.{name}"]), name
    assert "hf_model.model.layers.0.self_attn.q_proj.weight" in trained


def test_graph_mode_and_checkpointing_train_from_a_type(tmp_path):
    """--model.hf_config TYPE with overrides, graph mode, activation checkpointing: it trains."""
    rows = _train(tmp_path / "run", tmp_path / "cache", "qwen3", "--model.hf_overrides", TINY_LLAMA,
                  "--training.mode", "graph", "--compile.backend", "aot_eager",
                  "--activation_checkpoint.mode", "full", "--training.steps", "10")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 10 and losses[-1] < losses[0]


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_args_from_spec(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="close names: llama"):
        hf_args_from_spec("lama")
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="not a causal LM"):
        hf_args_from_spec(str(tmp_path / "vit"))
    _save_tiny_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 96  # the saved MLP weights are 128 wide
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    model = materialize_and_init(build_hf_model(hf_args_from_spec(str(tmp_path / "hf"))), None, mode="none",
                                 mp=None, device="cpu", seed=0)
    with pytest.raises(ValueError, match="do not fit its config.json"):
        load_pretrained_weights(model, tmp_path / "hf")
    with pytest.raises(ValueError, match="model.hf_config / model.hf_overrides apply to model.name = hf"):
        from titan_tpu.config import build_config
        from titan_tpu.run.setup import prepare_run

        prepare_run(build_config(None, ["--model.hf_config", "llama"]))
    with pytest.raises(ValueError, match="scan_layers needs a native model"):
        prepare_run(build_config(None, ["--model.name", "hf", "--model.hf_config", "llama", "--model.hf_overrides",
                                        TINY_LLAMA, "--model.scan_layers", "true"]))


def test_kernel_attention_runs_in_both_modes_and_documents_match(monkeypatch):
    """Our attention kernel serves an HF model in eager and in graph mode (transformers builds no
    mask it would fall back for), with packed documents too: graph equals eager."""
    from titan_tpu.kernels import KernelConfig

    calls = []
    resolve = KernelConfig.attention_impl

    def counting(self, device_type, *, documents):
        calls.append(documents)
        return resolve(self, device_type, documents=documents)

    monkeypatch.setattr(KernelConfig, "attention_impl", counting)
    config = hf_sweep.tiny_config("llama")
    args = hf_args_from_config(config)
    inputs, labels = hf_sweep.sweep_batch()
    positions = torch.arange(inputs.shape[1]).repeat(inputs.shape[0], 1)
    positions[:, 12:] -= 12  # a second document starts at token 12 of every row
    batch = (inputs, labels, positions)
    eager_model, graph_model = hf_sweep._our_model(args), hf_sweep._our_model(args)
    calls.clear()
    eager = hf_sweep._train_step(eager_model, batch, graph=False)
    assert calls == [True] * config.num_hidden_layers
    calls.clear()
    graph = hf_sweep._train_step(graph_model, batch, graph=True)
    assert calls == [True] * config.num_hidden_layers  # traced once
    assert abs(graph.loss - eager.loss) <= 1e-5 * eager.loss
    # The documents matter: the same batch without them gives another loss.
    plain = hf_sweep._train_step(hf_sweep._our_model(args), (inputs, labels), graph=False)
    assert abs(plain.loss - eager.loss) > 1e-4


def test_packed_document_gets_the_logits_it_gets_alone():
    model = hf_sweep._our_model(hf_args_from_config(hf_sweep.tiny_config("qwen3")))
    a = torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(1))
    b = torch.randint(3, 512, (1, 14), generator=torch.Generator().manual_seed(2))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0)
    with torch.no_grad():
        alone_a, alone_b = model(a), model(b)
    # Through the training path (loss kernel): each document's summed cross-entropy, packed vs alone.
    targets = torch.randint(3, 512, packed.shape, generator=torch.Generator().manual_seed(3))
    ignore_a = targets.clone()
    ignore_a[:, :10] = -100
    ignore_b = targets.clone()
    ignore_b[:, 10:] = -100
    with torch.no_grad():
        packed_b = model(packed, ignore_a, positions_BS=positions).ce_sum
        packed_a = model(packed, ignore_b, positions_BS=positions).ce_sum
        ce = torch.nn.functional.cross_entropy
        expected_a = ce(alone_a[0].float(), targets[0, :10], reduction="sum")
        expected_b = ce(alone_b[0].float(), targets[0, 10:], reduction="sum")
    torch.testing.assert_close(packed_a, expected_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_b, expected_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2"])
def test_the_loss_decided_without_weights_is_the_one_real_weights_decide(model_type):
    """`titan-tpu compile` captures the step on the meta device, where the chunked-loss check has no
    weights to run on: its answer there (from the model's structure) is the one the same model with
    real weights gives, so the program XLA compiles computes the loss the run will."""
    from titan_tpu.parallel.simple_fsdp import MixedPrecision

    args = hf_args_from_config(hf_sweep.tiny_config(model_type))
    with torch.device("meta"):
        on_meta = build_hf_model(args)
    real = materialize_and_init(build_hf_model(args), None, mode="none", mp=MixedPrecision(), device="cpu", seed=0)
    assert on_meta.check_chunked_loss(args.vocab_size) == real.check_chunked_loss(args.vocab_size)
    assert on_meta.use_chunked_loss == (model_type != "gemma2")  # gemma2 soft-caps its logits
