"""The flat inputs and outputs of each captured program (graph/capture.py): which groups, in which
order, how many tensors each; `StepLayout` flattens named groups to the flat list a traced graph
takes and splits its outputs back into groups. The trainer's steps, the JAX lowering and
`titan-tpu compile` all read a program's boundary through it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepLayout"]


def _slices(groups: list[tuple[str, int]]) -> dict[str, slice]:
    out, start = {}, 0
    for name, count in groups:
        out[name] = slice(start, start + count)
        start += count
    return out


@dataclass(frozen=True)
class StepLayout:
    """The order and size of a captured program's flat inputs and outputs, written once.

    A graph takes and returns flat lists of tensors; each list is a sequence of named groups
    (the params, the moments, the batch, ...). Everything that builds or reads such a list (the
    traced step, its example inputs, GraphStep feeding and unpacking it, the split of the graph at
    the loss, `CapturedStep.summary`) goes through `flatten_*` / `unflatten_*` and the slices here,
    so adding a group is one edit, and no count is written by hand anywhere else.

    Three programs have a layout (`CapturedStep` says what each group means):

    * `whole_step`, one micro-batch per step: params, exp_avg, exp_avg_sq, batch (the batch's
      tensors, data/batch.py: inputs_BS, labels_BS and, with document masking, positions_BS for a
      TokenBatch), num_tokens (the objective's step count), step, lr, buffers -> params, exp_avg,
      exp_avg_sq, loss, grad_norm, totals (the objective's summed totals, train/objective.py),
      buffers (new values of the updated buffers);
    * `micro_batch`, the forward and backward of one micro-batch of an accumulating step:
      params, grads (the sums so far), batch, num_tokens, buffers -> grads (the new sums), totals
      (this micro-batch's);
    * `update`, once per accumulating step: params, grads, exp_avg, exp_avg_sq, totals, step, lr,
      buffers -> what `whole_step` returns;
    * `evaluation`, the forward of one batch for validation: params, batch, buffers -> totals (the
      objective's, with a count of 1: its summed loss first);
    * `scoring`, the forward of one batch of lm-eval's rows: params, batch, buffers -> scores (each
      position's log-probability of its label and whether the label is the most likely token).
    """

    inputs: tuple[tuple[str, int], ...]
    outputs: tuple[tuple[str, int], ...]

    @classmethod
    def whole_step(cls, *, params: int, batch: int, buffers: int, updated_buffers: int) -> StepLayout:
        return cls(inputs=(("params", params), ("exp_avg", params), ("exp_avg_sq", params), ("batch", batch),
                           ("num_tokens", 1), ("step", 1), ("lr", 1), ("buffers", buffers)),
                   outputs=_update_outputs(params, updated_buffers))

    @classmethod
    def micro_batch(cls, *, params: int, batch: int, buffers: int) -> StepLayout:
        return cls(inputs=(("params", params), ("grads", params), ("batch", batch), ("num_tokens", 1),
                           ("buffers", buffers)),
                   outputs=(("grads", params), ("totals", 1)))

    @classmethod
    def evaluation(cls, *, params: int, batch: int, buffers: int) -> StepLayout:
        return cls(inputs=(("params", params), ("batch", batch), ("buffers", buffers)), outputs=(("totals", 1),))

    @classmethod
    def scoring(cls, *, params: int, batch: int, buffers: int) -> StepLayout:
        return cls(inputs=(("params", params), ("batch", batch), ("buffers", buffers)), outputs=(("scores", 2),))

    @classmethod
    def update(cls, *, params: int, buffers: int, updated_buffers: int) -> StepLayout:
        return cls(inputs=(("params", params), ("grads", params), ("exp_avg", params), ("exp_avg_sq", params),
                           ("totals", 1), ("step", 1), ("lr", 1), ("buffers", buffers)),
                   outputs=_update_outputs(params, updated_buffers))

    @property
    def batch(self) -> int:
        """Tensors of one micro-batch the program takes (a TokenBatch: 2, or 3 with positions); 0 for `update`."""
        return dict(self.inputs).get("batch", 0)

    @property
    def loss_output_index(self) -> int | None:
        """Where the first output that depends on the forward only lies (the loss, or the running
        sums whose first value is the loss), for splitting forward from backward; None for `update`."""
        slices = self.output_slices()
        if "batch" not in dict(self.inputs):
            return None
        return slices["loss"].start if "loss" in slices else slices["totals"].start

    def input_groups(self) -> list[tuple[str, int]]:
        return list(self.inputs)

    def output_groups(self) -> list[tuple[str, int]]:
        return list(self.outputs)

    @property
    def num_inputs(self) -> int:
        return sum(count for _, count in self.input_groups())

    @property
    def num_outputs(self) -> int:
        return sum(count for _, count in self.output_groups())

    def input_slices(self) -> dict[str, slice]:
        return _slices(self.input_groups())

    def output_slices(self) -> dict[str, slice]:
        return _slices(self.output_groups())

    def flatten_inputs(self, **groups) -> list:
        """The flat input list from every input group by name (each a sequence of tensors)."""
        return _flatten(self.input_groups(), groups)

    def flatten_outputs(self, **groups) -> list:
        """The flat output list from every output group by name (each a sequence of tensors)."""
        return _flatten(self.output_groups(), groups)

    def unflatten_inputs(self, flat) -> dict[str, list]:
        """Group name -> its tensors of a flat input list."""
        return {name: list(flat[s]) for name, s in self.input_slices().items()}

    def unflatten_outputs(self, flat) -> dict[str, list]:
        """Group name -> its tensors of a flat output list."""
        return {name: list(flat[s]) for name, s in self.output_slices().items()}


def _update_outputs(params: int, updated_buffers: int) -> tuple[tuple[str, int], ...]:
    return (("params", params), ("exp_avg", params), ("exp_avg_sq", params), ("loss", 1), ("grad_norm", 1),
            ("totals", 1), ("buffers", updated_buffers))


def _flatten(layout: list[tuple[str, int]], groups: dict) -> list:
    assert set(groups) == {name for name, _ in layout}, (sorted(groups), layout)
    flat = []
    for name, count in layout:
        assert len(groups[name]) == count, f"group {name}: {len(groups[name])} tensors, the layout says {count}"
        flat.extend(groups[name])
    return flat
