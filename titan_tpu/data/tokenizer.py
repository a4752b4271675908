"""Tokenizers: a thin wrapper over the Hugging Face ``tokenizers`` library.

Either we train a small byte-level BPE on the corpus (the default for debug runs: no download,
vocab sized to the model) or we load any ``tokenizer.json`` (the fast-tokenizer file shipped with
HF models). Either way the training code only needs ``encode``/``decode``, the vocab size, and
the id of the end-of-text token, which doubles as the separator between packed documents.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# End-of-text spellings used by common model families (GPT-2/Qwen, Llama 2/T5, Llama 3, Gemma).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

# 256 byte tokens + the end-of-text token: the smallest vocab a byte-level BPE can have.
MIN_BPE_VOCAB = 257


class Tokenizer:
    """Encode/decode text; ``vocab_size`` and ``eos_id`` are what the model and loader need."""

    def __init__(self, tok: tokenizers.Tokenizer, *, path: str | Path | None = None):
        self._tok = tok
        self.path: Path | None = Path(path) if path is not None else None
        vocab = tok.get_vocab(with_added_tokens=True)
        # max id + 1 rather than len(vocab): some files leave holes in the id space, and the
        # model's embedding must cover every id the tokenizer can emit.
        self.vocab_size: int = max(len(vocab), max(vocab.values()) + 1)
        for name in EOS_CANDIDATES:
            if name in vocab:
                self.eos_token: str = name
                self.eos_id: int = vocab[name]
                break
        else:
            where = f" {str(path)!r}" if path is not None else ""
            raise ValueError(
                f"tokenizer{where} has no end-of-text token (looked for {', '.join(EOS_CANDIDATES)}); "
                f"use a tokenizer.json that defines one, or unset --data.tokenizer_path to train one"
            )
        # Text that happens to contain "<|endoftext|>" (code about tokenizers does) is data, not a
        # document boundary: encode it as ordinary bytes. Only the shard builder inserts eos.
        self._tok.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: no BOS/EOS templates; the shard builder adds eos itself.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once; the Rust side spreads them over all cores."""
        # encode_batch_fast skips computing character offsets, which we never use.
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, character span of each token) with special tokens recognised as such: what a chat
        template's markers (``<|im_start|>``) need, as transformers tokenizes a rendered chat."""
        self._tok.encode_special_tokens = False
        try:
            enc = self._tok.encode(text, add_special_tokens=False)
        finally:
            self._tok.encode_special_tokens = True
        return enc.ids, enc.offsets

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as transformers' tokenizer(text) encodes it: special tokens in the text recognised,
        and what the tokenizer's post-processor adds (Llama 3's begin-of-text token)."""
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=True).ids
        finally:
            self._tok.encode_special_tokens = True

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (e.g. a special token's string), None if it has none."""
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int] | Iterable[int], *, skip_special_tokens: bool = False) -> str:
        # Special tokens kept by default, so a decoded packed stream shows its document separators;
        # skipped for a sampled completion's text, as TRL's GRPO decodes it.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (a crash never leaves a half-written file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self._tok.save(str(tmp))
        os.replace(tmp, path)
        self.path = path

    def __repr__(self) -> str:
        eos = f"{self.eos_token!r}={self.eos_id}"
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={eos}, path={self.path})"


def train_bpe_tokenizer(documents: Iterable[str], *, vocab_size: int, save_path: str | Path) -> Tokenizer:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens, ``<|endoftext|>`` at id 0.

    Byte-level means any text round-trips through encode/decode with no unknown tokens. If the
    corpus is too small to learn enough merges, the vocab is topped up with unused
    ``<|reserved_i|>`` tokens so the size is still exact (the model's embedding is sized by it).
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE (needs >= {MIN_BPE_VOCAB}: "
            f"256 bytes + end-of-text); raise --model.vocab_size"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: encode(a + b) == encode(a) + encode(b) at document boundaries and
    # decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    result = Tokenizer(tok)
    assert result.vocab_size == vocab_size and result.eos_id == 0, result
    result.save(save_path)
    return result


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` (HF fast-tokenizer format); a directory holding one also works."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {str(path)!r} does not exist; set --data.tokenizer_path to a "
            f"tokenizer.json, or unset it to train a BPE on the corpus"
        )
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception on malformed files
        raise ValueError(
            f"tokenizer file {str(path)!r} is not a valid tokenizer.json ({e}); it is damaged (re-download "
            f"it) or of another format: point --data.tokenizer_path at a Hugging Face fast-tokenizer file"
        ) from None
    return Tokenizer(tok, path=path)


# What comes with a tokenizer.json in a Hugging Face directory: the chat template and special tokens
# (data/chat.py reads them beside the tokenizer), and what AutoTokenizer reads.
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def tokenizer_files(tokenizer_json: str | Path) -> list[Path]:
    """The tokenizer.json and its companions beside it that exist: what a run directory and an
    export keep, so a fine-tune started from them finds the same tokenizer and chat template."""
    path = Path(tokenizer_json)
    return [path] + [path.parent / name for name in TOKENIZER_COMPANIONS if (path.parent / name).is_file()]


def cached_bpe_tokenizer(source: str, texts: Callable[[], list[str]], *, kind: str, vocab_size: int,
                         cache_dir: str | Path, log: Callable[[str], None]) -> Tokenizer:
    """A byte-level BPE of the model's vocabulary trained on `texts()` (the text of `source`'s
    rows), cached under `cache_dir` by the source files' fingerprint, so a run and its resume read
    the same tokenizer. kind names the rows in the cache file and the log line ("preference",
    "prompt")."""
    import hashlib
    import json

    from titan_tpu.data.sources import files_fingerprint, resolve_files

    key = hashlib.sha256(json.dumps([files_fingerprint(resolve_files(source)), vocab_size]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"{kind}-{key}.json"
    if path.is_file():
        return load_tokenizer(path)
    rows = texts()
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"data: training a {vocab_size}-token BPE on the {kind} rows (no data.tokenizer_path)")
    tokenizer = train_bpe_tokenizer(rows, vocab_size=vocab_size, save_path=path)
    return load_tokenizer(path) if tokenizer.path is None else tokenizer
