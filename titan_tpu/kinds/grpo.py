"""Group relative policy optimisation (docs/grpo.md): prompts sampled by the policy itself, scored by
rewards (train/rewards.py), trained with the GRPO objective (train/grpo.py) by its own loop
(loops/grpo.py: sample, score, grpo.passes updates); eager, data parallelism alone.

With a KL penalty (grpo.beta > 0) it scores the samples against a frozen reference, built as DPO's
(kinds/dpo.py): a frozen copy of the starting weights or of a checkpoint / HF directory, or under
LoRA with reference "initial" the base model with its adapters off. Unlike DPO's, the reference is
not one of the objective's frozen modules: the loop scores each batch of samples with it once (no
gradients), and every pass over the batch reads those numbers (TRL computes its
ref_per_token_logps once per generation batch too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titan_tpu.data.batch import RolloutBatch
from titan_tpu.kinds.record import DATA_PARALLEL_ONLY, DataParts, DataRequest, TrainingKind
from titan_tpu.train.grpo import GRPOObjective
from titan_tpu.train.rewards import Rewards

if TYPE_CHECKING:
    from torch import nn

    from titan_tpu.config import Config

__all__ = ["GRPO", "SamplingParts"]


@dataclass
class SamplingParts:
    """What the GRPO loop samples and scores with, beside the common parts."""

    rewards: Rewards
    stop_ids: set[int]  # the tokens that end a completion


def prompt_data(request: DataRequest) -> DataParts:
    """The prompt rows of the one source and, as `extras`, the rewards (loaded here, before any model
    is built, so that a reward that cannot be imported fails at once) and the stop ids."""
    from titan_tpu.data.chat import load_chat_template
    from titan_tpu.data.prompts import PromptLoader, load_prompts
    from titan_tpu.data.tokenizer import load_tokenizer

    cfg, t, g = request.cfg, request.cfg.training, request.cfg.grpo
    rewards = Rewards(g.reward, g.reward_weights, answer_column=g.answer_column, pattern=g.reward_pattern,
                      max_completion_length=g.max_completion_length)
    source = request.sources[0]
    template = None
    if request.tokenizer_path:
        tokenizer = load_tokenizer(request.tokenizer_path)
        try:
            template = load_chat_template(request.tokenizer_path, cfg.data.chat_template)
        except ValueError:  # no chat template: plain-text prompts only (a chat row then says so)
            template = None
    else:
        tokenizer = _prompt_tokenizer(source.path, vocab_size=request.vocab_size, cache_dir=request.cache_dir,
                                      log=request.log)
    rows = load_prompts(source.path, tokenizer=tokenizer, max_prompt_len=t.seq_len - g.max_completion_length,
                        chat_template=template)
    loader = PromptLoader(rows, batch_size=t.batch_size, seed=t.seed, dp_rank=request.data_rank,
                          dp_world_size=request.data_size)
    request.log(f"data: {len(rows)} prompts from {source.path}; {g.num_generations} samples of each, "
                f"{t.batch_size} prompts per rank and step")
    return DataParts(tokenizer, loader, None, extras=SamplingParts(rewards, _stop_ids(tokenizer, template)))


def _stop_ids(tokenizer, template) -> set[int]:
    """The tokenizer's end-of-text and, for a chat template, its eos_token (a chat model's end of turn)."""
    stops = {tokenizer.eos_id}
    eos = (template or ("", {}))[1].get("eos_token")
    if eos and tokenizer.token_id(eos) is not None:
        stops.add(tokenizer.token_id(eos))
    return stops


def _prompt_tokenizer(source: str, *, vocab_size: int, cache_dir: Path, log: Callable[[str], None]):
    """A BPE of the model's vocabulary trained on the text of the prompt rows (prompts and string
    columns)."""
    from titan_tpu.data.preference import read_rows
    from titan_tpu.data.tokenizer import cached_bpe_tokenizer

    def texts() -> list[str]:
        return [v for _, row in read_rows(source, columns=("prompt",), what="prompt data") for v in row.values()
                if isinstance(v, str)]

    return cached_bpe_tokenizer(source, texts, kind="prompt", vocab_size=vocab_size, cache_dir=cache_dir, log=log)


def grpo_objective(cfg: Config, reference: nn.Module | None) -> GRPOObjective:
    """The reference is the loop's to score with, not the objective's (module docstring)."""
    g = cfg.grpo
    return GRPOObjective(epsilon=g.epsilon, epsilon_high=g.epsilon_high or None, beta=g.beta, loss_type=g.loss_type,
                         temperature=g.temperature, max_completion_length=g.max_completion_length,
                         kl_correction=g.kl_correction)


def check_grpo(cfg: Config) -> None:
    """What sampling needs of the other sections (the [grpo] keys' own ranges: config.py)."""
    t, g = cfg.training, cfg.grpo
    if cfg.model.scan_layers or cfg.activation_checkpoint.mode != "none":
        raise ValueError("training.objective = grpo samples with the plain layer loop: set model.scan_layers = false "
                         "and activation_checkpoint.mode = none")
    if t.global_batch_tokens:
        raise ValueError("training.global_batch_tokens does not apply to grpo (a step's tokens follow the samples); "
                         "set training.batch_size (prompts per rank) and training.grad_accum_steps")
    samples = t.batch_size * g.num_generations
    if samples % t.grad_accum_steps:
        raise ValueError(f"training.grad_accum_steps = {t.grad_accum_steps} must divide the {samples} samples of a "
                         f"rank's step (training.batch_size {t.batch_size} x grpo.num_generations {g.num_generations})")
    if g.max_completion_length >= t.seq_len:
        raise ValueError(f"grpo.max_completion_length = {g.max_completion_length} leaves no room for a prompt in "
                         f"training.seq_len = {t.seq_len}; raise training.seq_len (prompt + completion tokens)")


def _reference(cfg: Config) -> str | None:
    return cfg.grpo.reference if cfg.grpo.beta > 0 else None  # beta 0: no KL penalty, no reference


def _reference_forwards(cfg: Config) -> float:
    """One forward of the reference per batch of samples, which grpo.passes updates train on."""
    return 1.0 / cfg.grpo.passes if cfg.grpo.beta > 0 else 0.0


GRPO = TrainingKind(
    name="grpo", section="grpo", data_formats=("prompts",), rows="prompt rows", columns="with a prompt column",
    batch=RolloutBatch, data=prompt_data, objective=grpo_objective, loop="grpo",
    rows_per_sample=lambda cfg: cfg.grpo.num_generations, reference=_reference, reference_role="grpo: KL reference",
    reference_forwards=_reference_forwards, modes=("eager",), axes=DATA_PARALLEL_ONLY, check=check_grpo)
