"""Our models as lm-evaluation-harness 0.4 sees them: `HarnessLM`, a `TemplateLM` over a built model's
forward (model(tokens_BS) -> logits_BSV) and its tokenizer.

The requests mean what they mean for lm-eval's own Hugging Face backend (`HFLM` in
lm_eval/models/huggingface.py), so a checkpoint's scores read like any published ones:

* `loglikelihood` (context, continuation) -> (log-probability of the continuation, whether greedy
  decoding gives it). The pair is split at a token boundary as HFLM splits it (TemplateLM's
  `_encode_pair`: context + continuation encoded whole, the continuation is what follows the
  context's own tokens; trailing spaces of the context move to the continuation); an empty context
  is the prefix token (BOS, else end-of-text). Inputs longer than the model's window lose tokens on
  the left. Requests run longest first in batches, right-padded (the model is causal: padding after
  a row's tokens never reaches them), single-token continuations of one context share one forward.
* `loglikelihood_rolling`: a whole document's log-likelihood, in disjoint windows of the model's
  length (lm_eval.utils.get_rolling_token_windows / make_disjoint_window), each token predicted once.
* `generate_until`: greedy (or sampled, do_sample) continuations through `generate` with its cache,
  stopped at the end-of-text token or `max_gen_toks`, cut at the first of the `until` strings.

Tokens as HFLM's tokenizer gives them: the tokenizer.json's post-processor (Llama 3's BOS) unless
the text starts with the BOS already; special tokens in the text recognised. The BOS and
end-of-text tokens are those tokenizer_config.json beside tokenizer.json names, as transformers
reads them; without one, the tokenizer's end-of-text token serves for both.

lm_eval is imported at the top: import this module only where lm-eval is wanted
(evaluate_tasks.py checks it is installed first).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from titan_tpu.generate import Sampling, generate

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from titan_tpu.data.tokenizer import Tokenizer

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's, when a task names none


class HarnessTokenizer:
    """A tokenizer with the special tokens and encodings lm-eval's requests need."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        named = _special_tokens_named(tokenizer)
        self.eot_id: int = named.get("eos_token", tokenizer.eos_id)
        self.prefix_id: int = named.get("bos_token", self.eot_id)  # what an empty context is

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """As HFLM.tok_encode: None adds the post-processor's tokens unless `text` starts with the BOS."""
        if add_special_tokens is None:
            add_special_tokens = not has_bos_prefix(text, self.decode([self.prefix_id], skip_special_tokens=False))
        if add_special_tokens:
            return self.tokenizer.encode_prompt(text)
        return self.tokenizer.encode_with_offsets(text)[0]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _special_tokens_named(tokenizer: Tokenizer) -> dict[str, int]:
    """bos_token / eos_token ids from the tokenizer_config.json beside the tokenizer file, when it names
    tokens of the vocabulary."""
    if tokenizer.path is None or not (tokenizer.path.parent / "tokenizer_config.json").is_file():
        return {}
    config = json.loads((tokenizer.path.parent / "tokenizer_config.json").read_text())
    named = {}
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_id(token) is not None:
            named[key] = tokenizer.token_id(token)
    return named


class HarnessLM(TemplateLM):
    """A built model (eval mode, on its device) and its tokenizer, as an lm-eval model.

    max_length: tokens the model reads at most (its position tables' length). batch_size: rows per
    forward. seed: of the sampler, for tasks that sample (do_sample)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, max_length: int, batch_size: int = 8,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--batch-size {batch_size} must be >= 1")
        self.model = model.eval()
        self.tok = HarnessTokenizer(tokenizer)
        self.max_length = max_length
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.seed = seed

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.prefix_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=add_special_tokens)

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """The model's logits over right-padded rows: logits_BSV."""
        tokens_BS = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for b, row in enumerate(rows):
            tokens_BS[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        return self.model(tokens_BS.to(self.device))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context (token lists)."""
        def longest_first(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        ordered = Collator(requests, sort_fn=longest_first, group_by="contexts",
                           group_fn=lambda request: request[1] + request[2][:-1])
        results = []
        for chunk in ordered.get_batched(n=self.batch_size):
            # The last max_length + 1 tokens of context + continuation; the model reads all but the last.
            inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            logits_BSV = self._logits(inputs)
            for (request, context, continuation), row, logits_SV in zip(chunk, inputs, logits_BSV):
                # fp32 log-softmax at the continuation's positions only (a batch's whole is rows x vocab large)
                scored_1CV = F.log_softmax(logits_SV[len(row) - len(continuation):len(row)].float(), dim=-1)[None]
                greedy_1C = scored_1CV.argmax(dim=-1)
                for request, cont, scored in ordered.get_cache(req_str=request, cxt_toks=context,
                                                               cont_toks=continuation, logits=scored_1CV):
                    cont_1C = torch.tensor(cont, dtype=torch.long, device=scored.device).unsqueeze(0)
                    is_greedy = bool((greedy_1C[:, -cont_1C.shape[1]:] == cont_1C).all())
                    answer = (float(scored.gather(2, cont_1C.unsqueeze(-1)).sum()), is_greedy)
                    results.append(answer)
                    if request is not None:
                        self.cache_hook.add_partial("loglikelihood", request, answer)
        return ordered.get_original(results)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, every token predicted once, in windows of max_length."""
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, up to the first of its `until` strings (and end-of-text)."""
        ordered = Collator([request.args for request in requests], sort_fn=lambda args: (
            -len(self.tok_encode(args[0])), args[0]), group_by="gen_kwargs", group_fn=lambda args: args[1])
        eot = self.tok.decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        for chunk in ordered.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)  # one group: the same kwargs
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eot)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ValueError(f"a task asks for {max_gen_toks} new tokens but the model reads at most "
                                 f"{self.max_length}; lower the task's max_gen_toks")
            prompts = [self.tok_encode(context)[-(self.max_length - max_gen_toks):] for context in contexts]
            generated = generate(self.model, prompts, max_new_tokens=max_gen_toks, sampling=_sampling(kwargs),
                                 stop_ids={self.eot_token_id}, seed=self.seed)
            for row, (context, gen_kwargs) in enumerate(chunk):
                text = postprocess_generated_text(self.tok.decode(generated.completion(row)), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return ordered.get_original(results)

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}


def _sampling(kwargs: dict) -> Sampling:
    """Greedy unless the task samples (do_sample with a temperature above 0), as HFLM decides."""
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    if not kwargs.get("do_sample") or temperature == 0.0:
        return Sampling()
    return Sampling(temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
                    top_p=float(kwargs.get("top_p") or 1.0))
