"""Data the data tests write themselves: documents, a chat tokenizer directory, conversations."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu def class return import".split()

# ChatML with {% generation %} blocks: the form transformers' return_assistant_tokens_mask needs.
CHATML_GENERATION = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_PLAIN = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_docs(n: int, *, seed: int = 0, words: int = 40, tag: str = "doc") -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f"\n# {tag} {i} ünïcödé\n" for i in range(n)]


def write_parquet(path: Path, docs: list[str], *, field: str = "text", rows_per_group: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({field: docs, "id": list(range(len(docs)))})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        import pyarrow as pa

        with pa.output_stream(str(path), compression="zstd") as out:
            out.write(data)
        return path
    path.write_bytes(data)
    return path


def conversations(n: int, *, seed: int = 0, turns: int = 2) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for t in range(turns):
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))})
            messages.append({"role": "assistant",
                             "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + f" {i}.{t}"})
        rows.append({"messages": messages, "id": i})
    return rows


def write_chat_tokenizer_dir(directory: Path, *, template: str = CHATML_GENERATION, vocab_size: int = 400) -> Path:
    """An HF tokenizer directory: a byte-level BPE with ChatML specials, tokenizer_config.json with
    `template`; AutoTokenizer.from_pretrained loads it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [m["content"] for row in conversations(50, seed=1) for m in row["messages"]] + make_docs(50)
    tok.train_from_iterator(text, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template,
              "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
