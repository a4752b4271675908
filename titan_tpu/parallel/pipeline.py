"""Pipeline parallelism inside one step: the layer stack split into stages over the `pp` ranks,
micro-batches passed from stage to stage with a permute, MaxText's schedule.

The schedule (`PipelineSchedule`): `stages` ranks, each holding `repeats` chunks of
`layers_per_chunk` consecutive layers; layer chunk c = repeat * stages + stage, so with repeats 1
stage s holds layers [s * L / pp, (s + 1) * L / pp) (GPipe), and with more repeats the chunks
circle the ranks (MaxText's circular pipeline, Megatron's interleaved layout). Iteration t of the
`micro_batches * repeats + stages - 1` iterations, stage s works on the (t - s)th pass: micro-batch
(t - s) % micro_batches, repeat (t - s) // micro_batches, when 0 <= t - s < micro_batches * repeats;
then every stage hands its activation to the next one (the last to the first, which takes it up
again in its next repeat). A stage without work in an iteration passes its input on unchanged:
those iterations are the bubble, (stages - 1) / (micro_batches * repeats + stages - 1) of the
time. A circular schedule needs micro_batches >= stages, so that a micro-batch's last chunk of one
repeat is done before the first stage needs it for the next.

`run_pipeline` runs it on one rank: plain Python over the iterations, the stage's compute a
function given by the caller, the hand-over a permute (an all-to-all over the pp group, a graph
node when the step is traced; XLA's collective-permute where lowered). Forward and backward both
cross the stages: every permute's backward sends the gradient back to the stage it came from.
Every rank's iterations form one chain (each iteration's input depends on the last permute's
output, also where the stage takes a fresh micro-batch, through a select), so the backward meets
the permutes in the same reverse order on every rank: the collectives match.

On a model (`pipeline_stages`, `PipelineStage`): the scanned stack's rows are laid out stage by
stage and split over pp on the layer dim (SimpleFSDP places them, parallel/simple_fsdp.py); the
step's batch splits into the micro-batches; every stage embeds them (only the first reads them),
the last stage's outputs are then shared out over the stages by token (a reduce-scatter to which
the others add zeros, keeping their chains in the backward: `loss_share`), and every stage runs the
output projection and the loss on its 1 / pp of the tokens (the final norm runs before the
share-out, where tp gathers the sequence), so the head's work and
its logits are spread rather than piled on the last stage; every stage reports the sum over pp.
The weights outside the stack are whole on every stage; their gradients (the first stage's
embedding, every stage's part of the norm and the output) are summed over pp after the backward
(`sum_`, the model contract's `GradientReducer`): inside it, the stages would meet those all-reduces in different orders
among their permutes. Checkpoints name every row by its layer, so they load on any pp.

As one program for every rank (tracing.py `one_program_for_every_rank`: the JAX lowering, `titan-tpu
compile`), no op may depend on the stage: `run_pipeline_spmd` is the same schedule with the stage a
value of the step (group_rank, the pp axis index once lowered). Every stage computes in every
iteration and a select keeps its input where the schedule says it waits (MaxText's form: the bubble
is computed and thrown away); the micro-batch and the chunk of a stage's iteration are values, read
by indexing; every stage holds outputs, and a select keeps the last stage's for the share-out.
The permute is the op ``titan_tpu::pp_permute``, XLA's collective-permute once lowered
(graph/jax_lowering.py). The numbers are the per-rank schedule's.

Layers that do not divide into pp x repeats equal chunks (Llama 3.1 405B's 126 over pp 4) are padded:
the stack gets `PipelineSchedule.rows` rows, the last `padding` of them padding rows (the last
chunks': the last stages' final repeat), so every chunk has the same rows, which the stacked
parameter's even split over pp and the one program need. A padding row is no layer of the model: its
weights are zeros (models/common/scan.py `pad_rows`), the per-rank schedule skips it (no compute), and
the one program, where every stage runs the same ops, runs it and keeps its input by a select (its
weights then take exactly zero gradient: the select passes none to the block, so AdamW's weight decay
and moments keep them zero). State dicts, checkpoints, exports and the parameter count leave padding
rows out; the planner counts their work and memory (plan/pipeline_terms.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_tpu.model_contract import STAGE_ROWS, WHOLE_ON_STAGES
from titan_tpu.parallel.axes import PP_AXIS
from titan_tpu.parallel.group_rank import rank_in
from titan_tpu.parallel.tensor_parallel import reduce_scatter_along
from titan_tpu.tracing import is_one_program

if TYPE_CHECKING:
    from titan_tpu.config import ParallelismConfig

__all__ = ["PipelineSchedule", "PipelineStage", "permute_to_next", "pipeline_stages", "pipelined_layers", "pp_permute",
           "run_pipeline", "run_pipeline_spmd"]


@dataclass(frozen=True)
class PipelineSchedule:
    stages: int  # parallelism.pp
    micro_batches: int  # passes of the whole stack per step, one micro-batch each
    repeats: int = 1  # chunks per stage: 1 is GPipe, more is circular
    n_layers: int = 0  # the model's layers (0: not checked, for a schedule of stage functions alone)

    def __post_init__(self):
        if self.stages < 1 or self.repeats < 1:
            raise ValueError(f"parallelism.pp = {self.stages} and parallelism.pp_repeats = {self.repeats} must be >= 1")
        if self.n_layers and any(all(map(self.is_padding, self.stage_layers(s))) for s in range(self.stages)):
            raise ValueError(f"parallelism.pp ({self.stages}) x parallelism.pp_repeats ({self.repeats}) chunks of the "
                             f"model's {self.n_layers} layers leave a stage with padding rows only; lower pp or "
                             "pp_repeats")
        if self.micro_batches < self.stages:
            raise ValueError(f"parallelism.pp_microbatches = {self.micro_batches} is fewer than the {self.stages} "
                             "pipeline stages (every stage would wait for work every step); raise it to at least "
                             "parallelism.pp")
    @classmethod
    def from_config(cls, p: ParallelismConfig, *, n_layers: int) -> PipelineSchedule:
        """The [parallelism] section's schedule for a model of `n_layers` (pp_microbatches 0: pp of them)."""
        return cls(stages=p.pp, micro_batches=p.pp_microbatches or p.pp, repeats=p.pp_repeats, n_layers=n_layers)

    @property
    def iterations(self) -> int:
        return self.micro_batches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of the iterations a stage waits: (pp - 1) / (repeats x micro-batches + pp - 1)."""
        return (self.stages - 1) / self.iterations

    @property
    def rows(self) -> int:
        """The stack's rows: the layers, padded up to pp x pp_repeats equal chunks with padding rows
        (the module docstring: zero weights that pass their input on)."""
        chunks = self.stages * self.repeats
        return -(-self.n_layers // chunks) * chunks

    @property
    def padding(self) -> int:
        """The padding rows: rows past the model's layers, in the last chunks (0 where the layers divide)."""
        return self.rows - self.n_layers

    def is_padding(self, layer: int) -> bool:
        """Whether row id `layer` (of `chunk_layers`) is padding, no layer of the model."""
        return layer >= self.n_layers

    @property
    def padding_notice(self) -> str:
        """One line on the padding rows, "" without: what a run logs and the plan shows."""
        if not self.padding:
            return ""
        return (f"the model's {self.n_layers} layers do not split into parallelism.pp ({self.stages}) x "
                f"parallelism.pp_repeats ({self.repeats}) equal chunks: padded to {self.rows} with {self.padding} "
                f"identity row{'s' if self.padding > 1 else ''} in the last chunk{'s' if self.padding > 1 else ''} "
                f"({self.padding / self.rows:.1%} of a stage's work, never saved)")

    @property
    def layers_per_chunk(self) -> int:
        return self.rows // (self.stages * self.repeats)

    def chunk_layers(self, stage: int, repeat: int) -> range:
        """The model's layers of `stage`'s chunk in `repeat`; ids from n_layers on are padding rows."""
        first = (repeat * self.stages + stage) * self.layers_per_chunk
        return range(first, first + self.layers_per_chunk)

    def stage_layers(self, stage: int) -> list[int]:
        """Every layer `stage` holds, repeat by repeat."""
        return [layer for repeat in range(self.repeats) for layer in self.chunk_layers(stage, repeat)]

    def work(self, stage: int, iteration: int) -> tuple[int, int] | None:
        """(micro-batch, repeat) `stage` computes in `iteration`, or None in the bubble."""
        n = iteration - stage
        if not 0 <= n < self.micro_batches * self.repeats:
            return None
        return n % self.micro_batches, n // self.micro_batches


class _PermuteToNext(torch.autograd.Function):
    """Each rank of `group` sends its tensor to the next rank (the last to the first); the
    gradient goes back the other way."""

    @staticmethod
    def forward(ctx, x: Tensor, group, shift: int) -> Tensor:
        ctx.group, ctx.shift = group, shift
        return _permute(x, group, shift)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _permute(grad.contiguous(), ctx.group, -ctx.shift), None, None


def _permute(x: Tensor, group, shift: int) -> Tensor:
    if is_one_program():  # the split sizes of permute_tensor's all-to-all differ by rank: one op instead
        return pp_permute(x, shift, dist.get_world_size(group), group.group_name)
    return _permute_all_to_all(x, group, shift)


def _permute_all_to_all(x: Tensor, group, shift: int) -> Tensor:
    size = dist.get_world_size(group)
    destinations = [(rank + shift) % size for rank in range(size)]
    moved = funcol.permute_tensor(x.reshape(-1), destinations, group)
    return funcol.wait_tensor(moved).view(x.shape)


@torch.library.custom_op("titan_tpu::pp_permute", mutates_args=())
def pp_permute(x: Tensor, shift: int, group_size: int, group_name: str) -> Tensor:
    """Rank r of the group named `group_name` (of `group_size` ranks) sends `x` to rank (r + shift) %
    group_size: the permute of a step captured as one program (`_permute`), the same op on every
    rank. graph/jax_lowering.py lowers it to XLA's collective-permute; eagerly the all-to-all."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _permute_all_to_all(x.contiguous(), _resolve_process_group(group_name), shift)


@pp_permute.register_fake
def _(x: Tensor, shift: int, group_size: int, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def permute_to_next(x: Tensor, group) -> Tensor:
    """`x` of the previous stage (rank - 1 along `group`, the first stage receiving the last's)."""
    return _PermuteToNext.apply(x, group, 1)


StageFn = Callable[..., "Tensor | tuple[Tensor, Tensor | None]"]


def _split_out(out) -> tuple[Tensor, Tensor | None]:
    """A stage function's result as (activation, the chunk's statistics or None)."""
    return out if isinstance(out, tuple) else (out, None)


def run_pipeline(stage_fn: StageFn, inputs: list[Tensor], *, schedule: PipelineSchedule,
                 stage: int, group) -> tuple[list[Tensor], Tensor, Tensor | None]:
    """This rank's part of one pass of every micro-batch through every stage (module docstring).

    stage_fn(x, micro_batch, repeat): the stage's chunk of `repeat` applied to micro-batch
    `micro_batch`'s activation x (same shape out); or (that, the chunk's statistics), a tensor of
    the same shape in every call (MoE layers' routing counts; None for a chunk that computed none).
    inputs: the micro-batches' activations entering the first stage (read on stage 0 only; every
    stage passes tensors of their shape). Returns (outputs, last, stats): on the last stage each
    micro-batch's activation after the whole stack, in order (else []); `last`, this rank's
    final activation, the head of its chain, which a stage with no loss of its own puts in its
    backward (a zero-weighted term) so that its permutes' backwards run; the statistics summed over
    the micro-batches, [repeats, *the chunk's], or None when stage_fn returns none."""
    last_stage = schedule.stages - 1
    outputs: list[Tensor | None] = [None] * schedule.micro_batches
    stats: list[Tensor | None] = [None] * schedule.repeats  # per repeat, summed over micro-batches
    waiting: list[Tensor] = []  # stage 0: activations back from the last stage, for their next repeat
    # A stage whose first iterations are bubble passes this zero on, and its permutes must still have
    # a backward, as on the others: it asks for its gradient (a leaf), and it depends on the inputs,
    # for a gradient taken only for chosen leaves (the captured step's), which prunes other branches.
    received = torch.zeros_like(inputs[0], requires_grad=True) + inputs[0] * 0.0
    x = received
    for iteration in range(schedule.iterations):
        work = schedule.work(stage, iteration)
        if stage == 0 and iteration > 0:
            previous = schedule.work(last_stage, iteration - 1)  # what the received activation is
            if previous is not None and previous[1] < schedule.repeats - 1:
                waiting.append(received)  # a pass that comes round again
        if work is None:
            x = received  # the bubble: pass the chain on unchanged
        else:
            micro_batch, repeat = work
            if stage == 0:
                fresh = inputs[micro_batch] if repeat == 0 else waiting.pop(0)
                # a select, not a branch: the received tensor stays in the chain, so its permute's backward runs
                x = torch.where(torch.ones((), dtype=torch.bool, device=fresh.device), fresh, received)
            else:
                x = received
            x, chunk_stats = _split_out(stage_fn(x, micro_batch, repeat))
            if chunk_stats is not None:
                stats[repeat] = chunk_stats if stats[repeat] is None else stats[repeat] + chunk_stats
            if stage == last_stage and repeat == schedule.repeats - 1:
                outputs[micro_batch] = x
        if iteration + 1 < schedule.iterations:
            received = permute_to_next(x, group)
    some = next((t for t in stats if t is not None), None)
    summed = None if some is None else torch.stack([torch.zeros_like(some) if t is None else t for t in stats])
    return (list(outputs) if stage == last_stage else []), x, summed


def run_pipeline_spmd(stage_fn: StageFn, inputs: list[Tensor], *, schedule: PipelineSchedule, stage: Tensor,
                      group) -> tuple[list[Tensor], Tensor, Tensor | None]:
    """`run_pipeline` as one program for every rank (module docstring): the same ops on every stage.

    stage_fn(x, micro_batch, repeat): as run_pipeline's, with micro_batch and repeat 0-dim int64
    tensors (values of the step). stage: this rank's stage, a 0-dim int64 tensor (group_rank).
    Returns (outputs, last, stats): what the last stage's outputs would be, held on every stage (the
    last stage's are the stack's outputs, the others' are thrown away by the caller's select), this
    rank's final activation, and as run_pipeline's the statistics of the iterations the stage works
    in (a select drops the bubble's, computed on whatever the stage held)."""
    stages, micro_batches, passes = schedule.stages, schedule.micro_batches, schedule.micro_batches * schedule.repeats
    first = stage == 0
    received = torch.zeros_like(inputs[0], requires_grad=True) + inputs[0] * 0.0  # as run_pipeline's chain start
    history: list[Tensor] = []  # the activation received in each iteration
    outputs: dict[int, Tensor] = {}
    stats = None
    x = received
    for iteration in range(schedule.iterations):
        history.append(received)
        # Stage 0's input is known per iteration: a fresh micro-batch, then the pass the last stage
        # sent back (received stages - micro_batches iterations ago, in the order the passes left).
        if iteration < micro_batches:
            first_input = inputs[iteration]
        elif iteration < passes:
            first_input = history[iteration - micro_batches + stages]
        else:
            first_input = received
        x_in = torch.where(first, first_input, received)
        n = iteration - stage  # this stage's pass, when 0 <= n < passes
        working = (n >= 0) & (n < passes)
        n = n.clamp(0, passes - 1)
        y, chunk_stats = _split_out(stage_fn(x_in, n % micro_batches, n // micro_batches))
        x = torch.where(working, y, received)  # the bubble: pass the chain on unchanged
        if chunk_stats is not None:  # into the repeat's row, in the iterations the stage works in
            which = torch.arange(schedule.repeats, device=n.device) == n // micro_batches
            keep = (which & working).view(-1, *([1] * chunk_stats.dim()))
            kept = torch.where(keep, chunk_stats.unsqueeze(0), torch.zeros_like(chunk_stats).unsqueeze(0))
            stats = kept if stats is None else stats + kept
        done = iteration - (stages - 1) - (passes - micro_batches)  # the micro-batch the last stage finishes
        if 0 <= done < micro_batches:
            outputs[done] = x
        if iteration + 1 < schedule.iterations:
            received = permute_to_next(x, group)
    return [outputs[m] for m in range(micro_batches)], x, stats


class PipelineStage:
    """One rank's stage of a pipelined Transformer (module docstring), set on the model as
    `model.pipeline` by `pipeline_stages`."""

    def __init__(self, schedule: PipelineSchedule, mesh: DeviceMesh):
        self.schedule = schedule
        self.stage = mesh.get_local_rank(PP_AXIS)
        self.group = mesh.get_group(PP_AXIS)

    @property
    def is_last(self) -> bool:
        """Whether `run` gives this rank the stack's outputs: the last stage; every stage inside one
        program for every rank (`loss_share` keeps the last stage's)."""
        return is_one_program() or self.stage == self.schedule.stages - 1

    def run(self, stack: nn.Module, h_BSD: Tensor, rope: Tensor,
            document_ids_BS: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The embedded batch h_BSD through the stages: on the last stage the stack's output for
        every row, in order; on the others this rank's chain head (for `loss_everywhere`). Inside
        one program for every rank: the outputs on every stage (`run_pipeline_spmd`). Beside it the
        statistics of this stage's rows (MoE routing: [rows of the stage, 2, E], in `stage_layers`
        order, summed over the micro-batches, zeros for padding rows; None for dense blocks)."""
        M = self.schedule.micro_batches
        if h_BSD.shape[0] % M:
            raise ValueError(f"training.batch_size = {h_BSD.shape[0]} rows do not split into "
                             f"parallelism.pp_microbatches = {M} equal micro-batches; make the batch a multiple of it")
        per_row = rope.dim() == 4  # [B, S, P, 2]: each row's own positions (packed documents)
        ropes = rope.chunk(M) if per_row else [rope] * M
        documents = document_ids_BS.chunk(M) if document_ids_BS is not None else [None] * M
        if is_one_program():
            return self._run_one_program(stack, h_BSD, rope=rope, per_row=per_row, documents=documents)
        # This stage's rows, read once for the step; a persistent buffer (an MoE layer's expert_bias)
        # is whole on every stage, its rows laid out stage by stage as the parameters'.
        body, layers = stack.unbound_layers(buffer_rows=lambda t: t.view(self.schedule.stages, -1,
                                                                          *t.shape[1:])[self.stage])
        schedule, chunk = self.schedule, self.schedule.layers_per_chunk

        def stage_fn(x: Tensor, micro_batch: int, repeat: int) -> tuple[Tensor, Tensor | None]:
            stats = []
            for layer, weights in zip(schedule.chunk_layers(self.stage, repeat), layers[repeat * chunk:]):
                if schedule.is_padding(layer):  # a padding row passes its input on: not run at all
                    stats.append(None)
                else:
                    x, layer_stats = body(x, ropes[micro_batch], documents[micro_batch], *weights)
                    stats.append(layer_stats)
            real = next((t for t in stats if t is not None), None)
            if real is None or not real.numel():  # a chunk of padding rows only, or dense blocks: no statistics
                return x, None
            return x, torch.stack([torch.zeros_like(real) if t is None else t for t in stats])

        outputs, last, stats = run_pipeline(stage_fn, list(h_BSD.chunk(M)), schedule=self.schedule, stage=self.stage,
                                            group=self.group)
        return (torch.cat(outputs) if self.is_last else last), _rows(stats)

    def _run_one_program(self, stack: nn.Module, h_BSD: Tensor, *, rope: Tensor, per_row: bool,
                         documents: list[Tensor | None]) -> tuple[Tensor, Tensor | None]:
        """`run` as one program for every rank: the micro-batch's rope and documents and the
        repeat's chunk of rows read by index (values of the step), the same ops on every stage."""
        M, repeats, chunk = self.schedule.micro_batches, self.schedule.repeats, self.schedule.layers_per_chunk
        rope_M = torch.stack(rope.chunk(M)) if per_row else None
        documents_M = torch.stack(documents) if documents[0] is not None else None

        def pick(t_N: Tensor, i: Tensor) -> Tensor:
            return t_N.index_select(0, i.reshape(1)).squeeze(0)

        # Circular: the body reads the iteration's repeat of each weight itself, inside its
        # checkpointed block (a pick outside would be saved, a copy of the stage's layers per iteration).
        # A persistent buffer, whole on every stage, gives the stage's rows by index.
        body, layers = stack.unbound_layers(pick=pick if repeats > 1 else None, buffer_rows=lambda t: pick(
            t.view(self.schedule.stages, -1, *t.shape[1:]), rank_in(self.group, self.stage)))  # read once
        # Row j of a stage's chunk: GPipe's one chunk as read; circular, each weight's row j of every
        # repeat stacked, [repeats, ...].
        rows = layers if repeats == 1 else [
            tuple(torch.stack(ws) for ws in zip(*(layers[r * chunk + j] for r in range(repeats))))
            for j in range(chunk)]

        schedule, stage = self.schedule, rank_in(self.group, self.stage)

        def stage_fn(x: Tensor, micro_batch: Tensor, repeat: Tensor) -> tuple[Tensor, Tensor | None]:
            rope_now = pick(rope_M, micro_batch) if rope_M is not None else rope
            document_ids = pick(documents_M, micro_batch) if documents_M is not None else None
            which = () if repeats == 1 else (repeat,)  # the picking body's index
            first = (repeat * schedule.stages + stage) * chunk  # the chunk's first layer id, a value
            stats = []
            for j, weights in enumerate(rows):
                y, layer_stats = body(x, rope_now, document_ids, *which, *weights)
                # A padding row (zero weights) passes its input on by a select, not by the zeros' arithmetic.
                if schedule.padding:
                    real = first + j < schedule.n_layers
                    x = torch.where(real, y, x)
                    if layer_stats.numel():  # MoE routing counts; dense blocks' are empty
                        layer_stats = torch.where(real, layer_stats, torch.zeros_like(layer_stats))
                else:
                    x = y
                stats.append(layer_stats)
            return x, (torch.stack(stats) if stats[0].numel() else None)

        outputs, _, stats = run_pipeline_spmd(stage_fn, list(h_BSD.chunk(M)), schedule=schedule, stage=stage,
                                              group=self.group)
        return torch.cat(outputs), _rows(stats)

    def layer_statistics(self, stats_R: Tensor) -> Tensor:
        """This stage's rows' statistics (`run`'s, [rows of the stage, ...]) at their layers' rows
        of the stack, [n_layers, ...], zeros at the other stages' layers and without padding rows:
        summed over pp, every layer's."""
        schedule = self.schedule
        stage = rank_in(self.group, self.stage) if is_one_program() else torch.tensor(self.stage)
        repeat = torch.arange(schedule.repeats, device=stats_R.device).unsqueeze(1)
        row = torch.arange(schedule.layers_per_chunk, device=stats_R.device).unsqueeze(0)
        layer_R = ((repeat * schedule.stages + stage.to(stats_R.device)) * schedule.layers_per_chunk + row).flatten()
        full = stats_R.new_zeros(schedule.rows, *stats_R.shape[1:]).index_add(0, layer_R, stats_R)
        return full[:schedule.n_layers]

    def sum_over_stages(self, t: Tensor) -> Tensor:
        """`t` summed over pp (no gradient): what every stage's share adds up to."""
        return funcol.wait_tensor(funcol.all_reduce(t.detach(), "sum", self.group))

    def loss_share(self, h_BSD: Tensor, labels_BS: Tensor) -> tuple[Tensor, Tensor]:
        """(hidden states [N, D], labels [N]) of this stage's share of the loss: the last stage's
        (normed) outputs for the whole batch, flattened to tokens, split over the stages (reduce-scattered:
        the others add zeros), each stage taking 1 / pp of the tokens with their labels. The norm,
        the output projection and the loss then run on every stage for its share, so no stage holds
        the whole batch's logits or does the whole head's work. Tokens are padded to a multiple of
        pp with ignored labels. h_BSD: `run`'s result (on a stage other than the last, outside one
        program, its chain head, kept in the graph with weight zero so its backward runs)."""
        pp = self.schedule.stages
        B, S = labels_BS.shape
        if is_one_program():
            is_last = rank_in(self.group, self.stage) == pp - 1
            h_BSD = torch.where(is_last, h_BSD, torch.zeros_like(h_BSD))
        elif not self.is_last:
            h_BSD = h_BSD.new_zeros(B, S, h_BSD.shape[-1]) + h_BSD.sum() * 0.0
        h_ND, labels_N = h_BSD.flatten(0, 1), labels_BS.flatten()
        pad = -labels_N.numel() % pp
        if pad:
            h_ND = torch.nn.functional.pad(h_ND, (0, 0, 0, pad))
            labels_N = torch.nn.functional.pad(labels_N, (0, pad), value=-100)
        share_ND = reduce_scatter_along(h_ND, self.group, 0)
        stage = rank_in(self.group, self.stage) if is_one_program() else torch.tensor(self.stage)
        labels_share_N = labels_N.view(pp, -1).index_select(0, stage.reshape(1).to(labels_N.device)).squeeze(0)
        return share_ND, labels_share_N

    def loss_everywhere(self, loss_sum: Tensor) -> Tensor:
        """The step's loss on every stage: the sum over pp of each stage's `loss_sum` (of its
        `loss_share`), differentiable in this stage's own share."""
        return loss_sum + (self.sum_over_stages(loss_sum) - loss_sum.detach())

    def sum_(self, grads: dict[str, Tensor]) -> None:
        """Sum over pp, in place and in `grads`' order, the gradients of the weights every stage holds
        whole (replicated over pp): each stage has the part of its own uses."""
        for grad in grads.values():
            if isinstance(grad, DTensor) and _pp_placement(grad) == Replicate():
                dist.all_reduce(grad._local_tensor, group=self.group)

    def summed(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """`sum_` as new tensors, with functional collectives: the captured step's."""
        out = dict(grads)
        for name, grad in grads.items():
            if isinstance(grad, DTensor) and _pp_placement(grad) == Replicate():
                local = funcol.wait_tensor(funcol.all_reduce(grad.to_local(), "sum", self.group))
                out[name] = DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                                               shape=grad.shape, stride=grad.stride())
        return out

    def row_views(self, t: Tensor) -> list[tuple[int, Tensor]]:
        """(row of the stack, that row's tensor) for the rows this stage holds of stacked `t`: a view
        of the local rows, a DTensor on the mesh's other axes when it has any. A buffer (an MoE
        layer's expert_bias) is whole on every stage, each updating every row alike; a stage shows
        (saves and loads) its own rows of it, as of the parameters."""
        per_stage = t.shape[0] // self.schedule.stages
        first = self.stage * per_stage
        if not isinstance(t, DTensor):  # a persistent buffer (expert_bias), whole on every stage: the stage's rows
            return [(first + j, t[first + j]) for j in range(per_stage)]
        if _pp_placement(t) != Shard(0):
            return [(row, t[row]) for row in range(t.shape[0])]
        names = list(t.device_mesh.mesh_dim_names)
        local = t.to_local()
        others = [name for name in names if name != PP_AXIS]
        if not others:
            return [(first + j, local[j]) for j in range(local.shape[0])]
        mesh = t.device_mesh[tuple(others)]
        placements = [Shard(p.dim - 1) if isinstance(p, Shard) else p
                      for name, p in zip(names, t.placements) if name != PP_AXIS]
        shape = t.shape[1:]
        stride = torch.empty(shape, device="meta").stride()
        return [(first + j, DTensor.from_local(local[j], mesh, placements, run_check=False, shape=shape, stride=stride))
                for j in range(local.shape[0])]


def _rows(stats: Tensor | None) -> Tensor | None:
    """[repeats, chunk, ...] statistics as the stage's rows [repeats x chunk, ...] (`stage_layers` order)."""
    return None if stats is None else stats.flatten(0, 1)


def _pp_placement(t: DTensor):
    names = t.device_mesh.mesh_dim_names or ()
    return t.placements[names.index(PP_AXIS)] if PP_AXIS in names else None


def pipelined_layers(args) -> int:
    """The layers pipeline stages split: the model's last run of identical blocks (its one scanned
    stack, or the last of `StackedRuns`: DeepSeek-V3's MoE layers). The runs ahead of it (DeepSeek-V3's
    dense first layers) are whole on every stage and run before the pipeline (docs/architecture.md)."""
    kinds = [args.is_moe_layer(i) for i in range(args.n_layers)]
    return next((n for n, kind in enumerate(reversed(kinds)) if kind != kinds[-1]), len(kinds))


def pipeline_stages(model: nn.Module, mesh: DeviceMesh, schedule: PipelineSchedule) -> None:
    """Make a meta-device Transformer with scanned stacks pipelined over `mesh`'s pp axis, before
    it is materialised: its last stack (`pipelined_layers`) padded to the schedule's rows (padding
    rows last) and its rows laid out stage by stage (the layers of stage 0's chunks, then stage 1's,
    ...), so that SimpleFSDP's split of the layer dim over pp gives each rank its chunks; the stacks
    ahead of it marked whole on every stage (`WHOLE_ON_STAGES`); and `model.pipeline` set."""
    *ahead, stack = [stack for _, stack in model.stacks()]
    assert stack.n_layers == schedule.n_layers, (stack.n_layers, schedule.n_layers)
    for other in ahead:
        for module in other.modules():
            setattr(module, WHOLE_ON_STAGES, True)
    stack.pad_rows(schedule.rows)
    stack.row_layers = [stack.first_layer + layer for stage in range(schedule.stages)
                        for layer in schedule.stage_layers(stage)]
    model.pipeline = PipelineStage(schedule, mesh)
    stack.__dict__[STAGE_ROWS] = model.pipeline.row_views
