"""lm-eval benchmarks of our models (`titan-tpu eval --tasks`, harness.py) against lm-eval's own Hugging
Face backend (HFLM) on the same weights: a tiny transformers Llama saved as an HF directory, run
natively by us. Three offline tasks from local files (multiple choice by log-likelihood, rolling
perplexity, generation with exact match and `until`): the same metrics, and per request the same
log-likelihoods (fp32, 1e-4), greedy flags and generated text."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from data_fixtures import write_chat_tokenizer_dir  # noqa: E402
from harness_fixtures import TASKS, assert_requests_equal, instances, loglikelihood_requests, our_tasks, write_tasks  # noqa: E402

from titan_tpu.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF directory with tokenizer, task folder, the transformers model, its tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("harness")
    hf_dir = write_chat_tokenizer_dir(root / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=400, max_position_embeddings=64, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(hf_dir))
    hf = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    (root / "tasks").mkdir()
    write_tasks(root / "tasks", root / "datasets")
    return hf_dir, root / "tasks", hf, tokenizer


def _bos_tokenizer_dir(hf_dir, directory):
    """The tokenizer of `hf_dir` with a post-processor that starts every text with its BOS, as Llama 3's."""
    import shutil

    import tokenizers
    from tokenizers.processors import TemplateProcessing

    directory.mkdir()
    shutil.copy(hf_dir / "tokenizer_config.json", directory)
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bos = json.loads((hf_dir / "tokenizer_config.json").read_text())["bos_token"]
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _native_twin(hf):
    """Our model (Llama or Qwen3, as the HF config says) holding the transformers model's weights."""
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.hub.adapter import from_hf_state_dict, model_args_from_hf_config

    _, args = model_args_from_hf_config(hf.config.to_dict())
    model = Transformer(args)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=False)
    model.init_buffers()
    return model


@pytest.fixture(scope="module")
def native(setup):
    """Our Llama holding the transformers model's weights."""
    return _native_twin(setup[2])


@pytest.fixture(scope="module")
def hflm(setup):
    from lm_eval.models.huggingface import HFLM

    _, _, hf, tokenizer = setup
    return HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=3)


def logits_scorer(model):
    """A `Scorer` over the model's logits, as the JAX path's scoring program computes it
    (graph/capture.py capture_scoring_step): the harness's other way to its log-likelihoods."""
    import torch

    @torch.no_grad()
    def score(tokens_BS, labels_BS):
        logits_BSV = model(tokens_BS).float()
        labels_BS1 = labels_BS.clamp(min=0).unsqueeze(-1)
        logp_BS = torch.log_softmax(logits_BSV, dim=-1).gather(-1, labels_BS1).squeeze(-1)
        return logp_BS, (logits_BSV.argmax(dim=-1) == labels_BS).float()

    return score


@pytest.fixture(scope="module", params=["plain", "bos", "scored"])
def pair(request, setup, native, hflm, tmp_path_factory):
    """(ours, HFLM) on the same weights and tokenizer; "bos": a tokenizer that adds a BOS to every text;
    "scored": ours through a scorer (padded power-of-two rows, a request a row) instead of logits."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.evaluation.harness import HarnessLM

    hf_dir, _, hf, _ = setup
    if request.param in ("plain", "scored"):
        scorer = logits_scorer(native) if request.param == "scored" else None
        return HarnessLM(native, load_tokenizer(hf_dir), max_length=64, batch_size=4, scorer=scorer), hflm
    tok_dir = _bos_tokenizer_dir(hf_dir, tmp_path_factory.mktemp("bos") / "tok")
    reference = HFLM(pretrained=hf, tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)), batch_size=3)
    assert reference.tok_encode("the")[0] == reference.prefix_token_id  # the BOS is there to match
    return HarnessLM(native, load_tokenizer(tok_dir), max_length=64, batch_size=4), reference


def test_loglikelihoods_equal_hflm(pair):
    ours, hflm = pair
    pairs, documents = loglikelihood_requests()
    assert (ours.prefix_token_id, ours.eot_token_id) == (hflm.prefix_token_id, hflm.eot_token_id)
    assert_requests_equal(ours, hflm, pairs, documents)


def test_generations_equal_hflm(pair):
    ours, hflm = pair
    contexts = ["the cat sat on", "red", "a big dog ran to the house with"]
    whole = hflm.generate_until(instances("generate_until", [(c, {"until": [], "max_gen_toks": 7}) for c in contexts]))
    stop = whole[0][len(whole[0]) // 2:][:2]  # a string HFLM's first continuation holds: there it stops
    greedy = {"until": [stop], "do_sample": False, "max_gen_toks": 7}
    requests = [(c, greedy) for c in contexts] + [("blue door", {"until": ["\n", " the"], "max_gen_toks": 5})]
    expected = hflm.generate_until(instances("generate_until", requests))
    assert stop.strip() and len(expected[0]) < len(whole[0])  # cut at `until`
    assert ours.generate_until(instances("generate_until", requests)) == expected


def test_eval_tasks_command_equals_hflm(setup, hflm, tmp_path, capsys):
    import lm_eval

    hf_dir, tasks_dir, _, _ = setup
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", ",".join(TASKS), "--include-path", str(tasks_dir),
                 "--batch-size", "4", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert all(task in out for task in TASKS)  # lm-eval's table, with its column names (not A, B, C)
    assert out.splitlines()[0].replace(" ", "") == "|Tasks|Version|Filter|n-shot|Metric||Value||Stderr|"
    assert "eval: scoring on cpu (training.device = cpu), the model in fp32" in err  # where it scores, in one line
    written = hf_dir.with_name(hf_dir.name + ".lm_eval.json")  # beside the weights
    ours = json.loads(written.read_text())["results"]

    expected = lm_eval.simple_evaluate(model=hflm, tasks=TASKS, task_manager=our_tasks(tasks_dir),
                                       log_samples=False)["results"]
    for task in TASKS:
        metrics = {k: v for k, v in expected[task].items() if isinstance(v, float) and "stderr" not in k}
        assert metrics, task
        assert {k: ours[task][k] for k in metrics} == pytest.approx(metrics, rel=1e-5), task


def test_eval_tasks_with_output_limit_and_fewshot(setup, tmp_path, capsys):
    hf_dir, tasks_dir, _, _ = setup
    output = tmp_path / "scores.json"
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", "tiny_choice", "--include-path", str(tasks_dir),
                 "--limit", "2", "--num-fewshot", "1", "--output", str(output), "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(output.read_text())
    assert result["n-samples"]["tiny_choice"]["effective"] == 2 and result["n-shot"]["tiny_choice"] == 1


def test_unknown_task_names_the_closest(setup, capsys):
    hf_dir, tasks_dir, _, _ = setup
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", "tiny_choise", "--include-path", str(tasks_dir),
                 "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 2 and "unknown lm-eval task tiny_choise (closest: tiny_choice" in err and err.count("\n") == 1


def test_without_lm_eval_is_one_line_with_the_install(setup, monkeypatch, capsys):
    hf_dir, _, _, _ = setup
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", "hellaswag", "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 2 and "pip install 'lm-eval>=0.4,<0.5'" in err and err.count("\n") == 1


def test_eval_tasks_of_a_training_checkpoint(setup, hflm, tmp_path, capsys):
    """A training checkpoint (here imported from the HF directory): the same scores, the JSON beside its step."""
    import lm_eval

    hf_dir, tasks_dir, _, _ = setup
    assert main(["convert", "--hf-dir", str(hf_dir), "--to-checkpoint", str(tmp_path / "ckpt")]) == 0
    code = main(["eval", "--model.name", "llama3", "--model.flavor", "debug", "--checkpoint", str(tmp_path / "ckpt"),
                 "--data.tokenizer_path", str(hf_dir / "tokenizer.json"), "--tasks", "tiny_choice",
                 "--include-path", str(tasks_dir), "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 0, err
    [written] = (tmp_path / "ckpt").rglob("step-*.lm_eval.json")
    ours = json.loads(written.read_text())["results"]["tiny_choice"]
    expected = lm_eval.simple_evaluate(model=hflm, tasks=["tiny_choice"], log_samples=False,
                                       task_manager=our_tasks(tasks_dir))["results"]["tiny_choice"]
    assert (ours["acc,none"], ours["acc_norm,none"]) == pytest.approx((expected["acc,none"], expected["acc_norm,none"]))


def test_tasks_with_a_token_file_is_one_line(capsys):
    code = main(["eval", "--model.name", "llama3", "--tasks", "hellaswag", "--text", "corpus.txt"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert "--tasks scores lm-eval tasks, not --token-file, --text or --rows" in err


CHATS = [[{"role": "user", "content": "the cat sat on"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "red house"}],
         [{"role": "user", "content": "a dog ran"}, {"role": "assistant", "content": "to the  "}]]


def test_chat_template_renders_as_hflm(setup, native, hflm):
    """lm-eval's apply_chat_template: ours from the tokenizer's template as transformers renders it,
    with the generation prompt and continuing the last message (a prefilled answer)."""
    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.evaluation.harness import HarnessLM
    from titan_tpu.evaluation.lm_eval_tasks import chat_renderer

    hf_dir, _, _, _ = setup
    ours = HarnessLM(native, load_tokenizer(hf_dir), max_length=64, chat=chat_renderer(hf_dir / "tokenizer.json"))
    for chat in CHATS:
        for opened in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=opened) == hflm.apply_chat_template(
                chat, add_generation_prompt=opened), (chat, opened)
    assert ours.chat_template(True) == hflm.tokenizer.chat_template


def test_eval_tasks_with_chat_template_equals_hflm(setup, hflm, tmp_path, capsys):
    """--apply-chat-template with few-shot examples as turns: the scores HFLM gives under lm-eval's
    apply_chat_template."""
    import lm_eval

    hf_dir, tasks_dir, _, _ = setup
    output = tmp_path / "chat.json"
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", ",".join(TASKS), "--include-path", str(tasks_dir),
                 "--apply-chat-template", "--system-instruction", "Be brief.", "--num-fewshot", "1",
                 "--output", str(output), "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 0, err
    ours = json.loads(output.read_text())["results"]
    expected = lm_eval.simple_evaluate(model=hflm, tasks=TASKS, task_manager=our_tasks(tasks_dir), num_fewshot=1,
                                       apply_chat_template=True, system_instruction="Be brief.",
                                       log_samples=False)["results"]
    for task in TASKS:
        metrics = {k: v for k, v in expected[task].items() if isinstance(v, float) and "stderr" not in k}
        assert {k: ours[task][k] for k in metrics} == pytest.approx(metrics, rel=1e-5), task


def test_chat_template_missing_is_one_line(setup, tmp_path, capsys):
    import shutil

    hf_dir, tasks_dir, _, _ = setup
    plain = tmp_path / "plain"
    shutil.copytree(hf_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    code = main(["eval", "--hf-dir", str(plain), "--tasks", "tiny_generate", "--include-path", str(tasks_dir),
                 "--apply-chat-template", "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert "has none; drop --apply-chat-template, or give one with --data.chat_template chatml" in err


def _task_yaml(directory, name: str, source: dict) -> None:
    directory.mkdir(exist_ok=True)
    task = {"task": name, **source, "test_split": "test", "output_type": "multiple_choice",
            "doc_to_text": "{{q}}", "doc_to_choice": "choices", "doc_to_target": "label"}
    (directory / f"{name}.yaml").write_text(json.dumps(task))


def test_task_data_missing_is_one_line_with_the_fetch(setup, tmp_path, monkeypatch, capsys):
    """Offline (as clusters often are): a Hub dataset not in the cache names the fetch command, at once
    (the Hub asked once, not datasets' five retries); a task's local data_files that are not there
    name the YAML's key."""
    import datasets
    import huggingface_hub.utils._http as hub_http

    from titan_tpu.evaluation import lm_eval_tasks

    monkeypatch.setattr(lm_eval_tasks, "hub_reachable", lambda timeout_s=3.0: False)  # a machine without network

    def no_retries(seconds):
        raise AssertionError(f"waited {seconds} s to retry the Hub")

    monkeypatch.setattr(hub_http.time, "sleep", no_retries)
    offline_before = datasets.config.HF_HUB_OFFLINE
    hf_dir = setup[0]
    _task_yaml(tmp_path / "tasks", "remote_task", {"dataset_path": "someorg/never_fetched", "dataset_name": "sub"})
    _task_yaml(tmp_path / "tasks", "local_task", {"dataset_path": "json",
                                                  "dataset_kwargs": {"data_files": {"test": "/no/such.jsonl"}}})
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", "remote_task", "--include-path", str(tmp_path / "tasks"),
                 "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert "lm-eval task remote_task: its data someorg/never_fetched (sub) is not in the datasets cache" in err
    assert "TaskManager().load(['remote_task'])" in err
    assert datasets.config.HF_HUB_OFFLINE == offline_before  # the cache-only mode was for the load alone
    code = main(["eval", "--hf-dir", str(hf_dir), "--tasks", "local_task", "--include-path", str(tmp_path / "tasks"),
                 "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert "lm-eval task local_task: its data files {'test': '/no/such.jsonl'} are missing" in err


def test_native_qwen3_equals_hflm(setup):
    """Qwen3 (QK-norm, tied embeddings) run natively: the same requests' answers as HFLM on it."""
    from lm_eval.models.huggingface import HFLM
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.evaluation.harness import HarnessLM

    hf_dir, _, _, tokenizer = setup
    torch.manual_seed(1)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=400, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    hf = Qwen3ForCausalLM(config).eval()
    native = _native_twin(hf)
    assert native.args.qk_norm
    ours = HarnessLM(native, load_tokenizer(hf_dir), max_length=64, batch_size=4)
    reference = HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=3)
    pairs, documents = loglikelihood_requests()
    assert_requests_equal(ours, reference, pairs, documents)
    requests = [(c, {"until": ["\n"], "max_gen_toks": 6}) for c in ("the cat sat on", "red", "a dog")]
    assert ours.generate_until(instances("generate_until", requests)) == reference.generate_until(
        instances("generate_until", requests))
