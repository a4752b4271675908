"""The titan-tpu command line: train, eval, convert, and its one-line errors."""

import json
from pathlib import Path

import pytest
import torch

from titan_tpu.cli import main
from titan_tpu.models.common.transformer import RopeScaling, TransformerArgs
from titan_tpu.models.hub.checkpoint import load_hf_checkpoint, load_model_from_hf, save_hf_checkpoint
from titan_tpu.models.registry import build_model
from titan_tpu.train.checkpoint import load_checkpoint

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LLAMA_DEBUG = str(CONFIGS / "llama3_debug.toml")

TINY = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden_dim=160,
                       rope_theta=500000.0, rope_scaling=RopeScaling(original_max_position_embeddings=32),
                       max_seq_len=64)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def tiny_hf_dir(tmp_path):
    model = build_model(TINY, seed=0)
    return save_hf_checkpoint(tmp_path / "hf", name="llama3", args=TINY, state_dict=model.state_dict())


def test_eval_matches_transformers(tmp_path, tiny_hf_dir, capsys):
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 40)]
    token_file = tmp_path / "tokens.json"
    token_file.write_text(json.dumps(sequences))
    code, out, err = run_cli(capsys, "eval", "--hf-dir", str(tiny_hf_dir), "--token-file", str(token_file),
                             "--device", "cpu")
    assert code == 0, err
    result = json.loads(out)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    for i, seq in enumerate(sequences):
        ids = torch.tensor([seq])
        with torch.no_grad():
            ref = hf(ids, labels=ids).loss.item()  # transformers shifts the labels itself
        assert result["per_sequence_loss"][i] == pytest.approx(ref, rel=1e-5)
        total, count = total + ref * (len(seq) - 1), count + len(seq) - 1
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)
    assert result["num_tokens"] == count


@pytest.mark.parametrize("content, message", [
    ([[1, 2, 128]], "token id 128 outside the vocabulary [0, 128)"),
    ([[1, -1]], "token id -1 outside"),
    ([[1]], "needs at least 2"),
    ({"a": 1}, "must hold a non-empty JSON list of lists"),
])
def test_eval_bad_token_file(tmp_path, tiny_hf_dir, capsys, content, message):
    token_file = tmp_path / "tokens.json"
    token_file.write_text(json.dumps(content))
    code, out, err = run_cli(capsys, "eval", "--hf-dir", str(tiny_hf_dir), "--token-file", str(token_file))
    assert code == 2 and message in err and err.count("\n") == 1


def test_eval_hf_dir_with_missing_tensor(tmp_path, tiny_hf_dir, capsys):
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_hf_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_hf_dir / "model.safetensors", metadata={"format": "pt"})
    token_file = tmp_path / "tokens.json"
    token_file.write_text("[[1, 2, 3]]")
    code, _, err = run_cli(capsys, "eval", "--hf-dir", str(tiny_hf_dir), "--token-file", str(token_file))
    assert code == 2 and "model.layers.1.mlp.up_proj.weight" in err and err.count("\n") == 1


def test_convert_round_trip_and_finetune_start(tmp_path, train_overrides, capsys):
    code, out, err = run_cli(capsys, "train", "--config", LLAMA_DEBUG,
                             *train_overrides(training__steps=2, validation__enabled="false"))
    assert code == 0, err
    assert "checkpoint: " in out and "step-00000002" in out
    code, _, err = run_cli(capsys, "convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf"),
                           "--dtype", "float32")
    assert code == 0, err
    # The run's tokenizer goes along, so the export is usable on its own.
    assert (tmp_path / "hf/tokenizer.json").read_bytes() == (tmp_path / "run/tokenizer.json").read_bytes()

    # The export carries the trained weights: logits equal those of the checkpointed model.
    state = load_checkpoint(tmp_path / "run/checkpoints/step-00000002")
    name, args, exported = load_model_from_hf(tmp_path / "hf")
    trained = build_model(args)
    trained.load_state_dict(state["model"])
    tokens = torch.randint(0, args.vocab_size, (1, 32))
    torch.testing.assert_close(exported(tokens), trained(tokens), rtol=0, atol=0)

    # By default the export is in bfloat16, as models are served: the trained weights rounded once.
    code, _, err = run_cli(capsys, "convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "bf16"))
    assert code == 0, err
    _, _, served = load_hf_checkpoint(tmp_path / "bf16")
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    for key, value in state["model"].items():
        assert torch.equal(served[key], value.to(torch.bfloat16)), key

    # Converting onto an existing export without --overwrite refuses and leaves it whole.
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    code, _, err = run_cli(capsys, "convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf"))
    assert code == 2 and "--overwrite" in err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before

    # HF -> checkpoint, then a new run starts from those weights.
    code, _, err = run_cli(capsys, "convert", "--hf-dir", str(tmp_path / "hf"), "--to-checkpoint",
                           str(tmp_path / "imported"))
    assert code == 0, err
    imported = load_checkpoint(tmp_path / "imported/step-00000000")
    assert (tmp_path / "imported/tokenizer.json").read_bytes() == (tmp_path / "hf/tokenizer.json").read_bytes()
    for key, value in state["model"].items():
        torch.testing.assert_close(imported["model"][key], value, rtol=0, atol=0)
    for start in (tmp_path / "imported", tmp_path / "hf"):
        code, out, err = run_cli(capsys, "train", "--config", LLAMA_DEBUG,
                                 *train_overrides(training__steps=1, validation__enabled="false",
                                                  output_dir=str(tmp_path / f"ft_{start.name}"),
                                                  checkpoint__initial_load_path=str(start)))
        assert code == 0, err
        assert f"initial weights loaded from {start}" in out


def test_train_bad_inputs_are_one_line_errors(tmp_path, train_overrides, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--data.source", str(tmp_path / "missing")], "does not exist"),
        (["--data.source", str(empty)], "empty"),
        (["--training.steps", "abc"], "training.steps = 'abc' has the wrong type"),
        (["--checkpoint.initial_load_path", str(tmp_path / "nothing")], "checkpoint.initial_load_path"),
        (["--checkpoint.initial_load_path", str(empty)], "no complete checkpoint found"),
        (["--kernels.attention", "splash"], "kernels.attention = splash cannot run here (runs on tpu, not cpu); "
                                            "available on cpu: reference, sdpa"),
        (["--kernels.loss", "tokamax"], "kernels.loss = tokamax cannot run here"),
    ]
    for extra, message in cases:
        code, _, err = run_cli(capsys, "train", "--config", LLAMA_DEBUG, *train_overrides(), *extra)
        assert code == 2, (extra, err)
        assert message in err and err.count("\n") == 1, (extra, err)


def test_kernels_lists_implementations_and_the_auto_choice(capsys):
    code, out, err = run_cli(capsys, "kernels")
    assert code == 0, err
    assert out.startswith("kernels for device cpu:")
    assert "kernels.attention:" in out and "kernels.loss:" in out
    assert "auto               -> sdpa" in out and "auto               -> chunked" in out
    assert "splash             not here:" in out
    # --device tpu: what a TPU VM (torch-tpu, jax, tokamax installed) picks, beside what runs here, where
    # splash, tokamax and gmm need packages this environment lacks.
    code, out, _ = run_cli(capsys, "kernels", "--device", "tpu")
    assert code == 0
    assert "auto (documents)   -> splash on a TPU VM; here: reference" in out
    assert "auto               -> tokamax on a TPU VM; here: chunked" in out
    assert "auto               -> gmm on a TPU VM; here: reference" in out


def test_help_lists_every_command_and_version(capsys):
    from titan_tpu import cli

    assert set(cli.SUMMARIES) == set(cli.COMMANDS)  # a new command needs its line in --help
    for argv in ((), ("--help",), ("-h",)):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and out.startswith("usage: titan-tpu COMMAND")
        for name, summary in cli.SUMMARIES.items():
            assert f"  {name} " in out and summary in out
        assert "docs/README.md" in out
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("titan-tpu 0.") and "torch 2." in out
    code, _, err = run_cli(capsys, "trian")
    assert code == 2 and err.count("\n") == 1 and "unknown command 'trian'; use one of train, config" in err


def test_compile_sets_its_environment_before_torch_is_imported():
    """`titan-tpu compile` needs no environment variables from the user: the command line sets what
    the compile-only client needs before anything imports torch (in a fresh process, as the console
    script starts), keeps a value the user set, and sets nothing for the other commands."""
    import ast
    import os
    import subprocess
    import sys

    from titan_tpu.cli import COMPILE_ENVIRONMENT

    probe = ("import os, sys; from titan_tpu import cli; "
             "cli.COMMANDS[sys.argv[1]] = lambda argv: print(repr(('torch' in sys.modules, "
             "{name: os.environ.get(name) for name in cli.COMPILE_ENVIRONMENT}))) or 0; "
             "sys.exit(cli.main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k not in COMPILE_ENVIRONMENT}

    def seen(command: str, **extra) -> tuple:
        out = subprocess.run([sys.executable, "-c", probe, command], env={**env, **extra}, capture_output=True,
                             text=True, check=True).stdout
        return ast.literal_eval(out)

    assert seen("compile") == (False, COMPILE_ENVIRONMENT)
    assert seen("compile", TPU_SKIP_MDS_QUERY="0")[1]["TPU_SKIP_MDS_QUERY"] == "0"
    assert seen("plan") == (False, dict.fromkeys(COMPILE_ENVIRONMENT))
    assert COMPILE_ENVIRONMENT["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"


def test_config_lists_every_key_with_its_meaning(capsys):
    """`titan-tpu config` is the schema itself: every key of every section, its type and default, and
    the comment the schema writes for it (a key added without one fails here)."""
    from titan_tpu.config import SECTIONS, Config
    from titan_tpu.tools.config_reference import config_reference

    docs = {d.key: d for d in config_reference()}
    cfg = Config()
    keys = {f"{section}.{name}" for section in SECTIONS for name in vars(getattr(cfg, section))} | {"output_dir"}
    assert set(docs) == keys
    assert not [key for key, d in docs.items() if not d.help], "config keys without a comment in the schema"
    assert docs["training.mode"].type == "eager|graph" and docs["training.steps"].default == "100"
    assert docs["model.scan_layers"].default == "false" and docs["metrics.trackers"].type == "list of str"
    code, out, _ = run_cli(capsys, "config", "parallelism")
    assert code == 0 and out.startswith("--parallelism.dp_replicate (int; default 1)") and "--training." not in out


def test_graph_dump(tmp_path, train_overrides, capsys):
    out = tmp_path / "step.txt"
    code, stdout, err = run_cli(capsys, "graph", "--config", LLAMA_DEBUG, "--out", str(out), *train_overrides())
    assert code == 0, err
    assert "captured train step:" in stdout and "collectives: all_reduce" not in stdout  # one process
    assert "estimated model FLOPs per step:" in stdout and f"graph written to {out}" in stdout
    text = out.read_text()
    assert "torch.ops.aten.mm" in text and "torch.ops.aten._foreach_sqrt" in text  # fwd/bwd and AdamW
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained
    # With accumulation: both programs, the micro-batch's and the update's, in the summary and the file.
    code, stdout, err = run_cli(capsys, "graph", "--config", LLAMA_DEBUG, "--out", str(out), *train_overrides(),
                                "--training.grad_accum_steps", "2")
    assert code == 0, err
    assert "captured micro-batch:" in stdout and "(run 2 times per step, then)" in stdout
    assert "captured update:" in stdout
    text = out.read_text()
    assert "torch.ops.aten.mm" in text and "torch.ops.aten._foreach_sqrt" in text


def test_the_old_train_module_names_the_command_in_one_line():
    """`torchrun ... -m titan_tpu.train`, the launch line of the docs before `train` was a command:
    one line naming `-m titan_tpu train`, exit status 2, not Python's "No module named ...__main__"."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "titan_tpu.train", "--config", "configs/llama3_debug.toml"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "-m titan_tpu train" in done.stderr


def test_plan_of_the_vlm_recipe_on_a_fresh_clone_writes_its_stand_in(tmp_path, monkeypatch, capsys):
    """The VLM recipe names a weightless stand-in of Qwen2.5-VL-7B's directory (tools/hf_shape_dir.py),
    which `plan` writes where it is missing (a fresh clone), as `compile` does, and says so on stderr."""
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(tmp_path)  # no outputs/ here
    assert main(["plan", "--config", str(root / "configs/qwen2_5_vl_7b_tpu.toml")]) == 0
    out, err = capsys.readouterr()
    assert "weightless stand-in" in err and out.startswith("plan for hf:outputs/hf_shapes/Qwen2.5-VL-7B-Instruct")
