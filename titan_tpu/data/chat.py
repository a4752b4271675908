"""Chat data: conversations rendered with a model's chat template, loss on assistant tokens only.

A row holds ``messages``, a list of ``{"role", "content"}``. It is rendered to text with the
``chat_template`` of an HF model directory's ``tokenizer_config.json`` (jinja2 in a sandbox, as
transformers does), tokenized, and every token gets a flag: trained (1, an assistant token) or
not (0). Which characters are the assistant's:

* a template with ``{% generation %} ... {% endgeneration %}`` blocks (the form transformers'
  ``return_assistant_tokens_mask=True`` needs) marks them itself: we render the blocks between
  two private-use sentinel characters, note where they fall and remove them;
* any other template: the assistant turn ``i`` is the text that rendering ``messages[:i+1]`` adds
  to rendering ``messages[:i]`` with the generation prompt, less trailing whitespace; this needs a
  template whose render of a prefix is a prefix of the full render (true of ChatML/Llama-style
  templates; checked, else an error asks for generation blocks). Templates that rewrite earlier
  turns (Qwen3 drops the thinking of past turns) fail that check.

A token is trained when a character span of the assistant covers it, mapped as transformers maps
it (the token of the span's first character through the token of its last one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_OPEN, _CLOSE = "\ue000", "\ue001"  # sentinels around {% generation %} output; never in real text
_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "  # after a message to continue; transformers' own marker


# data.chat_template = "chatml": ChatML turns (<|im_start|>role\n ... <|im_end|>\n, the format Qwen's
# models read) with {% generation %} blocks around each assistant reply and its end-of-turn token, so
# the trained tokens are marked by the template itself. Qwen3's own template renders the last
# assistant turn differently from earlier ones (an empty thinking block), which the prefix rule below
# cannot follow; this is the same conversation without thinking blocks.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def load_chat_template(tokenizer_path: str | Path, choice: str = "") -> tuple[str, dict[str, str]]:
    """(chat template, special-token strings it may use: bos_token, eos_token, ...) of the directory
    holding ``tokenizer_path`` (tokenizer_config.json, or a chat_template.jinja beside it); `choice`
    (data.chat_template) "chatml" takes the built-in `CHATML`, a path that .jinja file."""
    path = Path(tokenizer_path).expanduser()
    directory = path if path.is_dir() else path.parent
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    if choice == "chatml":
        return CHATML, special
    if choice:
        given = Path(choice).expanduser()
        if not given.is_file():
            raise FileNotFoundError(f"data.chat_template {choice} is not a file; give a .jinja chat template, "
                                    "'chatml' for the built-in one, or leave it empty for the tokenizer's own")
        return given.read_text(), special
    jinja, processor_json = directory / "chat_template.jinja", directory / "chat_template.json"
    template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
    if template is None and processor_json.is_file():  # a processor's template, as older processors save it
        template = json.loads(processor_json.read_text()).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ValueError(f"format = chat needs a chat template, and {str(directory)!r} has none (no chat_template in "
                         f"tokenizer_config.json, no chat_template.jinja); set data.tokenizer_path to an HF model "
                         f"directory of a chat model")
    return template, special


def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationMarks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationMarks,
                                                                                         "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env


class ChatRenderer:
    """Renders conversations with one template to (token ids, trained flags)."""

    def __init__(self, template: str, tokenizer: Any, *, special_tokens: dict[str, str] | None = None):
        self.source = template
        self.template = _environment().from_string(template)
        self.marks = "generation" in template and "endgeneration" in template
        self.tokenizer = tokenizer  # titan_tpu Tokenizer
        self.special = special_tokens or {}

    def _render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def text(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        """The conversation as text, as transformers' apply_chat_template(tokenize=False) gives it: with
        the assistant's turn opened (add_generation_prompt), else continuing the last message
        (continue_final_message: rendered with a marker after its text, cut at the marker, so its
        end-of-turn and what follows are gone)."""
        if add_generation_prompt or not messages:
            return self._plain(messages, add_generation_prompt=add_generation_prompt)
        marked = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE}]
        text = self._plain(marked, add_generation_prompt=False)
        if _CONTINUE.strip() not in text:
            raise ValueError("the chat template drops the last message's text, so it cannot be continued")
        cut = text.rindex(_CONTINUE.strip())
        return text[:cut] if text[cut:cut + len(_CONTINUE)] == _CONTINUE else text[:cut].rstrip()

    def _plain(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        text = self._render(messages, add_generation_prompt=add_generation_prompt)
        return text.replace(_OPEN, "").replace(_CLOSE, "")

    def prompt_ids(self, messages: Any, *, where: str) -> list[int]:
        """Token ids of a conversation rendered with the generation prompt (the opening of the
        assistant's turn), as transformers' apply_chat_template(add_generation_prompt=True,
        tokenize=True) gives them: what a model continues with its reply (titan-tpu generate)."""
        from jinja2.exceptions import TemplateError

        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in messages):
            raise ValueError(f"chat {where} is not a list of {{role, content}} messages")
        try:
            text = self._render(messages, add_generation_prompt=True).replace(_OPEN, "").replace(_CLOSE, "")
        except TemplateError as e:
            raise ValueError(f"chat {where}: the chat template failed ({e}); check the row or the template") from None
        return self.tokenizer.encode_with_offsets(text)[0]

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(text, assistant character spans [start, end))."""
        if self.marks:
            marked = self._render(messages)
            text, spans, pos = [], [], 0
            for i, piece in enumerate(marked.replace(_CLOSE, _OPEN).split(_OPEN)):
                if i % 2 == 1 and piece:
                    spans.append((pos, pos + len(piece)))
                text.append(piece)
                pos += len(piece)
            return "".join(text), spans
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True)
            through = self._render(messages[: i + 1])
            if not (full.startswith(through) and through.startswith(before)):
                raise ValueError("the chat template does not render a conversation's prefix as a prefix of the whole "
                                 "(it rewrites earlier turns, as Qwen3's does); use a template with {% generation %} "
                                 "blocks: --data.chat_template chatml (the built-in ChatML) or a .jinja file")
            # The whitespace a template puts after the end-of-turn token is not generated (decoding
            # stops at that token): trimmed, which is where {% generation %} blocks end too.
            end = len(through.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return full, spans

    def encode(self, messages: Any, *, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, trained flags as uint8) of one conversation; ``where`` names it in errors."""
        from jinja2.exceptions import TemplateError

        check_messages(messages, where=where)
        if has_image(messages):
            raise ValueError(f"chat {where} holds an image and the model is text-only; train a vision-language model "
                             "(--model.hf_config a Qwen2.5-VL, Gemma 3 or LLaVA directory) or drop the image parts")
        try:
            text, spans = self.render(messages)
        except TemplateError as e:
            raise ValueError(f"chat {where}: the chat template failed ({e}); check the row or the template") from None
        return self.tokens_and_flags(text, spans, where=where)

    def tokens_and_flags(self, text: str, spans: list[tuple[int, int]], *, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, trained flags as uint8) of a rendered conversation and its assistant spans."""
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        trained = np.zeros(len(ids), dtype=np.uint8)
        if ids:
            char_to_token = np.full(len(text) + 1, -1, dtype=np.int64)
            for t, (start, end) in enumerate(offsets):
                char_to_token[start:end] = np.where(char_to_token[start:end] < 0, t, char_to_token[start:end])
            for start, end in spans:
                first, last = char_to_token[start], char_to_token[end - 1]
                if first >= 0 and last >= 0:
                    trained[first : last + 1] = 1
        if not trained.any():
            raise ValueError(f"chat {where}: the assistant turns render to no tokens; check the chat template")
        return np.asarray(ids, dtype=np.int64), trained


def has_image(messages: list[dict]) -> bool:
    """Whether a message's content holds an image part ({"type": "image", ...})."""
    return any(isinstance(part, dict) and part.get("type") == "image"
               for m in messages if isinstance(m.get("content"), list) for part in m["content"])


def check_messages(messages: Any, *, where: str) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"chat {where} is not a list of {{role, content}} messages; set text_field to the column "
                         f"holding them (default 'messages')")
    for k, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and "role" in m and "content" in m):
            raise ValueError(f"chat {where}: message {k} is not a {{role, content}} object (got "
                             f"{str(m)[:80]!r}); fix the row")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"chat {where} has no assistant turn, so nothing to train on; remove it or add the reply")
