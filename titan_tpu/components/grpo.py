"""What a GRPO run adds to the assembly: the prompt rows, the rewards, the GRPO objective and, with a
KL penalty (grpo.beta > 0), the frozen reference.

The reference (grpo.reference), built as DPO's (components/dpo.py):

* "initial", without LoRA: a second model built exactly as the trained one and given the same
  starting weights, frozen; a resumed run rebuilds it from the same start;
* "initial", with LoRA: none: the trained model with its adapters off is the base model;
* a path (a training checkpoint or an HF directory): a frozen model loaded from it.

Unlike DPO's, the reference is not one of the objective's frozen modules: the loop scores each
batch of samples with it once (no gradients), and every pass over the batch reads those numbers
(TRL computes its ref_per_token_logps once per generation batch too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from titan_tpu.train.grpo import GRPOObjective

if TYPE_CHECKING:
    from titan_tpu.components.build import Components

__all__ = ["grpo_objective", "grpo_reference", "prompt_data"]


def prompt_data(c: Components, *, log: Callable[[str], None]):
    """(tokenizer, train loader of prompt rows, None: no validation set); sets c.rewards (loaded
    here, before any model is built, so that a reward that cannot be imported fails at once) and
    c.stop_ids."""
    from titan_tpu.data.chat import load_chat_template
    from titan_tpu.data.prompts import PromptLoader, load_prompts
    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.train.rewards import Rewards

    cfg, t, g = c.cfg, c.cfg.training, c.cfg.grpo
    c.rewards = Rewards(g.reward, g.reward_weights, answer_column=g.answer_column, pattern=g.reward_pattern,
                        max_completion_length=g.max_completion_length)
    source = c.setup.sources[0]
    path = c.setup.tokenizer_path
    template = None
    if path:
        tokenizer = load_tokenizer(path)
        try:
            template = load_chat_template(path, cfg.data.chat_template)
        except ValueError:  # no chat template: plain-text prompts only (a chat row then says so)
            template = None
    else:
        tokenizer = _prompt_tokenizer(source.path, vocab_size=c.model_args.vocab_size, cache_dir=cfg.data.cache_dir,
                                      log=log)
    rows = load_prompts(source.path, tokenizer=tokenizer, max_prompt_len=t.seq_len - cfg.grpo.max_completion_length,
                        chat_template=template)
    loader = PromptLoader(rows, batch_size=t.batch_size, seed=t.seed, dp_rank=c.dp_rank, dp_world_size=c.dp_size)
    c.stop_ids = _stop_ids(tokenizer, template)
    log(f"data: {len(rows)} prompts from {source.path}; {cfg.grpo.num_generations} samples of each, "
        f"{t.batch_size} prompts per rank and step")
    return tokenizer, loader, None


def _stop_ids(tokenizer, template) -> set[int]:
    """The tokenizer's end-of-text and, for a chat template, its eos_token (a chat model's end of turn)."""
    stops = {tokenizer.eos_id}
    eos = (template or ("", {}))[1].get("eos_token")
    if eos and tokenizer.token_id(eos) is not None:
        stops.add(tokenizer.token_id(eos))
    return stops


def _prompt_tokenizer(source: str, *, vocab_size: int, cache_dir: str, log: Callable[[str], None]):
    """A BPE of the model's vocabulary trained on the text of the prompt rows (prompts and string
    columns)."""
    from titan_tpu.components.runtime import cached_bpe_tokenizer
    from titan_tpu.data.preference import read_rows

    def texts() -> list[str]:
        return [v for _, row in read_rows(source, columns=("prompt",), what="prompt data") for v in row.values()
                if isinstance(v, str)]

    return cached_bpe_tokenizer(source, texts, kind="prompt", vocab_size=vocab_size, cache_dir=cache_dir, log=log)


def grpo_objective(c: Components) -> GRPOObjective:
    g = c.cfg.grpo
    return GRPOObjective(epsilon=g.epsilon, epsilon_high=g.epsilon_high or None, beta=g.beta, loss_type=g.loss_type,
                         temperature=g.temperature, max_completion_length=g.max_completion_length,
                         kl_correction=g.kl_correction)


def grpo_reference(c: Components) -> torch.nn.Module | None:
    """The frozen reference of the KL penalty; None without one (beta 0) or where the trained model
    with its adapters off is it (LoRA, reference "initial")."""
    if c.cfg.grpo.beta == 0:
        return None
    return c.frozen_reference(c.cfg.grpo.reference, role="grpo: KL reference")
