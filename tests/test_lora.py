"""LoRA (models/lora.py) against peft: the same adapters on the same Hugging Face model give the
same loss, adapter gradients and 20 training steps; the captured step gives the eager losses; the
trainer freezes the base, checkpoints and resumes the adapters; one-line errors for bad input."""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from titan_tpu.config import LoRAConfig, build_config  # noqa: E402
from titan_tpu.models.hf.config import hf_args_from_config  # noqa: E402
from titan_tpu.models.hf.model import PREFIX, build_hf_model  # noqa: E402
from titan_tpu.models.lora import add_adapters, freeze_base, init_lora_, is_adapter_key, lora_modules  # noqa: E402
from titan_tpu.parallel.simple_fsdp import materialize_and_init  # noqa: E402
from titan_tpu.run.setup import prepare_run  # noqa: E402
from titan_tpu.tools.hf_sweep import sweep_batch, tiny_config  # noqa: E402
from titan_tpu.train.optim import AdamW  # noqa: E402
from titan_tpu.train.step import EagerStep  # noqa: E402

LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)
TOLERANCE = 1e-5
LR = 1e-2
WEIGHT_DECAY = 0.1


def lora_hf_model(config, lora: LoRAConfig = LORA):
    """Our Transformers-backend model with adapters; B drawn at random (peft starts it at zero,
    where A's gradient would be zero and prove nothing)."""
    model = build_hf_model(hf_args_from_config(config))
    add_adapters(model, lora)
    model = materialize_and_init(model, None, mode="none", mp=None, device="cpu", seed=0)
    init_lora_(model, seed=0)
    freeze_base(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for linear in lora_modules(model).values():
            stored_b = linear._parameters["lora_B"]
            stored_b.copy_(torch.randn(stored_b.shape, generator=generator) * 0.1)
    model.train()
    return model


def peft_key(our_name: str) -> str:
    """hf_model.<path>.lora_A -> base_model.model.<path>.lora_A.default.weight"""
    return f"base_model.model.{our_name[len(PREFIX):]}.default.weight"


def peft_model(config, ours, lora: LoRAConfig = LORA):
    """transformers' model with our base weights, adapted by peft with our adapters."""
    from transformers import AutoModelForCausalLM

    state = ours.state_dict()
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base.load_state_dict({k[len(PREFIX):]: v for k, v in state.items() if not is_adapter_key(k)}, strict=False)
    targets = sorted({name.rpartition(".")[2] for name in lora_modules(ours)})
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                      target_modules=targets))
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            if is_adapter_key(name):
                theirs[peft_key(name)].copy_(value)
    assert sum(p.requires_grad for p in theirs.values()) == sum(p.requires_grad for p in ours.parameters())
    model.train()
    return model


def peft_loss(model, batch) -> torch.Tensor:
    inputs, labels = batch
    logits = model(input_ids=inputs, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


ARCHITECTURES = ["llama", "qwen3", "gemma3_text"]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_loss_and_adapter_gradients_match_peft(model_type):
    config = tiny_config(model_type)
    ours = lora_hf_model(config)
    theirs = peft_model(config, ours)
    batch = sweep_batch()
    our_loss = ours(*batch).ce_sum / batch[1].numel()
    their_loss = peft_loss(theirs, batch)
    torch.testing.assert_close(our_loss, their_loss, rtol=TOLERANCE, atol=TOLERANCE)
    our_loss.backward()
    their_loss.backward()
    their_params = dict(theirs.named_parameters())
    trained = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter_key(n) for n, _ in trained)
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)
    for name, p in trained:
        torch.testing.assert_close(p.grad, their_params[peft_key(name)].grad, rtol=TOLERANCE, atol=TOLERANCE,
                                   msg=name)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_twenty_steps_match_peft_with_torch_adamw(model_type):
    config = tiny_config(model_type)
    ours = lora_hf_model(config)
    theirs = peft_model(config, ours)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    step = EagerStep(ours, AdamW(trained, weight_decay=WEIGHT_DECAY), max_norm=1.0)
    their_params = [p for p in theirs.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(their_params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WEIGHT_DECAY)
    inputs, labels = sweep_batch()
    for i in range(20):
        batch = (inputs.roll(i, dims=1), labels.roll(i, dims=1))  # a different batch each step
        ours_loss = step([batch], LR).loss
        optimizer.zero_grad()
        loss = peft_loss(theirs, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(their_params, 1.0)
        optimizer.step()
        assert ours_loss == pytest.approx(loss.item(), rel=TOLERANCE, abs=TOLERANCE), i


def test_captured_step_gives_the_eager_losses():
    from titan_tpu.graph.compile import GraphStep

    config = tiny_config("llama")
    losses = {}
    for mode in ("eager", "graph"):
        model = lora_hf_model(config)
        optimizer = AdamW({n: p for n, p in model.named_parameters() if p.requires_grad})
        inputs, labels = sweep_batch()
        if mode == "graph":
            step = GraphStep(model, optimizer, max_norm=1.0, example_batch=(inputs, labels), backend="eager")
        else:
            step = EagerStep(model, optimizer, max_norm=1.0)
        losses[mode] = [step([(inputs.roll(i, dims=1), labels.roll(i, dims=1))], LR).loss for i in range(20)]
    assert losses["graph"] == pytest.approx(losses["eager"], rel=TOLERANCE, abs=TOLERANCE)


def test_bad_input_is_one_line():
    from titan_tpu.models.lora import apply_lora

    model = build_hf_model(hf_args_from_config(tiny_config("llama")))
    with pytest.raises(ValueError, match=r"'qkv' matches no linear layer; the model's are .*q_proj"):
        apply_lora(model, dataclasses.replace(LORA, target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match=r"lora.rank = 4096 is larger than layer .* use at most"):
        apply_lora(model, dataclasses.replace(LORA, rank=4096))
    with pytest.raises(ValueError, match=r"lora.rank = 0 must be >= 1"):
        build_config(None, ["--lora.enabled", "true", "--lora.rank", "0"])
    with pytest.raises(ValueError, match=r"lora.dropout = 0.1 needs training.mode = eager"):
        prepare_run(build_config(None, ["--lora.enabled", "true", "--lora.dropout", "0.1", "--training.mode",
                                        "graph"]))
    with pytest.raises(ValueError, match=r"lora.enabled needs parallelism.tp = 1 \(got 2\).*use data parallelism"):
        prepare_run(build_config(None, ["--lora.enabled", "true", "--parallelism.tp", "2", "--parallelism.dp_shard",
                                        "1"]))


@pytest.mark.parametrize("layout", [dict(scan_layers="true"), dict(ac="full"), dict(scan_layers="true", ac="full")])
def test_native_bad_input_and_dropout_following_the_model_mode(layout):
    """On scanned and checkpointed native models: the same one-line errors; the adapters' dropout
    (computed by block templates that are no submodules) is on in train() and off in eval()."""
    from tests.test_train import LLAMA_DEBUG
    from titan_tpu.models.spec import build, native_spec

    def model(*extra):
        cfg = build_config(LLAMA_DEBUG, ["--lora.enabled", "true", "--lora.rank", "4", "--training.device", "cpu",
                                         "--model.scan_layers", layout.get("scan_layers", "false"),
                                         "--activation_checkpoint.mode", layout.get("ac", "none"), *extra])
        return build(native_spec(cfg.model), cfg, device="cpu", seed=0)

    with pytest.raises(ValueError, match=r"'qkv' matches no linear layer; the model's are .*wq.* \(e.g. layers\."):
        model("--lora.target_modules", "wq,qkv")
    with pytest.raises(ValueError, match=r"lora.rank = 300 is larger than layer layers\..*wq \(256 -> 256\); use "
                                         r"at most 256"):
        model("--lora.rank", "300")
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, dropped = model(), model("--lora.dropout", "0.5")
    with torch.no_grad():
        for linear in [*lora_modules(plain).values(), *lora_modules(dropped).values()]:
            linear._parameters["lora_B"].fill_(0.1)  # B = 0 would hide the adapters' input
        assert not torch.equal(dropped(tokens), plain(tokens))  # train(): dropout on
        plain.eval(), dropped.eval()
        assert torch.equal(dropped(tokens), plain(tokens))


# ---------------------------------------------------------------------------------------------
# Through the trainer: native model, checkpoints, resume, activation checkpointing, graph mode,
# exports.

def _native_cfg(train_overrides, run_dir, **extra):
    from tests.test_train import LLAMA_DEBUG

    values = dict(output_dir=str(run_dir), training__steps=6, training__seq_len=32, training__batch_size=2,
                  training__deterministic="true", validation__enabled="false", checkpoint__interval=3,
                  lora__enabled="true", lora__rank=4, optimizer__lr=1e-2)
    values.update(extra)
    return build_config(LLAMA_DEBUG, train_overrides(**values))


def _losses(run_dir):
    from tests.test_train import train_losses

    return [loss for _, loss in sorted(train_losses(run_dir).items())]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_native_run_freezes_the_base_resumes_exactly_and_matches_under_checkpointing_and_graph(
        tmp_path, train_overrides):
    import shutil

    from titan_tpu.loops import assemble

    trained = assemble(_native_cfg(train_overrides, tmp_path / "run"))
    trained.train()
    straight = _losses(tmp_path / "run")
    parts = trained.components
    assert set(parts.optimizer.state["exp_avg"]) == {n for n, _ in parts.model.named_parameters() if is_adapter_key(n)}
    # The planner counts what the run holds: moments for the adapters only, the base stored beside them.
    from titan_tpu.plan.planner import plan_config

    plan = plan_config(trained.cfg, measure=False)
    moments = sum(t.numel() * t.element_size() for key in ("exp_avg", "exp_avg_sq")
                  for t in trained.components.optimizer.state[key].values())
    assert plan.memory["optimizer_state"] == moments
    assert plan.memory["parameters"] == sum(p.numel() * p.element_size() for p in trained.components.model.parameters())
    # The model line says LoRA is on and how many parameters train.
    from titan_tpu.loops.base import _model_line

    adapters = sum(p.numel() for n, p in parts.model.named_parameters() if is_adapter_key(n))
    assert f"({adapters:,} of them train, LoRA rank {trained.cfg.lora.rank}" in _model_line(parts)

    # Resume from step 3 in another directory: steps 4..6 again, bitwise; its fresh base equals
    # the trained run's base (frozen), its restored adapters differ from a fresh init's.
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-00000003",
                    tmp_path / "resumed" / "checkpoints" / "step-00000003")
    resumed = assemble(_native_cfg(train_overrides, tmp_path / "resumed"))
    for name, p in resumed.components.model.named_parameters():
        if not is_adapter_key(name):
            assert torch.equal(p, dict(trained.components.model.named_parameters())[name]), name
    resumed.train()
    assert _losses(tmp_path / "resumed") == straight[3:]

    for extra in (dict(activation_checkpoint__mode="full"),
                  dict(training__mode="graph", compile__backend="aot_eager")):
        run_dir = tmp_path / next(iter(extra.values()))
        assemble(_native_cfg(train_overrides, run_dir, checkpoint__enabled="false", **extra)).train()
        assert _losses(run_dir) == pytest.approx(straight, rel=TOLERANCE, abs=TOLERANCE), extra


def test_scanned_layers_carry_stacked_adapters_and_give_the_unrolled_losses(tmp_path, train_overrides):
    """Scanned layers hold the adapters stacked like their weights ([L, rank, in]): the same
    initial adapters, checkpoint names and losses as the unrolled run, eagerly and captured (with
    scan's own autograd, and under full checkpointing with its reverse scan)."""
    from titan_tpu.loops import assemble

    unrolled = assemble(_native_cfg(train_overrides, tmp_path / "unrolled", checkpoint__enabled="false"))
    initial = {k: v.clone() for k, v in unrolled.components.model.state_dict().items()}
    unrolled.train()
    straight = _losses(tmp_path / "unrolled")
    for extra in (dict(), dict(training__mode="graph", compile__backend="aot_eager"),
                  dict(training__mode="graph", compile__backend="aot_eager", activation_checkpoint__mode="full")):
        run_dir = tmp_path / "-".join(["scan", *map(str, extra.values())])
        scanned = assemble(_native_cfg(train_overrides, run_dir, checkpoint__enabled="false", model__scan_layers="true",
                                      **extra))
        stacked = dict(scanned.components.model.named_parameters())["layers.attention.wq.lora_A"]
        assert stacked.shape == (6, 4, 256) and stacked.requires_grad
        state = scanned.components.model.state_dict()
        assert state.keys() == initial.keys()
        assert all(torch.equal(state[k], initial[k]) for k in initial)
        scanned.train()
        assert _losses(run_dir) == pytest.approx(straight, rel=TOLERANCE, abs=TOLERANCE), extra
        parts = scanned.components
        trained_names = {n for n, p in parts.model.named_parameters() if p.requires_grad}
        assert set(parts.optimizer.state["exp_avg"]) == trained_names


def _saved_activation_bytes(model, tokens) -> int:
    """Bytes autograd keeps from a forward, distinct storages, the parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens)
    return sum(saved.values())


@pytest.mark.parametrize("extra", [[], ["--lora.dropout", "0.1"]])
def test_planner_counts_the_activations_lora_keeps(extra):
    """The planner's activations of a LoRA run (the adapters' rank-wide intermediates, with dropout
    their dropped inputs and masks, minus what frozen RMSNorm scales no longer keep) against what
    autograd keeps, as it does for full fine-tuning."""
    from tests.test_train import LLAMA_DEBUG
    from titan_tpu.models.spec import build, native_spec
    from titan_tpu.plan.planner import plan_config

    tokens = torch.randint(0, 2048, (4, 256), generator=torch.Generator().manual_seed(0))
    for lora in ("false", "true"):
        cfg = build_config(LLAMA_DEBUG, ["--training.device", "cpu", "--model.dtype", "float32", "--lora.enabled", lora,
                                         "--training.batch_size", "4", "--training.seq_len", "256", *extra])
        planned = plan_config(cfg, measure=False).memory["activations"]
        measured = _saved_activation_bytes(build(native_spec(cfg.model), cfg, device="cpu", seed=0), tokens)
        assert planned == pytest.approx(measured, rel=0.05), lora


def _trained_logits(trainer, tokens):
    trainer.components.model.eval()
    with torch.no_grad():
        return trainer.components.model(tokens)


def _peft_and_merged_logits(base_dir, run_dir, out, tokens):
    """Logits of peft's model (base_dir + the --to-peft export) with its adapter off and on, and of
    transformers' model of the --to-hf --merge-lora export."""
    from transformers import AutoModelForCausalLM

    from titan_tpu.cli import main

    assert main(["convert", "--checkpoint", str(run_dir), "--to-peft", str(out / "peft")]) == 0
    assert main(["convert", "--checkpoint", str(run_dir), "--to-hf", str(out / "merged"), "--merge-lora",
                 "--dtype", "float32"]) == 0
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(out / "peft")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        with adapted.disable_adapter():
            plain = adapted(input_ids=tokens).logits
        return plain, adapted(input_ids=tokens).logits, merged(input_ids=tokens).logits


def test_exports_to_peft_and_merged_hf_give_the_trained_logits(tmp_path, train_overrides, capsys):
    """An HF-backend run started from an HF directory's weights, and a native run (its base written
    as an HF directory): peft's model with the --to-peft export and the --merge-lora export give
    our trained model's logits. The first export names its base, so peft's AutoPeftModelForCausalLM
    loads it alone; the native run's base was a random initialisation, and its export says so in
    one line (with --base-model naming the base it loads alone too)."""
    from transformers import AutoModelForCausalLM

    from titan_tpu.cli import main
    from titan_tpu.evaluation.loss import load_eval_model
    from titan_tpu.loops import assemble
    from titan_tpu.models.spec import checkpoint_spec
    from titan_tpu.train.checkpoint import load_full_state_dict, read_checkpoint_meta

    config = tiny_config("llama")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "hf"))
    hf_run = assemble(_native_cfg(train_overrides, tmp_path / "hf_run", model__name="hf",
                                 model__hf_config=str(tmp_path / "hf"), model__flavor="debug", training__steps=3))
    hf_run.train()
    base = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).named_parameters())
    for name, p in hf_run.components.model.named_parameters():  # started from the directory's weights, kept them
        if not is_adapter_key(name):
            assert torch.equal(p, base[name[len(PREFIX):]]), name

    native_run = assemble(_native_cfg(train_overrides, tmp_path / "native_run", training__steps=3))
    native_run.train()
    step_dir = tmp_path / "native_run" / "checkpoints" / "step-00000003"
    meta = read_checkpoint_meta(step_dir)
    state = {k: v for k, v in load_full_state_dict(step_dir).items() if not is_adapter_key(k)}
    checkpoint_spec(meta["model_name"], meta["model_args"]).save_hf(state, tmp_path / "native_base", overwrite=False)

    for run, base_dir, run_dir in ((hf_run, tmp_path / "hf", tmp_path / "hf_run"),
                                   (native_run, tmp_path / "native_base", tmp_path / "native_run")):
        tokens = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
        ours = _trained_logits(run, tokens)
        plain, adapted, merged = _peft_and_merged_logits(base_dir, run_dir, tmp_path / run_dir.name, tokens)
        assert (plain - ours).abs().max() > 1e-3  # the adapters trained: they change the logits
        torch.testing.assert_close(adapted, ours, rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(merged, ours, rtol=TOLERANCE, atol=TOLERANCE)
        evaluated = load_eval_model(run.cfg, checkpoint=run_dir, device=torch.device("cpu")).model.eval()
        with torch.no_grad():  # titan-tpu eval of the checkpoint evaluates the adapted model
            torch.testing.assert_close(evaluated(tokens), ours, rtol=TOLERANCE, atol=TOLERANCE)
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]  # not progress bars
        if run is hf_run:  # the base recorded: peft loads the adapter by itself, on this machine
            assert notes == [f"note: base_model_name_or_path is the local directory {(tmp_path / 'hf').absolute()}, "
                             "which loads on this machine only: to share the adapter, export with --base-model "
                             "ORG/NAME, the Hub id that directory holds"]
            config = json.loads((tmp_path / run_dir.name / "peft" / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == str((tmp_path / "hf").absolute())
            alone = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / run_dir.name / "peft"),
                                                                 dtype=torch.float32).eval()
            with torch.no_grad():
                torch.testing.assert_close(alone(input_ids=tokens).logits, ours, rtol=TOLERANCE, atol=TOLERANCE)
        else:  # a random initialisation: no base to record, said in one line
            assert len(notes) == 1 and "randomly initialised" in notes[0] and "left empty" in notes[0], notes
            assert main(["convert", "--checkpoint", str(run_dir), "--to-peft", str(tmp_path / "named"),
                         "--base-model", str(base_dir)]) == 0
            alone = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "named"), dtype=torch.float32).eval()
            with torch.no_grad():
                torch.testing.assert_close(alone(input_ids=tokens).logits, ours, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_base_in_the_hugging_face_cache_is_named_by_its_hub_id(tmp_path):
    """A base read from the Hub cache is recorded as the Hub id, which loads on any machine; any
    other directory keeps its path (and the export says so in one line)."""
    from titan_tpu.convert import hub_id_of_cached

    cached = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    assert hub_id_of_cached(cached) == "Qwen/Qwen3-8B"
    assert hub_id_of_cached(tmp_path / "models--Qwen--Qwen3-8B") is None
    assert hub_id_of_cached(tmp_path / "snapshots" / "0123abcd") is None
