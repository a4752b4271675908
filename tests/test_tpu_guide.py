"""docs/tpu.md's guide, walked on this CPU: every command of its first section that a CPU can run
runs here, as written, at debug size. The page's paths become a Qwen3-shaped Hugging Face
directory of the debug flavor (its weights, a tokenizer.json with ChatML tokens and a chat
template), a folder of text and a file of conversations; `torchrun ... -m titan_tpu train` runs as
`titan-tpu train` in this process with overrides appended that shrink it to the CPU (the debug
flavor, one rank, two eager steps, the CPU's kernels, TensorBoard alone: W&B is tests/test_trackers.py's).
What it shows: the corpus is tokenized ahead by `prepare-data` and the run then tokenizes nothing,
the recipes start from an HF directory with its tokenizer, the continued-pretraining run (its
directory on the page's attached disk) exports with its tokenizer files, the LoRA chat run starts
from that export, and the peft adapter it exports loads by itself (`AutoPeftModelForCausalLM`)
with our model's logits. The commands a CPU cannot run (installing, the TPU check, downloads,
logging in) are named, so a new kind of command on the page needs a decision here."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from data_fixtures import conversations, make_docs, write_chat_tokenizer_dir, write_jsonl
from test_docs_commands import FENCE, continues

ROOT = Path(__file__).resolve().parent.parent
GUIDE = "## From a fresh TPU VM to a Qwen3-8B run"
# Installing, the TPU check, downloads, logging in:
NOT_ON_A_CPU = {"git", "cd", "python3", "source", "pip", "hf", "wandb", "python"}
# The recipes' graph mode becomes eager here, to keep this test short: the captured step of the same
# shapes is tested on its own (scanned, checkpointed and LoRA: tests/test_lora.py; chat labels:
# tests/test_graph_accum.py); `titan-tpu compile` compiles the recipes for their slices.
CPU = ["--model.flavor", "debug", "--training.device", "cpu", "--model.dtype", "float32", "--parallelism.dp_shard", "1",
       "--kernels.attention", "auto", "--kernels.loss", "auto", "--training.mode", "eager", "--compile.backend",
       "aot_eager", "--training.steps", "2", "--training.batch_size", "2", "--training.seq_len", "128",
       "--validation.enabled", "false", "--checkpoint.interval", "2", "--metrics.trackers", "tensorboard",
       "--metrics.tensorboard", "false", "--lr_scheduler.warmup_steps", "1"]


def guide_blocks() -> list[tuple[str, str]]:
    """(language, text) of the code blocks of the guide section, shell lines continued as bash does."""
    text = (ROOT / "docs" / "tpu.md").read_text()
    section = text.split(GUIDE, 1)[1].split("\n## ", 1)[0]
    blocks, language, lines = [], None, []
    for line in section.splitlines():
        if FENCE.match(line.strip()):
            if language is None:
                language, lines = line.strip()[3:].strip(), []
            else:
                blocks.append((language, "\n".join(lines)))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def shell_commands(block: str) -> list[str]:
    joined, pending = [], ""
    for line in block.splitlines():
        if continues(line):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    commands = []
    for line in joined:
        line = re.split(r"(?:^|\s)#", line)[0].strip()  # a shell comment
        commands += [part.strip() for part in re.split(r"\s(?:&&|;)\s", line) if part.strip()]
    return commands


@pytest.fixture
def world(tmp_path, data_cache, monkeypatch):
    """The page's paths on this machine: an HF directory of Qwen3's debug flavor, text, conversations."""
    from titan_tpu.models.hub.checkpoint import save_hf_checkpoint
    from titan_tpu.models.registry import build_model, get_model_args

    args = get_model_args("qwen3", "debug")
    base = tmp_path / "models" / "Qwen3-8B-Base"
    save_hf_checkpoint(base, name="qwen3", args=args, state_dict=build_model(args, seed=0).state_dict())
    write_chat_tokenizer_dir(base)  # tokenizer.json (ChatML tokens) and tokenizer_config.json
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    for i, doc in enumerate(make_docs(60, words=80)):
        (corpus / f"doc{i}.txt").write_text(doc)
    write_jsonl(tmp_path / "data" / "chats.jsonl", conversations(60, turns=3))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TITAN_TPU_CACHE", str(data_cache))
    return {"~/models/": f"{tmp_path}/models/", "~/data/": f"{tmp_path}/data/", "configs/": f"{ROOT}/configs/",
            "/mnt/disks/persist/": f"{tmp_path}/persist/"}


def _run(command: str, paths: dict[str, str]) -> list[str]:
    """Run one page command here; returns its argv after the page's paths were mapped."""
    from titan_tpu.cli import main

    for page_path, here in paths.items():
        command = command.replace(page_path, here)
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        module = argv.index("-m")
        assert argv[module + 1:module + 3] == ["titan_tpu", "train"], command
        argv = ["train", *argv[module + 3:], *CPU]
    else:
        assert argv[0] == "titan-tpu", command
        argv = argv[1:]
    assert main(argv) == 0, argv
    return argv


def test_the_tpu_guide_runs_on_a_cpu(world, tmp_path, capsys):
    from titan_tpu.evaluation.loss import load_eval_model
    from titan_tpu.train.checkpoint import read_checkpoint_meta

    blocks = guide_blocks()
    assert [language for language, _ in blocks] == ["bash", "bash", "bash", "bash", "bash", "python"]
    ran, skipped, outs = [], [], []
    for language, block in blocks:
        if language != "bash":
            continue
        for command in shell_commands(block):
            first = command.split()[0]
            if first in ("torchrun", "titan-tpu"):
                ran.append(_run(command, world))
                outs.append(capsys.readouterr().out)
            else:
                assert first in NOT_ON_A_CPU, f"docs/tpu.md's guide shows {command!r}: run it here or name it"
                skipped.append(first)
    assert [argv[0] for argv in ran] == ["plan", "prepare-data", "train", "convert", "train", "convert"]
    assert {"pip", "hf", "wandb"} <= set(skipped)
    out = "".join(outs)

    # The corpus was tokenized ahead, and the continued-pretraining run opened those tokens.
    assert "checkpoint:" in outs[0]  # the plan says how large a checkpoint is
    assert "data: tokenized" in outs[1], outs[1]
    assert "data: corpus: " in outs[2], "the run logs its data on stdout"
    assert "data: tokenized" not in outs[2], "the run tokenized again what prepare-data had tokenized"
    base, cpt = tmp_path / "models" / "Qwen3-8B-Base", tmp_path / "models" / "qwen3-8b-cpt"
    cpt_run, lora_run = tmp_path / "persist" / "qwen3_8b_tpu", tmp_path / "persist" / "qwen3_8b_lora_chat_tpu"
    # Continued pretraining took the directory's weights and its tokenizer, and its export carries them on.
    assert f"initial weights loaded from {base}" in out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (cpt_run / name).read_bytes() == (base / name).read_bytes(), name
        assert (cpt / name).read_bytes() == (base / name).read_bytes(), name
    # The LoRA chat run started from the export, trained on the assistant's tokens, and recorded its base.
    assert f"initial weights loaded from {cpt}" in out and "conversations" in out
    meta = read_checkpoint_meta(lora_run / "checkpoints" / "step-00000002")
    assert meta["lora"]["rank"] == 16 and meta["base_weights"] == {"hf_dir": str(cpt)}
    adapter = tmp_path / "qwen3-8b-chat-lora"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(cpt)

    # The page's python block loads the adapter by itself; its logits are our trained model's.
    namespace: dict = {}
    exec(blocks[-1][1], namespace)  # noqa: S102 - the page's own snippet
    # The export is bf16 (as models are served) and the LoRA run started from it, so the base weights
    # are the same bf16 values on both sides: compared in fp32, the logits are equal to rounding.
    peft_model = namespace["model"].float().eval()
    from titan_tpu.config import build_config

    cfg = build_config(ROOT / "configs" / "qwen3_8b_lora_chat_tpu.toml", CPU)
    ours = load_eval_model(cfg, checkpoint=lora_run, device=torch.device("cpu")).model.eval()
    tokens = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


def test_starting_weights_without_a_tokenizer_are_refused_in_one_line(tmp_path):
    """Pretrained weights with a BPE trained here would not match: without data.tokenizer_path, a
    starting directory must bring its tokenizer.json; a start that is not there is named."""
    from titan_tpu.config import build_config
    from titan_tpu.run.setup import prepare_run

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    for start, error, words in ((tmp_path / "hf", ValueError, "holds no tokenizer.json"),
                                (tmp_path / "absent", FileNotFoundError, "does not exist")):
        cfg = build_config(ROOT / "configs" / "qwen3_8b_tpu.toml", [*CPU, "--checkpoint.initial_load_path", str(start)])
        with pytest.raises(error) as e:
            prepare_run(cfg).tokenizer_path
        assert words in str(e.value) and "\n" not in str(e.value) and "checkpoint.initial_load_path" in str(e.value)


def test_weights_of_another_rope_or_norm_are_refused_by_a_flavor(tmp_path):
    """Shapes alike, math not: a directory whose config.json has another rope_theta than the flavor
    would load silently and compute with the wrong rotation; it is refused in one line."""
    from titan_tpu.config import build_config
    from titan_tpu.models.hub.checkpoint import save_hf_checkpoint
    from titan_tpu.models.registry import build_model, get_model_args
    from titan_tpu.models.spec import build, native_spec

    args = get_model_args("qwen3", "debug")
    model = build_model(args, seed=0)
    hf = save_hf_checkpoint(tmp_path / "hf", name="qwen3", args=args, state_dict=model.state_dict())
    cfg = build_config(ROOT / "configs" / "qwen3_debug.toml", ["--training.device", "cpu"])
    spec = native_spec(cfg.model)
    target = build(spec, cfg, device="cpu", seed=1)
    spec.load_hf_weights(target, hf)  # the same config: loads
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), model.state_dict().values()))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    with pytest.raises(ValueError) as e:
        spec.load_hf_weights(target, hf)
    assert "rope_theta = 10000.0" in str(e.value) and "qwen3/debug" in str(e.value) and "\n" not in str(e.value)
