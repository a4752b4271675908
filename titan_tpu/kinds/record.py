"""What a kind of training is, written once: the record every part of a run reads instead of testing
the kind's name.

A kind (pre-training and SFT, DPO, ORPO, GRPO) says what its data is, how many rows a sample makes,
which reference it scores against and what that costs, which modes and mesh axes it runs with, what
it checks, how its data and objective are built, and which loop drives it. The run setup checks a
config against it (kinds/__init__.py `check_kind`), the assembly builds from it
(components/build.py), the planner and `titan-tpu compile` count its rows and its reference, and
the command line hands the assembled parts to its loop (loops/__init__.py).

The builders take explicit arguments (a `DataRequest`, the config and the reference), never the
assembly, so a kind's module depends on nothing above the data and the objectives it builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_tpu.parallel.axes import AXES, DP_AXES

if TYPE_CHECKING:
    from torch import nn

    from titan_tpu.config import Config
    from titan_tpu.data.sources import SourceConfig
    from titan_tpu.train.objective import Objective

__all__ = ["DATA_PARALLEL_ONLY", "FORWARD_COST", "DataParts", "DataRequest", "TrainingKind", "builds_reference_copy",
           "reference_flops", "reference_holder"]

# A trained token's forward and backward cost three forwards (the backward two): a frozen
# reference's forward over the same rows is a third of a trained token's FLOPs.
FORWARD_COST = 3

# The axes of a kind that runs with data parallelism alone (parallel/axes.py).
DATA_PARALLEL_ONLY = DP_AXES


@dataclass(frozen=True)
class DataRequest:
    """What a kind's data builder is given: the run's config and sources, and where this rank reads."""

    cfg: Config
    sources: list[SourceConfig]
    tokenizer_path: str | None  # the model's or the starting weights' tokenizer (run/setup.py); None: learn a BPE
    vocab_size: int
    cache_dir: Path  # data.cache_dir, or the default cache (tokenized sources, learned tokenizers)
    data_rank: int  # this rank's row set of the global batch (parallel/mesh.py)
    data_size: int  # how many row sets the global batch splits into
    documents: bool  # batches carry positions (documents packed into rows): the kind's `documents`, resolved
    log: Callable[[str], None]
    # A vision-language model's directory (its processor renders chat rows with their images); None: text only
    image_model_dir: Path | None = None


@dataclass
class DataParts:
    """What a kind's data builder returns."""

    tokenizer: Any
    train_loader: Any
    val_loader: Any  # None without a validation set
    extras: Any = None  # what the kind's own loop needs beside the common parts (GRPO: its rewards and stop ids)
    # One micro-batch as the loader makes them (CPU), which graph mode captures the step with, for data whose
    # batches hold more than the objective's example has (images); None: the objective's example_batch
    example_batch: Any = None


def _one(cfg: Config) -> int:
    return 1


def _no_reference(cfg: Config) -> str | None:
    return None


def _no_check(cfg: Config) -> None:
    return None


def _no_documents(cfg: Config, sources: list[SourceConfig], *, image_rows: bool) -> bool:
    return False


@dataclass(frozen=True)
class TrainingKind:
    name: str  # training.objective
    section: str | None  # its config section ([dpo], [grpo]), None without one
    data_formats: tuple[str, ...]  # the data.sources formats it reads
    rows: str  # what its data holds, for messages ("preference pairs")
    columns: str  # what each row needs, for messages
    batch: type  # its micro-batch class (data/batch.py)
    data: Callable[[DataRequest], DataParts]
    objective: Callable[[Config, nn.Module | None], Objective]  # (config, its frozen reference or None)
    loop: str = "pretrain"  # the loop that drives it (loops/__init__.py LOOPS)
    one_source: bool = True  # reads exactly one source (False: mixtures of any number)
    rows_per_sample: Callable[[Config], int] = _one  # rows a micro-batch holds per training.batch_size sample
    # The frozen reference it scores against: "initial" (the run's starting weights) or a checkpoint or
    # HF directory; None: no reference. With LoRA, "initial" is the base model with its adapters off.
    reference: Callable[[Config], str | None] = _no_reference
    reference_role: str = ""  # the reference's name in the log ("dpo: reference policy")
    # Forwards of the reference per trained forward + backward of the policy (DPO: one over the same
    # rows; GRPO: one per batch of samples, which grpo.passes updates then train on).
    reference_forwards: Callable[[Config], float] = lambda cfg: 0.0
    modes: tuple[str, ...] = ("eager", "graph")  # the training.mode values it runs with
    axes: tuple[str, ...] = tuple(AXES)  # the mesh axes it may split (parallel/axes.py); the others stay 1
    ignores_labels: bool = False  # its rows' labels skip tokens (a prompt) for the loss kernel
    # Whether its batches carry document positions (packed rows), from its config and sources;
    # image_rows: a vision-language model's chat rows (run/resolved.py reads it once).
    documents: Callable[..., bool] = _no_documents
    replica_groups: bool = False  # runs under fault_tolerance's replica groups
    check: Callable[[Config], None] = _no_check  # what it needs of the other sections, beyond the fields above


def reference_holder(kind: TrainingKind, cfg: Config) -> str:
    """Which model the kind's reference is: "none", "copy" (a frozen model of its own, stored and
    sharded as the trained one) or "adapters off" (the trained model with its LoRA adapters off:
    no second copy)."""
    reference = kind.reference(cfg)
    if reference is None:
        return "none"
    return "adapters off" if reference == "initial" and cfg.lora.enabled else "copy"


def builds_reference_copy(kind: TrainingKind, cfg: Config) -> bool:
    return reference_holder(kind, cfg) == "copy"


def reference_flops(kind: TrainingKind, cfg: Config, trained_flops: float) -> float:
    """The reference's FLOPs per trained token, from the policy's FLOPs per trained token."""
    return trained_flops * kind.reference_forwards(cfg) / FORWARD_COST
