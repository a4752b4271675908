"""Benchmarks during training ([evaluation]): lm-evaluation-harness tasks scored on the model being
trained, on the training mesh, every `evaluation.freq` steps and after the last.

Every process hands lm-eval the same requests, as one process would have them (so few-shot draws
and metrics do not depend on the rank count); each data-parallel rank answers its share, the
answers are gathered, and all ranks run the same number of forwards of the sharded model
(harness.py `ScoringRanks`). Rank 0 logs eval/<task>/<metric> in the metrics row and
writes lm-eval's results to lm_eval/step-N.json in the run's directory. On the JAX path the
log-likelihoods come from a scoring program of its own run on the device's state (graph/jax_step.py
`JaxStep.score`), generation from the host copy of the weights.

The tasks and their data are read once, before the first step: rank 0 first (it may fill the
datasets cache), then the others from that cache. lm-eval reseeds the global random generators;
the run's own draws go on after an evaluation as if it had not run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from titan_tpu.evaluation.lm_eval_tasks import (
    TaskSettings,
    chat_renderer,
    load_tasks,
    score,
    task_metrics,
    write_results,
)
from titan_tpu.generate.decoders import decoder_for

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.models.spec_base import ModelSpec
    from titan_tpu.parallel.mesh import BatchSplit


class TrainedRun(Protocol):
    """What scoring during training reads of the run's parts (components/build.py `Components`)."""

    cfg: Config
    spec: ModelSpec
    model: torch.nn.Module
    tokenizer: Any
    step_fn: Any  # the step contract (train/step.py): state_to_host before scoring
    batch_split: BatchSplit  # this rank's row set of the data-parallel ranks: its share of the requests
    world_size: int
    is_main: bool
    run_dir: Path


class TaskEvaluation:
    def __init__(self, components: TrainedRun):
        cfg = components.cfg
        e = cfg.evaluation
        self.components = components
        self.freq = e.freq
        self.settings = TaskSettings(tuple(e.tasks), num_fewshot=None if e.num_fewshot < 0 else e.num_fewshot,
                                     limit=e.limit or None, batch_size=e.batch_size,
                                     include_path=e.include_path or None, apply_chat_template=e.apply_chat_template)
        tokenizer = components.tokenizer
        if e.apply_chat_template and tokenizer.path is None:
            raise ValueError("evaluation.apply_chat_template needs the tokenizer's chat template; set "
                             "data.tokenizer_path to an HF model directory's tokenizer.json")
        self.chat = chat_renderer(tokenizer.path, cfg.data.chat_template) if e.apply_chat_template else None
        self.tasks = _load_in_turn(self.settings, components)

    def due(self, step: int, *, done: bool) -> bool:
        return step % self.freq == 0 or done

    def run(self, step: int) -> dict[str, float]:
        """The tasks' scores at `step` as metrics-row keys (on rank 0; {} on the others)."""
        from titan_tpu.evaluation.harness import HarnessLM, ScoringRanks

        parts = self.components
        parts.step_fn.state_to_host()  # a step that keeps its state elsewhere writes it into the model
        split = parts.batch_split
        ranks = ScoringRanks(split.dp_rank, split.dp_size) if parts.world_size > 1 else None
        model, was_training = parts.model, parts.model.training
        try:
            # the JAX path scores with a program of its own on the device's state; generation (and
            # every other path) runs the model
            lm = HarnessLM(model, parts.tokenizer, max_length=_positions(model, parts.spec.args.max_seq_len),
                           batch_size=self.settings.batch_size, seed=self.components.cfg.training.seed, chat=self.chat,
                           ranks=ranks, scorer=parts.step_fn.score)
            # no bootstrapped standard errors: seconds of CPU per evaluation, not read during training
            results = score(lm, self.tasks, self.settings, bootstrap_iters=0, verbosity="WARNING")
        finally:
            model.train(was_training)
        if not parts.is_main or results is None:
            return {}
        write_results(results, parts.run_dir / "lm_eval" / f"step-{step}.json")
        return task_metrics(results)


def _positions(model: torch.nn.Module, default: int) -> int:
    """Tokens the trained model reads at most: a native model's RoPE table covers training.seq_len
    (longer documents are scored in windows, longer contexts lose tokens on the left)."""
    return decoder_for(model).max_length or default


def _load_in_turn(settings: TaskSettings, components: TrainedRun) -> list:
    """The tasks, loaded by rank 0 before the other ranks read the cache it filled."""
    distributed = components.world_size > 1
    if distributed and not components.is_main:
        torch.distributed.barrier()
    tasks = load_tasks(settings)
    if distributed and components.is_main:
        torch.distributed.barrier()
    return tasks
