"""Generation (titan_tpu/generate) against transformers' `generate` on the same weights: greedy
tokens for every native family (their HF conversions) and two Transformers-backend architectures,
a batch of prompts of different lengths; the cached decode against recomputing the whole prefix
(and the reported log-probs against a training forward's); seeded sampling and its filters against
transformers' warpers; stopping; the decode step compiled once; `titan-tpu generate` on an HF
directory, on chat prompts, on a LoRA run (against peft); one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tests.test_deepseek_v3 as deepseek_v3  # noqa: E402
import tests.test_hf_parity as dense  # noqa: E402
import tests.test_moe as qwen3_moe  # noqa: E402
from titan_tpu.cli import main  # noqa: E402
from titan_tpu.config import Config  # noqa: E402
from titan_tpu.evaluation.loss import load_eval_model  # noqa: E402
from titan_tpu.generate import Sampling, generate  # noqa: E402
from titan_tpu.generate.decoders import decoder_for  # noqa: E402
from titan_tpu.generate.sampling import filtered_logits  # noqa: E402
from titan_tpu.models.hub.adapter import from_hf_state_dict  # noqa: E402
from titan_tpu.models.registry import build_model  # noqa: E402
from titan_tpu.tools.hf_sweep import tiny_config  # noqa: E402

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 11, 8)
TOLERANCE = 1e-5

# (HF model with strong random weights, our args) per native family, from the parity tests.
NATIVE = {
    "llama3": lambda: _dense("llama_gqa_scaled"),
    "qwen3": lambda: _dense("qwen3_gqa_headdim_tied"),
    "qwen3_moe": lambda: _random(qwen3_moe, qwen3_moe.tiny_args()),
    "deepseek_v3": lambda: _random(deepseek_v3, deepseek_v3.tiny_args()),  # MLA, YaRN, dense then MoE layers
}
HF_BACKEND = ["gpt2", "phi3"]  # learned absolute positions; a fused qkv projection


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one intra-op thread is as fast, and a loaded machine's thread contention (two
    threads slowed these tests tenfold there) cannot stretch them."""


def _dense(case: str):
    name, args = dense.CASES[case]
    return dense._hf_model(name, args), args


def _random(module, args):
    return module.random_hf_model(args), args


def prompts_for(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_generate(hf, prompts: list[list[int]], **kwargs) -> torch.Tensor:
    """transformers' generate of a left-padded batch (its own layout): the new tokens [B, N]."""
    P = max(map(len, prompts))
    ids_BP = torch.zeros(len(prompts), P, dtype=torch.long)
    mask_BP = torch.zeros_like(ids_BP)
    for b, prompt in enumerate(prompts):
        ids_BP[b, P - len(prompt):] = torch.tensor(prompt)
        mask_BP[b, P - len(prompt):] = 1
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": None, "pad_token_id": 0, **kwargs}
    with torch.no_grad():
        return hf.generate(input_ids=ids_BP, attention_mask=mask_BP, **kwargs)[:, P:]


@pytest.fixture(scope="module", params=list(NATIVE))
def native(request):
    """(family, transformers' model, our model with its weights)."""
    hf, args = NATIVE[request.param]()
    model = build_model(args)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    return request.param, hf, model.eval()


def _save_hf(path: Path, model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def _hf_backend(path: Path):
    cfg = Config()
    cfg.model.name, cfg.model.hf_config = "hf", str(path)
    return load_eval_model(cfg, checkpoint=str(path), device=torch.device("cpu"))


@pytest.fixture(scope="module", params=HF_BACKEND)
def hf_backend(request, tmp_path_factory):
    """(transformers' model of a saved tiny directory, our Transformers-backend model of it)."""
    path = tmp_path_factory.mktemp(request.param)
    reference = _save_hf(path, request.param)
    loaded = _hf_backend(path)
    assert loaded.spec.kind == "hf"
    return reference, loaded.model.eval()


def test_native_greedy_equals_transformers_generate(native):
    family, hf, model = native
    prompts = prompts_for(model.args.vocab_size)
    ours = generate(model, prompts, max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours.tokens_BN, hf_generate(hf, prompts)), family
    assert ours.lengths_B.tolist() == [NEW_TOKENS] * 3 and not ours.stopped_B.any()


def test_hf_backend_greedy_equals_transformers_generate(hf_backend):
    reference, model = hf_backend
    prompts = prompts_for(reference.config.vocab_size)
    assert torch.equal(generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens_BN, hf_generate(reference, prompts))


def _check_cache_against_the_whole_prefix(model):
    """Each decode step's logits against a forward of each row's whole sequence so far (no cache),
    and the reported log-probs against that forward's log-softmax (a training forward's)."""
    decoder = decoder_for(model)
    prompts = prompts_for(decoder.vocab_size, lengths=(3, 9, 6))
    result = generate(model, prompts, max_new_tokens=12)
    with torch.no_grad():
        stepped = [decoder.prefill(prompts, length=9 + 12)]
        stepped += [decoder.step(result.tokens_BN[:, n]) for n in range(11)]
    for b, prompt in enumerate(prompts):
        sequence = torch.tensor([prompt + result.completion(b)])
        with torch.no_grad():
            logits_NV = model(sequence)[0, len(prompt) - 1:-1]
        ours_NV = torch.stack([logits[b] for logits in stepped])
        torch.testing.assert_close(ours_NV, logits_NV, rtol=TOLERANCE, atol=TOLERANCE * logits_NV.abs().max().item())
        logprobs_N = logits_NV.float().log_softmax(-1).gather(-1, result.tokens_BN[b].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(result.logprobs_BN[b], logprobs_N, rtol=TOLERANCE, atol=TOLERANCE)


def test_native_cached_decode_equals_recomputing_the_prefix(native):
    _check_cache_against_the_whole_prefix(native[2])


def test_hf_backend_cached_decode_equals_recomputing_the_prefix(hf_backend):
    _check_cache_against_the_whole_prefix(hf_backend[1])


def test_mla_caches_the_compressed_latent_and_the_rope_key():
    args = deepseek_v3.tiny_args()
    cache = build_model(args).kv_cache(batch=2, length=10)
    mla = args.mla
    assert [tuple(t.shape) for t in cache.buffers[0]] == [(2, 10, mla.kv_lora_rank), (2, 10, 1, mla.qk_rope_head_dim)]
    per_token = sum(t[0, 0].numel() for t in cache.buffers[0])
    assert per_token == 24 < 2 * args.n_heads * mla.qk_head_dim  # not every head's key and value


# ---------------------------------------------------------------------------------------------
# Sampling and stopping
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits_BV = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    theirs = TemperatureLogitsWarper(temperature)(None, logits_BV)
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    ours = filtered_logits(logits_BV, Sampling(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()])


def test_sampled_output_is_reproducible_from_the_seed():
    hf, args = NATIVE["llama3"]()
    model = build_model(args)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args))
    prompts = prompts_for(args.vocab_size)
    sampling = Sampling(temperature=1.0, top_k=40, top_p=0.95)
    first, again, other = (generate(model, prompts, max_new_tokens=16, sampling=sampling, seed=seed)
                           for seed in (1, 1, 2))
    assert torch.equal(first.tokens_BN, again.tokens_BN) and torch.equal(first.logprobs_BN, again.logprobs_BN)
    assert not torch.equal(first.tokens_BN, other.tokens_BN)
    greedy = generate(model, prompts, max_new_tokens=16)
    assert not torch.equal(first.tokens_BN, greedy.tokens_BN)  # it samples


def test_rows_stop_at_a_stop_token_as_transformers_does(native):
    family, hf, model = native
    if family != "qwen3":
        pytest.skip("one family is enough")
    prompts = prompts_for(model.args.vocab_size)
    eos = int(generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens_BN[0, 5])
    ours = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_ids={eos})
    theirs = hf_generate(hf, prompts, eos_token_id=eos)
    assert ours.stopped_B[0] and ours.lengths_B[0] <= 6 and ours.completion(0)[-1] == eos
    assert torch.equal(ours.tokens_BN[:, :theirs.shape[1]], theirs)  # finished rows padded with 0, as theirs
    assert not ours.tokens_BN[:, theirs.shape[1]:].any()


# ---------------------------------------------------------------------------------------------
# The compiled decode step
# ---------------------------------------------------------------------------------------------


def _counting(backend):
    """A Dynamo backend that counts the graphs it compiles, then hands them to `backend`."""
    def compile_graph(graph_module, example_inputs):
        compile_graph.graphs += 1
        return backend(graph_module, example_inputs)

    compile_graph.graphs = 0
    return compile_graph


def _graphs_per_step(model, prompts, backend) -> tuple[list[int], torch.Tensor]:
    """The number of graphs compiled so far at each step, and the tokens."""
    counts = []
    result = generate(model, prompts, max_new_tokens=8, compile_backend=backend,
                      on_step=lambda tokens_B, live_B: counts.append(backend.graphs))
    return counts, result.tokens_BN


def test_native_decode_step_compiles_once_with_inductor_and_gives_the_eager_tokens():
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    args = dense.CASES["llama_gqa_scaled"][1]
    model = build_model(dataclasses_replace(args, n_layers=1)).eval()
    prompts = prompts_for(args.vocab_size)
    backend = _counting(compile_fx)
    counts, tokens_BN = _graphs_per_step(model, prompts, backend)
    assert counts[0] == 0 and counts[1] == 1 and counts[-1] == 1  # compiled at the first decode step, once
    assert torch.equal(tokens_BN, generate(model, prompts, max_new_tokens=8).tokens_BN)
    torch._dynamo.reset()


def test_hf_backend_decode_step_uses_a_static_cache_and_compiles_once(tmp_path):
    torch._dynamo.reset()
    _save_hf(tmp_path, "phi3")
    model = _hf_backend(tmp_path).model.eval()
    prompts = prompts_for(model.hf_model.config.vocab_size)
    backend = _counting(lambda graph_module, example_inputs: graph_module.forward)  # no code generated
    counts, tokens_BN = _graphs_per_step(model, prompts, backend)
    assert counts[1] >= 1 and counts[-1] == counts[1]  # compiled at the first decode step only
    assert torch.equal(tokens_BN, generate(model, prompts, max_new_tokens=8).tokens_BN)
    torch._dynamo.reset()


def dataclasses_replace(args, **changes):
    import dataclasses

    return dataclasses.replace(args, **changes)


# ---------------------------------------------------------------------------------------------
# titan-tpu generate
# ---------------------------------------------------------------------------------------------


def _chat_model_dir(path: Path) -> Path:
    from tests.data_fixtures import write_chat_tokenizer_dir

    _save_hf(path, "qwen3")
    write_chat_tokenizer_dir(path, vocab_size=tiny_config("qwen3").vocab_size)
    return path


def _chat_template_ids(directory: Path, messages: list[dict]) -> list[int]:
    """transformers' apply_chat_template(add_generation_prompt=True, tokenize=True) of the directory."""
    ids = transformers.AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("marks", [True, False], ids=["generation_blocks", "plain"])
def test_chat_prompts_render_as_transformers_apply_chat_template(tmp_path, marks):
    from tests.data_fixtures import CHATML_GENERATION, CHATML_PLAIN, conversations, write_chat_tokenizer_dir
    from titan_tpu.data.chat import ChatRenderer, load_chat_template
    from titan_tpu.data.tokenizer import load_tokenizer

    directory = write_chat_tokenizer_dir(tmp_path, template=CHATML_GENERATION if marks else CHATML_PLAIN)
    template, special = load_chat_template(directory)
    renderer = ChatRenderer(template, load_tokenizer(directory), special_tokens=special)
    for row in conversations(4, seed=1):
        messages = row["messages"][:-1]  # up to the last user turn
        assert renderer.prompt_ids(messages, where="row") == _chat_template_ids(directory, messages)


def test_generate_command_on_an_hf_directory(tmp_path, capsys):
    """A single prompt streams the greedy completion; a prompts file of text, chat and token-id rows
    gives JSON lines whose tokens are the library's."""
    from titan_tpu.data.tokenizer import load_tokenizer

    directory = _chat_model_dir(tmp_path / "hf")
    tokenizer = load_tokenizer(directory)
    model = _hf_backend(directory).model.eval()
    prompt = tokenizer.encode_prompt("alpha beta gamma")
    want = generate(model, [prompt], max_new_tokens=12).completion(0)

    assert main(["generate", "--hf-dir", str(directory), "--prompt", "alpha beta gamma", "--max-new-tokens", "12",
                 "--ignore-eos", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(want) + "\n"

    messages = [{"role": "user", "content": "delta epsilon"}]
    rows = [{"prompt": "alpha beta gamma"}, {"messages": messages}, {"token_ids": [5, 6, 7, 8]}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["generate", "--hf-dir", str(directory), "--prompts-file", str(tmp_path / "prompts.jsonl"),
                 "--max-new-tokens", "12", "--ignore-eos", "--json", "--device", "cpu"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    chat = _chat_template_ids(directory, messages)
    want = generate(model, [prompt, chat, [5, 6, 7, 8]], max_new_tokens=12)
    assert [r["tokens"] for r in records] == [want.completion(i) for i in range(3)]
    assert [r["prompt"] for r in records] == ["alpha beta gamma", messages, [5, 6, 7, 8]]
    assert all(r["finish"] == "length" and r["completion"] == tokenizer.decode(r["tokens"]) for r in records)


def test_generate_command_on_a_lora_run_equals_peft(tmp_path, train_overrides, capsys):
    """A native LoRA run (adapters merged on the fly) generates what transformers' generate gives
    with peft's model of the same base and the --to-peft export."""
    peft = pytest.importorskip("peft")
    from tests.test_lora import _native_cfg
    from titan_tpu.loops import assemble
    from titan_tpu.models.lora import is_adapter_key
    from titan_tpu.models.spec import checkpoint_spec
    from titan_tpu.train.checkpoint import load_full_state_dict, read_checkpoint_meta

    run_dir = tmp_path / "run"
    assemble(_native_cfg(train_overrides, run_dir, training__steps=3)).train()
    step_dir = run_dir / "checkpoints" / "step-00000003"
    meta = read_checkpoint_meta(step_dir)
    base = {k: v for k, v in load_full_state_dict(step_dir).items() if not is_adapter_key(k)}
    checkpoint_spec(meta["model_name"], meta["model_args"]).save_hf(base, tmp_path / "base", overwrite=False)
    assert main(["convert", "--checkpoint", str(run_dir), "--to-peft", str(tmp_path / "peft")]) == 0

    prompts = prompts_for(500, lengths=(4, 9, 6))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run_dir), "--prompts-file", str(tmp_path / "prompts.jsonl"),
                 "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json", "--device", "cpu"]) == 0
    ours = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "peft")).eval()
    assert ours == hf_generate(adapted, prompts).tolist()
    with adapted.disable_adapter():  # the adapters change what is generated
        assert ours != hf_generate(adapted, prompts).tolist()


def _one_line_error(capsys, argv: list[str], match: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    return err


def test_a_checkpoint_whose_model_cannot_be_built_is_one_line(tmp_path, capsys):
    """A run whose recorded model args this version cannot build, and an HF directory of a model
    type transformers does not know."""
    from titan_tpu.train.checkpoint import STATE_FILE

    hf_dir = _chat_model_dir(tmp_path / "hf")
    assert main(["convert", "--hf-dir", str(hf_dir), "--to-checkpoint", str(tmp_path / "ckpt")]) == 0
    state_file = next((tmp_path / "ckpt").glob(f"step-*/{STATE_FILE}"))
    meta = json.loads(state_file.read_text())
    meta["model_args"]["attention_sinks"] = 4  # a key from another version of the model
    state_file.write_text(json.dumps(meta))
    _one_line_error(capsys, ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "alpha",
                             "--tokenizer", str(hf_dir), "--device", "cpu"], "cannot build the model of")

    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model",
                                                    "architectures": ["NoSuchModelForCausalLM"]}))
    _one_line_error(capsys, ["generate", "--hf-dir", str(hf_dir), "--prompt", "alpha", "--device", "cpu"],
                    f"model.hf_config {hf_dir} with model.hf_overrides {{}} is not a valid config")


@pytest.mark.parametrize("rows, match", [
    ([{"text": "alpha"}], "line 1 needs exactly one of the keys prompt, messages, token_ids"),
    ([{"token_ids": [1, 2]}, {"token_ids": [1, 99999]}], "prompt 1 has token id 99999 outside"),
    ([{"token_ids": []}], "prompt 0 is empty"),
])
def test_bad_prompts_are_one_line(tmp_path, capsys, rows, match):
    directory = _chat_model_dir(tmp_path / "hf")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _one_line_error(capsys, ["generate", "--hf-dir", str(directory), "--prompts-file", str(tmp_path / "prompts.jsonl"),
                             "--device", "cpu"], match)
    _one_line_error(capsys, ["generate", "--hf-dir", str(directory), "--device", "cpu"], "needs --prompt")
    _one_line_error(capsys, ["generate", "--hf-dir", str(directory), "--prompt", "a", "--top-p", "0", "--device",
                             "cpu"], "top_p = 0.0 must be in (0, 1]")


@pytest.mark.parametrize("scan_layers, ac_mode", [(True, "none"), (False, "full"), (True, "full")])
def test_a_model_as_training_builds_it_generates_the_cached_tokens(scan_layers, ac_mode):
    """Scanned layers or checkpointed blocks (no cached path; a model scored during training):
    every step's whole forward gives transformers' greedy tokens."""
    hf, args = NATIVE["llama3"]()
    model = build_model(args, scan_layers=scan_layers, ac_mode=ac_mode)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    assert not model.decodes_with_cache
    prompts = prompts_for(model.args.vocab_size)
    ours = generate(model.eval(), prompts, max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours.tokens_BN, hf_generate(hf, prompts))
