"""Prompts for `titan-tpu generate`: from the command line or a .jsonl file, to token ids.

A row of the file holds one of:

* ``prompt``: text, encoded as transformers' tokenizer(text) encodes it (special tokens in the
  text recognised, the tokenizer's own begin-of-text token added where it adds one);
* ``messages``: a conversation, a list of ``{"role", "content"}``, rendered with the tokenizer's
  chat template and its generation prompt (data/chat.py), as apply_chat_template does;
* ``token_ids``: the ids themselves (no tokenizer needed).

A vision-language model's ``messages`` may hold images as content parts, as its training rows do
(``{"type": "image", "path": "cat.png"}``, a relative path read from the file's folder): such
rows are rendered as a training row is (data/images.py `ImagePrompts`), their images read into the
row's image slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_tpu.data.chat import ChatRenderer
    from titan_tpu.data.images import ImagePrompts
    from titan_tpu.data.tokenizer import Tokenizer

KEYS = ("prompt", "messages", "token_ids")


@dataclass
class Prompt:
    ids: list[int]
    kind: str  # which of KEYS it came from
    source: object  # the text, the messages or the ids as given
    images: dict[str, Any] | None = None  # a vision-language prompt's image slots (data/images.py); None: none


def holds_image(row: dict) -> bool:
    """Whether a prompt row's messages hold an image part."""
    from titan_tpu.data.images import image_parts

    messages = row.get("messages")
    return isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and bool(image_parts(messages))


def read_prompt_rows(path: str | Path) -> list[dict]:
    """The rows of a .jsonl prompt file; one-line errors naming the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts-file {path} does not exist; give a .jsonl file, one prompt per line")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts-file {path} line {number} is not JSON ({e.msg}); write one JSON object "
                             "per line") from None
        if not isinstance(row, dict) or sum(key in row for key in KEYS) != 1:
            raise ValueError(f"--prompts-file {path} line {number} needs exactly one of the keys "
                             f"{', '.join(KEYS)}; found {sorted(row) if isinstance(row, dict) else type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"--prompts-file {path} holds no prompts; write one JSON object per line")
    return rows


def encode_rows(rows: list[dict], *, tokenizer: Tokenizer | None, chat: ChatRenderer | None, where: str,
                images: ImagePrompts | None = None, base: Path | None = None) -> list[Prompt]:
    """Each row's token ids. `chat` renders messages (None: a row with messages is an error);
    `images`, a vision-language model's, renders them instead, with their images (read from `base`
    where relative); without it a row with an image is an error."""
    prompts = []
    for i, row in enumerate(rows):
        name = f"{where} {i}"
        if "token_ids" in row:
            ids = row["token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{name}: token_ids must be a list of integers")
            prompts.append(Prompt(ids, "token_ids", ids))
            continue
        if tokenizer is None:
            raise ValueError(f"{name} is text and no tokenizer goes with the model; pass --tokenizer TOKENIZER_JSON "
                             "or give token_ids")
        if "messages" in row and images is not None:
            ids, read = images.encode(row["messages"], where=name, base=base)
            prompts.append(Prompt(ids, "messages", row["messages"], images=read))
        elif "messages" in row:
            if holds_image(row):
                raise ValueError(f"{name} holds an image and the model is text-only (it has no vision encoder to read "
                                 "it); generate with a vision-language model (Qwen2.5-VL, Gemma 3, LLaVA) or drop the "
                                 "image parts")
            if chat is None:
                raise ValueError(f"{name} holds chat messages and the tokenizer has no chat template; pass --tokenizer "
                                 "a directory whose tokenizer_config.json has one, or give the prompt as text")
            prompts.append(Prompt(chat.prompt_ids(row["messages"], where=name), "messages", row["messages"]))
        else:
            if not isinstance(row["prompt"], str):
                raise ValueError(f"{name}: prompt must be a string")
            prompts.append(Prompt(tokenizer.encode_prompt(row["prompt"]), "prompt", row["prompt"]))
    return prompts
