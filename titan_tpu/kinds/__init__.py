"""The kinds of training, each named once (kinds/record.py says what a kind records).

`KINDS` lists them; `kind_of(cfg)` is training.objective's record; `check_kind` checks a config
against it (the run setup calls it). A new kind is a module here beside these (its record, data and
objective builders), its objective in train/, its config section, and one line below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.kinds.dpo import DPO
from titan_tpu.kinds.grpo import GRPO
from titan_tpu.kinds.next_token import NEXT_TOKEN
from titan_tpu.kinds.orpo import ORPO
from titan_tpu.kinds.record import TrainingKind
from titan_tpu.parallel.axes import AXES

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.data.sources import SourceConfig

__all__ = ["KINDS", "TrainingKind", "check_kind", "kind_of"]

KINDS: dict[str, TrainingKind] = {kind.name: kind for kind in (NEXT_TOKEN, DPO, GRPO, ORPO)}


def kind_of(cfg: Config) -> TrainingKind:
    """The record of training.objective."""
    return KINDS[cfg.training.objective]


def check_kind(cfg: Config, sources: list[SourceConfig]) -> None:
    """The run's kind against its record: its data formats only with it, one source where it reads
    one, the mesh axes and modes it runs with, replica groups, the loss kernel, and its own checks."""
    kind = kind_of(cfg)
    if kind.one_source and (len(sources) != 1 or sources[0].format not in kind.data_formats):
        raise ValueError(f"training.objective = {kind.name} reads one source of {kind.rows}: set data.format = "
                         f"{kind.data_formats[0]} and data.source to a jsonl/parquet file {kind.columns}")
    for source in sources:
        if source.format not in kind.data_formats:
            readers = [k for k in KINDS.values() if source.format in k.data_formats]
            names = " or ".join(k.name for k in readers)
            raise ValueError(f"data format = {source.format} holds {readers[0].rows} for training.objective = {names}; "
                             f"set --training.objective {readers[0].name}, or use format "
                             f"{' or '.join(kind.data_formats)}")
    sizes = {axis.size_key: getattr(cfg.parallelism, axis.size_key) for axis in AXES.values()
             if axis.name not in kind.axes and axis.size_key not in kind.axes}
    if any(size > 1 for size in sizes.values()):
        kept = " and ".join(axis for axis in kind.axes if axis in AXES and AXES[axis].size_key == axis)
        got = ", ".join(f"{key} = {size}" for key, size in sizes.items())
        raise ValueError(f"training.objective = {kind.name} runs with {kept} alone; got parallelism.{got}: set them "
                         "to 1")
    if cfg.training.mode not in kind.modes:
        raise ValueError(f"training.objective = {kind.name} runs in training.mode = {' or '.join(kind.modes)}; set "
                         f"--training.mode {kind.modes[0]}")
    if cfg.fault_tolerance.enabled and not kind.replica_groups:
        runs = [k.name for k in KINDS.values() if k.replica_groups]
        raise ValueError(f"fault_tolerance.enabled runs the loops of training.objective = {' or '.join(runs)}; "
                         f"training.objective = {kind.name} is not built for replica groups yet: set it to {runs[0]}")
    if kind.ignores_labels and cfg.kernels.loss == "tokamax":
        raise ValueError(f"kernels.loss = tokamax cannot skip the prompt tokens of {kind.rows} (no ignore index); "
                         "use --kernels.loss chunked")
    kind.check(cfg)
