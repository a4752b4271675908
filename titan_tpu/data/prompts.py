"""Prompts for GRPO: rows of a ``prompt`` and the columns a reward reads, tokenized once.

A row (jsonl(.gz/.zst), parquet or arrow, any path data/sources.py reads) holds ``prompt`` and
any other columns (``answer`` for the exact-match reward, or whatever your reward function takes:
each is passed to it by name, as TRL passes a dataset's columns). The prompt is

* plain text: encoded as transformers' tokenizer(text) encodes it (the tokenizer's begin-of-text
  token added where it adds one), as `titan-tpu generate` encodes a prompt;
* chat messages: a list of ``{role, content}`` rendered with the tokenizer's chat template and its
  generation prompt; the reward then receives the messages as the prompt and each completion as
  ``[{"role": "assistant", "content": text}]`` (TRL's conversational form).

`PromptLoader` serves each data-parallel rank its `batch_size` rows of a global batch, visiting
the rows in a seeded permutation per epoch; its position (epoch, rows consumed) is in its state
dict, so a resumed run reads the prompts it would have read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from titan_tpu.data.preference import read_rows

__all__ = ["PromptLoader", "PromptRow", "load_prompts"]

_STATE_VERSION = 1


@dataclass
class PromptRow:
    ids: list[int]  # the prompt's token ids (rendered with the chat template for messages)
    prompt: Any  # the prompt as given: text, or the messages
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    where: str = ""  # file and row, for errors
    chat: bool = False


def load_prompts(source: str, *, tokenizer, max_prompt_len: int, chat_template=None) -> list[PromptRow]:
    """Every row of `source` with its prompt tokenized (module docstring). A prompt longer than
    `max_prompt_len` tokens (training.seq_len - grpo.max_completion_length) is a one-line error."""
    renderer = None
    if chat_template is not None:
        from titan_tpu.data.chat import ChatRenderer

        renderer = ChatRenderer(chat_template[0], tokenizer, special_tokens=chat_template[1])
    rows = []
    for where, row in read_rows(source, columns=("prompt",), what="prompt data"):
        prompt = row["prompt"]
        if isinstance(prompt, str):
            ids, chat = tokenizer.encode_prompt(prompt), False
        elif isinstance(prompt, list):
            if renderer is None:
                raise ValueError(f"prompt data {where} holds chat messages and the tokenizer has no chat template; set "
                                 "data.tokenizer_path to an HF model directory of a chat model")
            ids, chat = renderer.prompt_ids(prompt, where=where), True
        else:
            raise ValueError(f"prompt data {where}: prompt must be a string or a list of {{role, content}} messages, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompt data {where}: the prompt is empty; give at least one token")
        if len(ids) > max_prompt_len:
            raise ValueError(f"prompt data {where}: the prompt is {len(ids)} tokens, longer than training.seq_len - "
                             f"grpo.max_completion_length = {max_prompt_len}; raise training.seq_len or shorten it")
        rows.append(PromptRow(ids, prompt, {k: v for k, v in row.items() if k != "prompt"}, where, chat))
    if not rows:
        raise ValueError(f"prompt data {source} holds no rows; give a file of rows with a prompt column")
    return rows


class PromptLoader:
    """`batch_size` prompt rows per data-parallel rank per step (module docstring)."""

    def __init__(self, rows: list[PromptRow], *, batch_size: int, seed: int, dp_rank: int = 0, dp_world_size: int = 1):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        global_batch = batch_size * dp_world_size
        if len(rows) < global_batch:
            raise ValueError(f"prompt data has {len(rows)} rows, fewer than one global batch of {global_batch} "
                             f"(training.batch_size {batch_size} x {dp_world_size} data-parallel ranks); use more "
                             "prompts or a smaller training.batch_size")
        self.epoch, self.consumed = 0, 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its permutation of the rows)

    def next_batch(self) -> list[PromptRow]:
        global_batch = self.batch_size * self.dp_world_size
        if self.consumed + global_batch > len(self.rows):  # the partial global batch at an epoch's end is skipped
            self.epoch, self.consumed = self.epoch + 1, 0
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows)))
        order = self._order[1]
        start = self.consumed + self.dp_rank * self.batch_size
        self.consumed += global_batch
        return [self.rows[i] for i in order[start:start + self.batch_size]]

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "kind": "prompts", "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "prompts":
            raise ValueError("the checkpoint's data position is not a prompt loader's; resume it with the "
                             "training.objective it was written with")
        self.epoch, self.consumed = state["epoch"], state["consumed"]
