"""What a DPO run adds to the assembly: preference data and the DPO objective with its reference.

The reference policy (dpo.reference):

* "initial", without LoRA: a second model built exactly as the trained one (same spec, seed,
  sharding) and given the same starting weights (checkpoint.initial_load_path, or the HF
  directory's own, or the seeded init), frozen: a run resumed from a checkpoint rebuilds it
  from the same start, so a checkpoint holds no copy of it;
* "initial", with LoRA: no second model: the trained model with its adapters off is the base
  model (train/dpo.py, models/lora.py `adapters_disabled`);
* a path (a training checkpoint or an HF directory): a frozen model of the same architecture
  loaded from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from titan_tpu.train.dpo import DPOObjective

if TYPE_CHECKING:
    from titan_tpu.components.build import Components

__all__ = ["dpo_objective", "preference_data"]


def preference_data(c: Components, *, log: Callable[[str], None]):
    """(tokenizer, train loader, validation loader or None) of the run's preference source."""
    from titan_tpu.data.chat import load_chat_template
    from titan_tpu.data.preference import PreferenceLoader, load_preference_pairs
    from titan_tpu.data.tokenizer import load_tokenizer

    cfg, t = c.cfg, c.cfg.training
    source = c.setup.sources[0]
    path = c.setup.tokenizer_path
    if path:
        tokenizer = load_tokenizer(path)
        try:
            template = load_chat_template(path)
        except ValueError:  # no chat template: plain-text rows only (a chat row then says so)
            template = None
    else:  # no tokenizer of the model's: a BPE learned from the pairs' text, as pre-training would
        template = None
        tokenizer = _pair_tokenizer(source.path, vocab_size=c.model_args.vocab_size, cache_dir=cfg.data.cache_dir,
                                    log=log)
    pairs = load_preference_pairs(source.path, tokenizer=tokenizer, seq_len=t.seq_len, chat_template=template)
    val_fraction = cfg.data.val_fraction if cfg.validation.enabled else 0.0
    train = PreferenceLoader(pairs, batch_size=t.batch_size, seed=t.seed, dp_rank=c.dp_rank,
                             dp_world_size=c.dp_size, val_fraction=val_fraction)
    log(f"data: {len(pairs)} preference pairs from {source.path} ({train.num_val} held out for validation)")
    return tokenizer, train, (train if cfg.validation.enabled else None)


def _pair_tokenizer(source: str, *, vocab_size: int, cache_dir: str, log: Callable[[str], None]):
    """A BPE of the model's vocabulary trained on the plain-text columns of the preference pairs."""
    from titan_tpu.components.runtime import cached_bpe_tokenizer
    from titan_tpu.data.preference import COLUMNS, read_preference_rows

    def texts() -> list[str]:
        return [row[c] for _, row in read_preference_rows(source) for c in COLUMNS if isinstance(row[c], str)]

    return cached_bpe_tokenizer(source, texts, kind="preference", vocab_size=vocab_size, cache_dir=cache_dir, log=log)


def dpo_objective(c: Components) -> DPOObjective:
    d = c.cfg.dpo
    reference = c.frozen_reference(d.reference, role="dpo: reference policy")
    return DPOObjective(beta=d.beta, loss_type=d.loss_type, reference=reference)
