"""`titan-tpu generate`: a model (a training checkpoint, a LoRA run's adapters folded into the
weights; a Hugging Face directory; a config's model), its tokenizer and the prompts, through
`generate`; the completions printed, streamed as they come for one prompt, or as JSON lines.

Images (a vision-language model of the hf backend): --image PATH (repeated) puts images before the
one --prompt's text in a user turn; a prompts file's chat rows hold them as their training rows do.
Both render with the model directory's chat template and processor (data/images.py `ImagePrompts`),
with model.max_images image slots a prompt at model.image_size, as a training run has them (from a
training checkpoint: the run's own settings, unless --model.* gives others).

Stop tokens, unless --ignore-eos: the tokenizer's end-of-text token, the tokenizer_config.json's
eos_token (a chat model's end of turn) and the eos_token_id of the model directory's
generation_config.json and config.json, as transformers' generate stops.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from titan_tpu.generate.loop import generate
from titan_tpu.generate.prompts import Prompt, encode_rows, holds_image, read_prompt_rows
from titan_tpu.generate.sampling import Sampling

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.data.images import ImagePrompts
    from titan_tpu.data.tokenizer import Tokenizer
    from titan_tpu.evaluation.loss import EvalModel


def load_model(cfg: Config, *, checkpoint: str | None, device: torch.device) -> EvalModel:
    """The model as `titan-tpu eval` loads it; a model it cannot build is a one-line error."""
    from titan_tpu.evaluation.loss import load_eval_model

    where = checkpoint or f"--model.name {cfg.model.name}"
    try:
        return load_eval_model(cfg, checkpoint=checkpoint, device=device)
    except FileNotFoundError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ImportError, OSError, RuntimeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"generate cannot build the model of {where} ({type(e).__name__}: {reason}); give a "
                         "checkpoint titan-tpu train wrote or a Hugging Face directory of a causal LM transformers "
                         "can build") from None


def stop_ids(tokenizer: Tokenizer | None, model_dirs: list[Path]) -> set[int]:
    ids = set()
    if tokenizer is not None:
        ids.add(tokenizer.eos_id)
    for directory in model_dirs:
        for name in ("generation_config.json", "config.json", "tokenizer_config.json"):
            path = directory / name
            if not path.is_file():
                continue
            config = json.loads(path.read_text())
            eos = config.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
            token = config.get("eos_token") if name == "tokenizer_config.json" else None
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and tokenizer is not None and tokenizer.token_id(token) is not None:
                ids.add(tokenizer.token_id(token))
    return ids


class Stream:
    """Prints row 0's new text as it comes; a character split over tokens waits for its last byte."""

    def __init__(self, tokenizer: Tokenizer, stops: set[int], out: TextIO):
        self.tokenizer, self.stops, self.out = tokenizer, stops, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens_B: torch.Tensor, live_B: torch.Tensor) -> None:
        token = int(tokens_B[0])
        if not live_B[0] or token in self.stops:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.flush(text)

    def flush(self, text: str | None = None) -> None:
        """Print what is new in `text` (default: everything decoded so far, as at the end)."""
        text = self.tokenizer.decode(self.ids) if text is None else text
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def run_generate(cfg: Config, *, checkpoint: str | None, prompts: list[str], prompts_file: str | None, chat: bool,
                 tokenizer_path: str | None, max_new_tokens: int, sampling: Sampling, seed: int, ignore_eos: bool,
                 compile: bool, as_json: bool, stream: bool, out: TextIO | None = None,
                 images: list[str] = ()) -> list[dict]:
    """The completions as dicts (prompt, completion, tokens, finish), printed to `out` (default:
    stdout). `images`: image files for the one prompt (--image)."""
    from titan_tpu.device import get_backend

    out = sys.stdout if out is None else out  # read at the call: a test may have replaced it

    rows = _rows(prompts, prompts_file, chat=chat, images=images)
    backend = get_backend(cfg.training.device)
    loaded = load_model(cfg, checkpoint=checkpoint, device=backend.device)
    tokenizer = _tokenizer(tokenizer_path or cfg.data.tokenizer_path or loaded.tokenizer)
    image_prompts = _image_prompts(cfg, loaded, tokenizer, rows, image_flag=bool(images))
    renderer = _chat_renderer(tokenizer) if any("messages" in row for row in rows) and not image_prompts else None
    encoded = encode_rows(rows, tokenizer=tokenizer, chat=renderer, where=prompts_file or "--prompt",
                          images=image_prompts, base=Path(prompts_file).parent if prompts_file else None)
    image_inputs = image_prompts.batch([p.ids for p in encoded], [p.images for p in encoded]) if image_prompts else None
    model_dirs = [Path(loaded.weights)] if Path(loaded.weights).is_dir() else []
    if tokenizer is not None and tokenizer.path is not None:
        model_dirs.append(tokenizer.path.parent)
    stops = set() if ignore_eos else stop_ids(tokenizer, model_dirs)
    streamed = Stream(tokenizer, stops, out) if stream and not as_json and len(encoded) == 1 and tokenizer else None
    result = generate(loaded.model, [p.ids for p in encoded], max_new_tokens=max_new_tokens, sampling=sampling,
                      stop_ids=stops, seed=seed, compile_backend=backend.compile_backend if compile else None,
                      on_step=streamed, images=image_inputs)
    records = [_record(p, result.completion(i), bool(result.stopped_B[i]), tokenizer, stops)
               for i, p in enumerate(encoded)]
    if streamed is not None:
        streamed.flush()
        out.write("\n")
    else:
        _print(records, as_json=as_json, out=out)
    return records


def _rows(prompts: list[str], prompts_file: str | None, *, chat: bool, images: list[str]) -> list[dict]:
    """The prompt rows of the command line (--image: the one prompt as a user turn holding them) or the file."""
    if bool(prompts) == bool(prompts_file):
        raise ValueError("titan-tpu generate needs --prompt TEXT (one or more) or --prompts-file FILE.jsonl")
    if images and (prompts_file or len(prompts) != 1):
        raise ValueError("--image goes with one --prompt (the images, then its text, in one user turn); for several "
                         "prompts with images write a --prompts-file whose messages hold {\"type\": \"image\", "
                         "\"path\": ...} parts")
    if prompts_file:
        return read_prompt_rows(prompts_file)
    if images:
        parts = [{"type": "image", "path": path} for path in images] + [{"type": "text", "text": prompts[0]}]
        return [{"messages": [{"role": "user", "content": parts}]}]
    return [{"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text} for text in prompts]


def _image_prompts(cfg: Config, loaded: EvalModel, tokenizer: Tokenizer | None, rows: list[dict], *,
                   image_flag: bool) -> ImagePrompts | None:
    """The renderer of prompts with images, when some row holds one and the model reads them."""
    from titan_tpu.data.images import ImagePrompts
    from titan_tpu.evaluation.loss import trained_image_settings

    if not any(holds_image(row) for row in rows):
        return None
    directory = loaded.spec.image_model_dir()
    if directory is None:
        if image_flag:
            raise ValueError(f"--image: {loaded.spec.label} is a text-only model (it has no vision encoder to read "
                             "images); give a vision-language model (a Qwen2.5-VL, Gemma 3 or LLaVA directory) or drop "
                             "--image")
        return None  # encode_rows names the row
    if tokenizer is None:
        raise ValueError(f"prompts with images need the tokenizer of {directory}; pass --tokenizer TOKENIZER_JSON")
    settings = trained_image_settings(cfg, loaded.weights)
    return ImagePrompts.of_dir(directory, tokenizer=tokenizer, **settings)


def _tokenizer(path: str | None) -> Tokenizer | None:
    from titan_tpu.data.tokenizer import load_tokenizer

    return load_tokenizer(path) if path else None


def _chat_renderer(tokenizer: Tokenizer | None):
    from titan_tpu.data.chat import ChatRenderer, load_chat_template

    if tokenizer is None or tokenizer.path is None:
        return None
    try:
        template, special = load_chat_template(tokenizer.path)
    except ValueError:
        return None  # encode_rows names the row that needed one
    return ChatRenderer(template, tokenizer, special_tokens=special)


def _record(prompt: Prompt, tokens: list[int], stopped: bool, tokenizer: Tokenizer | None, stops: set[int]) -> dict:
    record = {"prompt": prompt.source, "tokens": tokens, "finish": "stop" if stopped else "length"}
    if tokenizer is not None:
        record["completion"] = tokenizer.decode(tokens[:-1] if stopped and tokens[-1] in stops else tokens)
    return record


def _print(records: list[dict], *, as_json: bool, out: TextIO) -> None:
    if as_json:
        for record in records:
            out.write(json.dumps(record) + "\n")
        return
    for i, record in enumerate(records):
        body = record.get("completion", " ".join(map(str, record["tokens"])))
        out.write(f"--- prompt {i} ({len(record['tokens'])} tokens, {record['finish']})\n{body}\n")
