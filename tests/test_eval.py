"""`titan-tpu eval` of any model train takes: HF directories of any causal-LM type (against
transformers' own loss), an HF type with overrides, a native flavor with a training checkpoint; on a
token file or a text corpus."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from titan_tpu.cli import main  # noqa: E402
from titan_tpu.data.tokenizer import load_tokenizer, train_bpe_tokenizer  # noqa: E402
from titan_tpu.tools import hf_sweep  # noqa: E402

TYPES = ["bloom", "gemma2", "gpt2", "phi3", "olmo2", "llama"]  # llama: read by the native adapter


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _save(path, model_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_sweep.tiny_config(model_type)).save_pretrained(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def _reference_losses(ref, sequences):
    with torch.no_grad():
        return [F.cross_entropy(ref(input_ids=torch.tensor([s[:-1]])).logits[0].float(), torch.tensor(s[1:])).item()
                for s in sequences]


@pytest.mark.parametrize("model_type", TYPES)
def test_eval_of_an_hf_directory_equals_transformers(tmp_path, capsys, model_type):
    ref = _save(tmp_path / "hf", model_type)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 30)]
    (tmp_path / "tokens.json").write_text(json.dumps(sequences))
    result = _run(capsys, "eval", "--hf-dir", str(tmp_path / "hf"), "--token-file", str(tmp_path / "tokens.json"),
                  "--device", "cpu")
    assert result["backend"] == ("native" if model_type == "llama" else "hf")
    expected = _reference_losses(ref, sequences)
    assert result["per_sequence_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    mean = (expected[0] * 6 + expected[1] * 29) / 35
    assert result["loss"] == pytest.approx(mean, rel=1e-5) and result["perplexity"] == pytest.approx(math.exp(mean))


def test_eval_on_text_with_the_directory_tokenizer(tmp_path, capsys):
    ref = _save(tmp_path / "hf", "gpt2")
    text = "def add(a, b):\n    return a + b\n\n" * 40
    train_bpe_tokenizer([text], vocab_size=300, save_path=tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "corpus.txt").write_text(text)
    result = _run(capsys, "eval", "--hf-dir", str(tmp_path / "hf"), "--text", str(tmp_path / "corpus.txt"),
                  "--seq-len", "16", "--max-tokens", "100", "--device", "cpu")
    tokenizer = load_tokenizer(tmp_path / "hf" / "tokenizer.json")
    stream = (tokenizer.encode(text) + [tokenizer.eos_id])[:101]
    windows = [stream[i:i + 17] for i in range(0, 100, 16)]
    assert result["num_tokens"] == 100 and result["num_sequences"] == len(windows)
    assert result["per_sequence_loss"] == pytest.approx(_reference_losses(ref, windows), rel=1e-5, abs=1e-5)


def test_eval_of_an_hf_type_with_overrides_and_of_a_native_checkpoint(tmp_path, capsys, train_overrides):
    (tmp_path / "tokens.json").write_text(json.dumps([[1, 2, 3, 4, 5, 6]]))
    result = _run(capsys, "eval", "--model.name", "hf", "--model.hf_config", "qwen3", "--model.hf_overrides",
                  "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
                  "num_key_value_heads=2,vocab_size=512", "--token-file", str(tmp_path / "tokens.json"),
                  "--device", "cpu")
    assert result["model"] == "hf:qwen3" and result["weights"].startswith("initialised")
    assert abs(result["loss"] - math.log(512)) < 1.0  # a fresh init predicts about uniformly

    # A native flavor trained for 2 steps: eval of its run directory on text (the run's tokenizer).
    assert main(["train", "--model.name", "llama3", "--model.flavor", "debug",
                 *train_overrides(training__steps=2, validation__enabled="false")]) == 0
    capsys.readouterr()
    (tmp_path / "corpus.txt").write_text("import os\nprint(os.getcwd())\n" * 50)
    result = _run(capsys, "eval", "--model.name", "llama3", "--model.flavor", "debug", "--checkpoint",
                  str(tmp_path / "run"), "--text", str(tmp_path / "corpus.txt"), "--seq-len", "64", "--device", "cpu")
    assert result["backend"] == "native" and result["weights"].endswith("step-00000002")
    assert result["num_tokens"] > 64 and 0 < result["loss"] < 10


@pytest.mark.parametrize("argv, message", [
    (["--token-file", "x.json"], "model.name = hf needs --model.hf_config"),
    (["--model.name", "llama3"], "exactly one of --token-file"),
    (["--model.name", "llama3", "--text", "."], "eval --text needs a tokenizer"),
])
def test_eval_bad_input_is_one_line(capsys, argv, message):
    code = main(["eval", *argv, "--device", "cpu"]) if argv[0] != "--token-file" else \
        main(["eval", "--model.name", "hf", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and err.count("\n") == 1
