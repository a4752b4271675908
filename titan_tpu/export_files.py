"""What an exported Hugging Face directory holds beside its weights, so that transformers'
AutoTokenizer / generate, lm-eval's HF backend (`lm_eval --model hf`) and vLLM read the model as we
run it:

* tokenizer.json and its companions (the run's; a model's own tokenizer_config.json unchanged), and
  where the run trained its tokenizer a tokenizer_config.json that names the tokenizer's class, its
  bos_token and eos_token (a BPE trained for the run has only its end-of-text token: both are that,
  as GPT-2's) and keeps decoded text as ours decodes it (no clean-up of spaces); the chat template
  data.chat_template chose, when the run chose one;
* config.json's bos_token_id / eos_token_id / pad_token_id those of the tokenizer (a Llama config
  left without them means ids 1 and 2, whatever the vocabulary);
* generation_config.json: the same ids, and greedy decoding as the default;
* a vision-language model's processor files (its image processor's settings, the processor's chat
  template), from the model directory the run trained, which AutoProcessor and vLLM read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from titan_tpu.data.tokenizer import load_tokenizer, tokenizer_files


def write_export_files(out: Path, *, tokenizer_json: Path, chat_template_choice: str = "") -> None:
    """The tokenizer's files copied into the export `out` and the ids above written there.
    chat_template_choice: the run's data.chat_template ("" the tokenizer's own, "chatml", a .jinja)."""
    for source in tokenizer_files(tokenizer_json):  # with its chat template, so a chat fine-tune can start here
        shutil.copyfile(source, out / source.name)
    own = (out / "tokenizer_config.json").is_file()
    tokenizer_config = _tokenizer_config(out, chat_template_choice)
    # A model's own tokenizer_config.json travels as it is (byte for byte, as the weights' tokenizer
    # came); one is written where the run trained its tokenizer, or chose a chat template of its own.
    if not own or chat_template_choice:
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    tokenizer = load_tokenizer(out / "tokenizer.json")
    ids = {f"{key}_id": tokenizer.token_id(tokenizer_config[key]) for key in ("bos_token", "eos_token", "pad_token")
           if isinstance(tokenizer_config.get(key), str) and tokenizer.token_id(tokenizer_config[key]) is not None}
    config = json.loads((out / "config.json").read_text())
    config.update(ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # generate stops at the end-of-text token too, where a chat model's eos_token is its end of turn
    stops = sorted({ids["eos_token_id"], tokenizer.eos_id})
    generation = {**ids, "eos_token_id": stops[0] if len(stops) == 1 else stops, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# What AutoProcessor reads beside the tokenizer's files (the image and video processors' settings,
# the processor's own settings and chat template).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def copy_processor_files(out: Path, model_dir: Path) -> None:
    """A vision-language model's processor files, from the directory the run trained, into the export."""
    for name in PROCESSOR_FILES:
        if (model_dir / name).is_file() and not (out / name).is_file():
            shutil.copyfile(model_dir / name, out / name)


def _tokenizer_config(out: Path, chat_template_choice: str) -> dict:
    """The run's tokenizer_config.json (if it had one) with what it lacks filled in."""
    from titan_tpu.data.chat import CHATML

    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("bos_token", "eos_token", "pad_token"):  # AddedToken dicts -> their text
        if isinstance(config.get(key), dict):
            config[key] = config[key].get("content")
    tokenizer = load_tokenizer(out / "tokenizer.json")
    if not isinstance(config.get("eos_token"), str) or tokenizer.token_id(config["eos_token"]) is None:
        config["eos_token"] = tokenizer.eos_token
    if not isinstance(config.get("bos_token"), str) or tokenizer.token_id(config["bos_token"]) is None:
        config["bos_token"] = tokenizer.eos_token
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("clean_up_tokenization_spaces", False)
    if chat_template_choice == "chatml":
        config["chat_template"] = CHATML
    elif chat_template_choice and Path(chat_template_choice).expanduser().is_file():
        config["chat_template"] = Path(chat_template_choice).expanduser().read_text()
    return config
