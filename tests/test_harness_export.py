"""lm-eval scores of what training writes, read by lm-eval's own Hugging Face backend (HFLM) from the
`convert --to-hf` export as `lm_eval --model hf` reads it: the export holds the tokenizer's special
tokens and the generation defaults, and HFLM on it scores as `titan-tpu eval --tasks` on the checkpoint
(the same metrics, per request the same log-likelihoods within 1e-4 in fp32, greedy flags and
generations). A native run, a LoRA run (adapters folded in on both sides), and a Transformers-backend
model (--model.name hf) against HFLM on its weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from data_fixtures import write_chat_tokenizer_dir  # noqa: E402
from harness_fixtures import TASKS, assert_requests_equal, instances, loglikelihood_requests, write_tasks  # noqa: E402

from titan_tpu.cli import main  # noqa: E402
from titan_tpu.config import build_config  # noqa: E402

LLAMA_DEBUG = "configs/llama3_debug.toml"


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_tasks(root, root / "datasets")
    return root


def _train(run_dir, cache, *extra: str) -> None:
    """A few steps of the debug Llama on the embedded corpus (its BPE trained for the run)."""
    args = ["train", "--config", LLAMA_DEBUG, "--output_dir", str(run_dir), "--data.cache_dir", str(cache),
            "--data.max_bytes", "300000", "--training.device", "cpu", "--training.batch_size", "2",
            "--training.seq_len", "64", "--training.steps", "2", "--lr_scheduler.warmup_steps", "0",
            "--metrics.tensorboard", "false", "--validation.enabled", "false", "--checkpoint.interval", "2", *extra]
    assert main(args) == 0


def _harness(cfg, weights):
    """HarnessLM of what `titan-tpu eval --tasks` loads from `weights` (a checkpoint run or HF directory)."""
    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.evaluation.harness import HarnessLM
    from titan_tpu.evaluation.loss import load_eval_model

    loaded = load_eval_model(cfg, checkpoint=weights, device=torch.device("cpu"))
    tokenizer = cfg.data.tokenizer_path or loaded.tokenizer
    return HarnessLM(loaded.model, load_tokenizer(tokenizer), max_length=loaded.max_len, batch_size=4)


def _assert_requests_equal(ours, hflm) -> None:
    """Per request: log-likelihoods (1e-4), greedy flags, rolling log-likelihoods and greedy generations."""
    assert (ours.prefix_token_id, ours.eot_token_id) == (hflm.prefix_token_id, hflm.eot_token_id)
    pairs, documents = loglikelihood_requests()
    # a pair this tokenizer merges across the boundary ("dog" + "s") leaves no continuation to score
    pairs = [pair for pair in pairs if not pair[0] or ours._encode_pair(*pair)[1]]
    assert_requests_equal(ours, hflm, pairs, documents)
    requests = [(context, {"until": ["\n"], "max_gen_toks": 6}) for context in ("the cat sat on", "red", "a dog")]
    assert ours.generate_until(instances("generate_until", requests)) == hflm.generate_until(
        instances("generate_until", requests))


def _lm_eval_command_metrics(export, tasks_dir, output) -> dict:
    """`lm-eval run --model hf` on the export, as a user runs it beside us (its own process)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
               f"pretrained={export},dtype=float32", "--device", "cpu", "--tasks", ",".join(TASKS), "--include_path",
               str(tasks_dir), "--batch_size", "3", "--output_path", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [written] = output.rglob("results_*.json")
    return json.loads(written.read_text())["results"]


def _assert_metrics_equal(ours: dict, expected: dict) -> None:
    for task in TASKS:
        metrics = {k: v for k, v in expected[task].items() if isinstance(v, float) and "stderr" not in k}
        assert metrics, task
        assert {k: ours[task][k] for k in metrics} == pytest.approx(metrics, rel=1e-5), task


def test_export_reads_as_lm_eval_hf_and_scores_as_the_checkpoint(tmp_path, data_cache, tasks_dir, capsys):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, GenerationConfig

    run, export = tmp_path / "run", tmp_path / "export"
    _train(run, data_cache)
    assert main(["convert", "--checkpoint", str(run), "--to-hf", str(export), "--dtype", "float32"]) == 0

    # What the HF readers take from the directory: the tokenizer's ids everywhere, greedy by default.
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"  # the run's BPE has one special token
    config = json.loads((export / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(str(export))
    for ids in (config, generation.to_dict()):
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert generation.do_sample is False
    assert tokenizer.decode(tokenizer("a , b .")["input_ids"]) == "a , b ."  # decoded as ours: spaces kept

    code = main(["eval", "--checkpoint", str(run), "--tasks", ",".join(TASKS), "--include-path", str(tasks_dir),
                 "--model.name", "llama3", "--model.flavor", "debug", "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 0, err
    [written] = run.rglob("step-*.lm_eval.json")
    _assert_metrics_equal(json.loads(written.read_text())["results"],
                          _lm_eval_command_metrics(export, tasks_dir, tmp_path / "lm_eval_out"))

    cfg = build_config(LLAMA_DEBUG, ["--training.device", "cpu"])
    _assert_requests_equal(_harness(cfg, run), HFLM(pretrained=str(export), batch_size=3, device="cpu"))


def test_chat_run_export_keeps_its_template(tmp_path, data_cache):
    """A run whose data.chat_template chose the built-in ChatML: the export's tokenizer renders it."""
    from transformers import AutoTokenizer

    from titan_tpu.convert import checkpoint_to_hf

    run = tmp_path / "run"
    _train(run, data_cache, "--training.steps", "1", "--checkpoint.interval", "1")
    config = json.loads((run / "config.json").read_text())
    config["data"]["chat_template"] = "chatml"  # as a chat run records it
    (run / "config.json").write_text(json.dumps(config))
    checkpoint_to_hf(run, tmp_path / "export", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_lora_checkpoint_scores_as_its_merged_export(tmp_path, data_cache):
    from lm_eval.models.huggingface import HFLM

    run, export = tmp_path / "run", tmp_path / "merged"
    _train(run, data_cache, "--lora.enabled", "true", "--lora.rank", "4", "--optimizer.lr", "1e-2")
    assert main(["convert", "--checkpoint", str(run), "--to-hf", str(export), "--merge-lora", "--dtype",
                 "float32"]) == 0
    from titan_tpu.convert import resolve_checkpoint
    from titan_tpu.models.lora import is_adapter_key
    from titan_tpu.train.checkpoint import load_full_state_dict

    saved = load_full_state_dict(resolve_checkpoint(run))
    assert any(is_adapter_key(k) and "lora_b" in k.lower() and v.abs().max() > 0 for k, v in saved.items())  # trained
    ours = _harness(build_config(LLAMA_DEBUG, ["--training.device", "cpu"]), run)  # eval folds the adapters in
    _assert_requests_equal(ours, HFLM(pretrained=str(export), batch_size=3, device="cpu"))


def test_transformers_backend_equals_hflm(tmp_path, tasks_dir, capsys):
    """--model.name hf (a tiny Qwen2 from its model_type and hf_overrides, seeded): HarnessLM over it
    against HFLM on its weights, written as an HF directory with the tokenizer."""
    from lm_eval.models.huggingface import HFLM

    from titan_tpu.evaluation.loss import load_eval_model

    tok_dir = write_chat_tokenizer_dir(tmp_path / "tok")
    overrides = json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 400,
                            "max_position_embeddings": 64, "tie_word_embeddings": False})
    cfg = build_config(None, ["--model.name", "hf", "--model.hf_config", "qwen2", "--model.hf_overrides", overrides,
                              "--data.tokenizer_path", str(tok_dir / "tokenizer.json"), "--training.device", "cpu"])
    loaded = load_eval_model(cfg, device=torch.device("cpu"))
    assert loaded.spec.kind == "hf" and loaded.spec.args.transformers_config().model_type == "qwen2"
    hf_dir = loaded.spec.save_hf(loaded.model.state_dict(), tmp_path / "hf", overwrite=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, hf_dir / name)

    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.evaluation.harness import HarnessLM

    ours = HarnessLM(loaded.model, load_tokenizer(tok_dir), max_length=loaded.max_len, batch_size=4)
    _assert_requests_equal(ours, HFLM(pretrained=str(hf_dir), batch_size=3, device="cpu"))


def test_a_chat_tokenizers_end_of_turn_stops_generation_with_its_end_of_text(tmp_path):
    """A run on a chat model's tokenizer (eos_token <|im_end|>, its own template): the export keeps both,
    and generate stops at either."""
    from transformers import AutoTokenizer, GenerationConfig

    from titan_tpu.export_files import write_export_files

    tok_dir = write_chat_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    write_export_files(tmp_path / "export", tokenizer_json=tok_dir / "tokenizer.json")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert tokenizer.chat_template == json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["eos_token_id"] == ids[1]
    assert GenerationConfig.from_pretrained(str(tmp_path / "export")).eos_token_id == sorted(ids)
