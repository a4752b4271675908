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

Chat templates (lm-eval's --apply_chat_template): `apply_chat_template` renders a task's messages
with the tokenizer's template as transformers' `apply_chat_template(tokenize=False)` does for HFLM
(the generation prompt opened, or the last message continued where a task prefills the answer).

Several processes (in-training evaluation on the training mesh, `ScoringRanks`): lm-eval hands every
process all the requests, as to one process, so few-shot draws and metrics are those of one process;
each scoring rank answers its share (every `size`-th request) and the answers are gathered, so every
process returns all of them. A sharded model gathers its weights in every forward, so all processes
run the same number of forwards: a rank with fewer batches runs short dummy ones.

lm_eval is imported at the top: import this module only where lm-eval is wanted
(extras.py `require_lm_eval` checks it is installed first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

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

from titan_tpu.data.batch import IGNORE_INDEX
from titan_tpu.generate import Sampling, generate

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from titan_tpu.data.chat import ChatRenderer
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


@dataclass(frozen=True)
class ScoringRanks:
    """This process's share of the requests: scoring rank `index` of `size` (the data-parallel ranks;
    processes of one scoring rank, tensor-parallel ones, score the same requests). Collectives run
    over all processes of the default process group."""

    index: int = 0
    size: int = 1

    def mine(self, count: int) -> list[int]:
        """The indices of `count` requests this rank answers."""
        return list(range(self.index, count, self.size))

    def most(self, values: list[int]) -> list[int]:
        """Element-wise maximum of every process's `values` (a shorter list counts as 0s)."""
        every = self._all(values)
        width = max(map(len, every))
        return [max(v[i] if i < len(v) else 0 for v in every) for i in range(width)]

    def gather(self, answers: dict[int, Any], count: int) -> list[Any]:
        """All `count` answers, from every rank's {request index: answer}."""
        merged: dict[int, Any] = {}
        for part in self._all(answers):
            merged.update(part)
        return [merged[i] for i in range(count)]

    @staticmethod
    def _all(value: Any) -> list[Any]:
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, value)
        return every


class HarnessLM(TemplateLM):
    """A built model (eval mode, on its device) and its tokenizer, as an lm-eval model.

    max_length: tokens the model reads at most (its position tables' length). batch_size: rows per
    forward. seed: of the sampler, for tasks that sample (do_sample). chat: the tokenizer's chat
    template, for tasks run with lm-eval's apply_chat_template. ranks: this process's share when
    several score together (module docstring); None: one process scores everything. scorer: where
    the log-likelihoods come from instead of the model's logits (`Scorer`: the JAX path's program
    on the chips); generation still runs `model`."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, max_length: int, batch_size: int = 8,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0, chat: ChatRenderer | None = None,
                 ranks: ScoringRanks | None = None, scorer: Scorer | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--batch-size {batch_size} must be >= 1")
        self.model = model.eval()
        self.tok = HarnessTokenizer(tokenizer)
        self.max_length = max_length
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.seed = seed
        self.chat = chat
        self.ranks = ranks
        self.scorer = scorer
        self.tokenizer_path = str(tokenizer.path) if tokenizer.path is not None else ""

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

    # ------------------------------------------------------------------------------------------
    # the requests: each rank its share (module docstring)

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._shared(requests, super().loglikelihood)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        return self._shared(requests, self._loglikelihood_rolling)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return self._shared(requests, self._generate_until)

    def _shared(self, requests: list[Instance], answer) -> list:
        if self.ranks is None:
            return answer(requests)
        mine = self.ranks.mine(len(requests))
        answers = answer([requests[i] for i in mine])  # also with none: the forwards are counted together
        return self.ranks.gather(dict(zip(mine, answers)), len(requests))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context (token lists)."""
        if self.scorer is not None:
            return self._loglikelihood_scored(requests)

        ordered = Collator(requests, sort_fn=longest_first, group_by="contexts",
                           group_fn=lambda request: request[1] + request[2][:-1])
        batches = list(ordered.get_batched(n=self.batch_size))
        # Several ranks: agreed before the first forward, each runs as many as the rank with the most batches.
        forwards = len(batches) if self.ranks is None else self.ranks.most([len(batches)])[0]
        results = []
        for chunk in batches:
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
        for _ in range(forwards - len(batches)):  # another rank has more batches: its forwards gather weights too
            self._logits([[self.prefix_token_id]])
        return ordered.get_original(results)

    def _loglikelihood_scored(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]]
                              ) -> list[tuple[float, bool]]:
        """`_loglikelihood_tokens` through the scorer, which returns each position's log-probability
        of the row's next token, not the logits: every request is its own row (no forward shared by
        one context's continuations), and a batch is batch_size rows of a power-of-two length (at
        most max_length), so that a handful of shapes cover a run; every rank runs the same
        shapes, the longest any rank needs for each batch."""
        ordered = Collator(requests, sort_fn=longest_first)
        batches = list(ordered.get_batched(n=self.batch_size))
        rows = [[(context + continuation)[-(self.max_length + 1):] for _, context, continuation in chunk]
                for chunk in batches]
        widths = [_bucket(max(len(row) - 1 for row in chunk), self.max_length) for chunk in rows]
        if self.ranks is not None:  # a rank with fewer batches runs the others' last ones on padding
            widths = self.ranks.most(widths)
        results = []
        for i, width in enumerate(widths):
            chunk = rows[i] if i < len(rows) else []
            tokens_BS = torch.zeros(self.batch_size, width, dtype=torch.long)
            labels_BS = torch.full((self.batch_size, width), IGNORE_INDEX, dtype=torch.long)
            for b, row in enumerate(chunk):
                tokens_BS[b, :len(row) - 1] = torch.tensor(row[:-1])
                labels_BS[b, :len(row) - 1] = torch.tensor(row[1:])
            logp_BS, greedy_BS = self.scorer(tokens_BS, labels_BS)
            for b, (request, _, continuation) in enumerate(batches[i] if i < len(batches) else []):
                end = len(chunk[b]) - 1
                scored = slice(end - len(continuation), end)
                answer = (float(logp_BS[b, scored].sum()), bool(greedy_BS[b, scored].all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
        return ordered.get_original(results)

    def _loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
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

    def _generate_until(self, requests: list[Instance]) -> list[str]:
        """Each context's continuation, up to the first of its `until` strings (and end-of-text)."""
        ordered = Collator([request.args for request in requests], sort_fn=lambda args: (
            -len(self.tok_encode(args[0])), args[0]), group_by="gen_kwargs", group_fn=lambda args: args[1])
        eot = self.tok.decode([self.eot_token_id], skip_special_tokens=False)
        batches = []  # (chunk, prompts, until, max_gen_toks, sampling)
        for chunk in ordered.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)  # one group: the same kwargs
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eot)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ValueError(f"a task asks for {max_gen_toks} new tokens but the model reads at most "
                                 f"{self.max_length}; lower the task's max_gen_toks")
            prompts = [self.tok_encode(context)[-(self.max_length - max_gen_toks):] for context in contexts]
            batches.append((chunk, prompts, until, max_gen_toks, _sampling(kwargs)))
        # Several ranks: batch i takes as many forwards on every rank (the most new tokens any asks).
        steps = [b[3] for b in batches] if self.ranks is None else self.ranks.most([b[3] for b in batches])
        results = []
        for i, new_tokens in enumerate(steps):
            if i >= len(batches):
                generate(self.model, [[self.prefix_token_id]], max_new_tokens=new_tokens, until_all_stop=False)
                continue
            chunk, prompts, until, max_gen_toks, sampling = batches[i]
            generated = generate(self.model, prompts, max_new_tokens=max_gen_toks, sampling=sampling,
                                 stop_ids={self.eot_token_id}, seed=self.seed, until_all_stop=self.ranks is None)
            if new_tokens > max_gen_toks:
                generate(self.model, [[self.prefix_token_id]], max_new_tokens=new_tokens - max_gen_toks,
                         until_all_stop=False)
            for row, (context, gen_kwargs) in enumerate(chunk):
                text = postprocess_generated_text(self.tok.decode(generated.completion(row)), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return ordered.get_original(results)

    # ------------------------------------------------------------------------------------------
    # chat templates (lm-eval's apply_chat_template)

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.chat.source if self.chat is not None and chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The messages as the tokenizer's chat template renders them for transformers'
        apply_chat_template(tokenize=False): with the assistant's turn opened, or (a task that
        prefills the answer) continuing the last message. A template that refuses a system message
        gets the messages without it, as HFLM retries."""
        from jinja2.exceptions import TemplateError

        if self.chat is None:
            raise ValueError("a task asks for the chat template and this model's tokenizer has none; drop "
                             "--apply-chat-template or give one (--data.chat_template chatml or a .jinja file)")
        try:
            return self.chat.text(chat_history, add_generation_prompt=add_generation_prompt)
        except TemplateError:
            without_system = [message for message in chat_history if message["role"] != "system"]
            return self.chat.text(without_system, add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}


class Scorer(Protocol):
    """Log-likelihoods without the logits: rows (tokens_BS, labels_BS: each position's next token,
    IGNORE_INDEX past the row) -> (logp_BS: each position's log-probability of its label, greedy_BS: 1.0
    where the label is the most likely token), on the host. The JAX path's `JaxStep.score`."""

    def __call__(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def longest_first(request) -> tuple[int, tuple[int, ...]]:
    """The order requests run in: longest first (the first batch finds a shortage of memory at once)."""
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _bucket(width: int, max_length: int) -> int:
    """The row length a batch of `width` tokens runs at: the next power of two, at most max_length."""
    return min(max_length, 1 << max(width - 1, 0).bit_length())


def _sampling(kwargs: dict) -> Sampling:
    """Greedy unless the task samples (do_sample with a temperature above 0), as HFLM decides."""
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    if not kwargs.get("do_sample") or temperature == 0.0:
        return Sampling()
    return Sampling(temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
                    top_p=float(kwargs.get("top_p") or 1.0))
