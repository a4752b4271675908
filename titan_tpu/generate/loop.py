"""`generate`: new tokens for a batch of prompts from a built model, with its cache.

A library function over a model in memory (a checkpoint loaded by `titan-tpu generate`, or the
policy a training loop holds), so that sampling and training run the same weights. Per step:
the decoder's logits for each row's next token (decoders.py), the token chosen (sampling.py), its
log-probability under the model's own distribution (fp32 log-softmax of the logits at
temperature 1, before any filter: what a training forward's log-softmax gives for that token),
and a row stops after one of `stop_ids` or at `max_new_tokens`. Several samples per prompt: pass
the prompt that many times (each row draws from the one seeded generator in turn).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from titan_tpu.generate.decoders import decoder_for
from titan_tpu.generate.sampling import Sampling, next_tokens

if TYPE_CHECKING:
    from titan_tpu.data.batch import ImageInputs


@dataclass
class Generation:
    """The new tokens of each prompt, rows padded to the longest with `pad_id`."""

    tokens_BN: Tensor  # int64; a row's stop token is kept, what follows it is padding
    logprobs_BN: Tensor  # fp32 log-probability of each new token under the model (0 on padding)
    lengths_B: Tensor  # new tokens per row, the stop token counted
    stopped_B: Tensor  # bool: the row ended at a stop token (else at max_new_tokens)

    def completion(self, row: int) -> list[int]:
        return self.tokens_BN[row, :int(self.lengths_B[row])].tolist()


def check_prompts(prompts: list[list[int]], *, vocab_size: int) -> None:
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]!r} outside the model's vocabulary [0, {vocab_size})")


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: Collection[int] = (), seed: int = 0, pad_id: int = 0,
             compile_backend: str | None = None,
             on_step: Callable[[Tensor, Tensor], None] | None = None, logprob_temperature: float = 1.0,
             until_all_stop: bool = True, images: ImageInputs | None = None) -> Generation:
    """Up to `max_new_tokens` new tokens for each prompt (lists of token ids, of any lengths).

    sampling: greedy by default; a sampled run draws from a generator seeded with `seed`, so the
    same seed gives the same tokens. compile_backend: compile the decode step (e.g. "inductor"; see
    decoders.py). on_step(tokens_B, live_B): called after every step with its tokens and which rows
    were still generating (for streaming). The model runs in eval mode and is left as it was.
    logprob_temperature: the reported log-probabilities are those of softmax(logits / it) (GRPO
    scores its samples at the sampling temperature, as TRL does); 1: the model's own distribution.
    until_all_stop=False: run all `max_new_tokens` steps even when every row stopped (ranks of a
    sharded model gather its weights in every forward, so they take the same number of steps).
    images: a vision-language model's image slots of each prompt, left-padded to the longest prompt
    (data/images.py `ImagePrompts.batch`), read by the prefill (decoders.py)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens} must be >= 1")
    decoder = decoder_for(model, compile_backend=compile_backend)
    check_prompts(prompts, vocab_size=decoder.vocab_size)
    length = max(len(p) for p in prompts) + max_new_tokens
    if decoder.max_length is not None and length > decoder.max_length:
        raise ValueError(f"the longest prompt ({length - max_new_tokens} tokens) plus max_new_tokens "
                         f"({max_new_tokens}) exceeds the model's {decoder.max_length} positions; shorten the prompt "
                         "or generate fewer")
    device, B = decoder.device, len(prompts)
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(seed)
    tokens_BN = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs_BN = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    live_B = torch.ones(B, dtype=torch.bool, device=device)
    lengths_B = torch.zeros(B, dtype=torch.long, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        logits_BV = decoder.prefill(prompts, length=length, images=images)
        for n in range(max_new_tokens):
            token_B = torch.where(live_B, next_tokens(logits_BV, sampling, generator), pad_id)
            logprob_B1 = (logits_BV.float() / logprob_temperature).log_softmax(dim=-1).gather(-1, token_B.unsqueeze(1))
            tokens_BN[:, n] = token_B
            logprobs_BN[:, n] = torch.where(live_B, logprob_B1.squeeze(1), 0.0)
            lengths_B += live_B
            if on_step is not None:
                on_step(token_B, live_B.clone())
            live_B &= ~torch.isin(token_B, stops)
            if n + 1 == max_new_tokens or (until_all_stop and not live_B.any()):
                break
            logits_BV = decoder.step(token_B)
    finally:
        model.train(was_training)
    return Generation(tokens_BN, logprobs_BN, lengths_B, stopped_B=~live_B)
