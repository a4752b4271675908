"""What pipeline stages (parallelism.pp, parallel/pipeline.py) change in a plan: the plan is the last
stage's, the one that also runs the final norm on the whole batch (every stage then runs the output
projection and the loss on its share of the tokens).

* Memory. A stage stores its share of the scanned stack (layers / pp rows, sharded over dp_shard as
  ever) and the weights outside it whole (embedding, final norm, output projection; sharded over
  dp_shard), with their gradients and AdamW moments. It reads its rows once per step and keeps them
  gathered (the model is built without buckets or re-sharding under pp: models/spec.py), so the
  gathered copies and the full-size gradient are its whole stage's. The planner counts all of that
  with the model's args cut to one stage's layers (`stage_args`): every term that sums over layers
  sums over the stage's.
* Padding. Layers that do not fill pp x repeats equal chunks are padded with identity rows
  (parallel/pipeline.py): a stage holds rows / pp rows, and its weights, gradients, moments and
  activations are counted for all of them; its block work is stretched by rows / layers (the one
  program runs the padding rows; the per-rank schedule skips them, but its stages wait for the one
  that holds no padding). The model's FLOPs (MFU) count the layers only.
* Activations. The schedule is one program: the backward of the whole loop of
  micro_batches x repeats + pp - 1 iterations runs after its forward, so what every iteration saved
  is alive at the backward's start (GPipe's memory, not 1F1B's). Of those iterations a stage
  computes in micro_batches x repeats, each one chunk (layers / (pp x repeats) layers) of one
  micro-batch (batch_size / micro_batches rows); in the other pp - 1 (the bubble) it passes its
  input on, and the permute saves nothing. So a stage holds its layers' activations for every row of
  the batch: the per-layer term of the whole batch times layers / pp, or under full checkpointing
  each layer's input only (every layer of a chunk is its own checkpointed block). One layer's
  recomputation is one micro-batch's. The loss sees 1 / pp of the batch's tokens: the last stage's
  outputs are shared out over the stages.
* Time. A stage computes 1 / pp of the blocks' work and, in lockstep with the others, waits in the
  bubble, (pp - 1) / (repeats x micro-batches + pp - 1) of the loop: its block work is stretched by
  1 / (1 - bubble). The output projection and the loss run after the loop (their backward before the
  loop's backward) on every stage's share of the tokens, so their work is divided over the stages
  and not stretched.
* Traffic (`pipeline_collectives`). Each iteration but the last hands every stage's activation,
  one micro-batch [rows, seq, dim] in the compute dtype, to the next stage, and the backward sends
  its gradient back: 2 x (iterations - 1) permutes per accumulated batch, on the fabric the pp axis
  crosses. The last stage's outputs are shared out to the stages' losses (a reduce-scatter of the
  batch's [tokens, dim], the gradient gathered back). After the backward the gradients of the
  weights every stage holds whole are summed over pp (an all-reduce of each one's fp32 shard, once
  per step).
"""

from __future__ import annotations

import dataclasses

from titan_tpu.models.registry import flops_per_token, head_flops_per_token, num_params
from titan_tpu.parallel.pipeline import PipelineSchedule
from titan_tpu.parallel.plan_terms import Collective

__all__ = ["ahead_flops_device", "ahead_layers", "head_flops_device", "pipeline_collectives", "shared_params",
           "stage_args", "stage_compute_flops"]


def stage_args(args, schedule: PipelineSchedule | None):
    """The model's args as one stage holds it: the layers ahead of the stages whole (DeepSeek-V3's
    dense first layers: parallel/pipeline.py `pipelined_layers`), its rows / pp of the pipelined
    stack (padding rows included; an MoE stack's experts and routers with them), everything outside
    the stack whole; the args themselves without stages."""
    if schedule is None:
        return args
    assert not args.mtp_num_layers, "pipeline stages run models without multi-token prediction (run/setup.py)"
    return dataclasses.replace(args, n_layers=ahead_layers(args, schedule) + schedule.rows // schedule.stages)


def ahead_layers(args, schedule: PipelineSchedule) -> int:
    """The layers ahead of the pipelined stack, whole on every stage: 0 unless the model's first
    layers are another kind of block than the rest (DeepSeek-V3's dense first layers)."""
    return args.n_layers - schedule.n_layers if schedule.n_layers else 0


def shared_params(stage, schedule: PipelineSchedule) -> int:
    """The elements of the weights every stage holds whole (`stage`: `stage_args`'s), whose gradients
    are summed over pp after the backward: the embedding, the final norm, the output projection and
    the layers ahead of the stages."""
    outside = stage.dim + stage.vocab_size * stage.dim * (1 if stage.tie_embeddings else 2)
    ahead = stage.n_layers - schedule.rows // schedule.stages  # `stage_args`'s layers ahead of its rows
    return num_params(dataclasses.replace(stage, n_layers=ahead)) if ahead else outside


def ahead_flops_device(args, schedule: PipelineSchedule, *, seq_len: int, tokens_device: float) -> float:
    """The FLOPs (forward and backward) of the layers ahead of the stages on a device's tokens
    (`args`: the whole model's): every stage runs them on the whole batch, before the loop."""
    ahead = ahead_layers(args, schedule)
    if not ahead:
        return 0.0
    # The ahead layers' model alone, less its final norm and output projection (6 FLOPs per weight and token)
    outside = 6 * args.dim * (1 + args.vocab_size)
    per_token = flops_per_token(dataclasses.replace(args, n_layers=ahead), seq_len) - outside
    return per_token * tokens_device


def stage_compute_flops(*, executed_device: float, head_device: float, schedule: PipelineSchedule,
                        ahead_device: float = 0.0) -> float:
    """The FLOPs a stage's step takes as long as (the module docstring): its share of the blocks'
    work stretched by the bubble, and its share of the output projection's (`head_device`), run
    after the loop on every stage's share of the tokens; the layers ahead of the stages whole
    (`ahead_device`, of which `executed_device` holds 1 / pp), before the loop, not stretched."""
    blocks = executed_device - head_device - ahead_device / schedule.stages
    blocks *= schedule.rows / schedule.n_layers  # padding rows run like layers
    return blocks / (1.0 - schedule.bubble) + head_device + ahead_device


def head_flops_device(args, *, tokens_device: float) -> float:
    """The output projection's FLOPs (forward and backward) counted in a device's share of the step."""
    return head_flops_per_token(args) * tokens_device


def pipeline_collectives(*, schedule: PipelineSchedule, tokens: int, dim: int, accum: int, compute_bytes: int,
                         shared_params: float, shared_tensors: int, split: int, tp: int) -> list[Collective]:
    """The permutes between stages and the shared weights' gradient sums of one step (the module
    docstring), the bytes each rank sends. tokens: one accumulated batch's tokens of a
    data-parallel rank (batch_size x seq_len); split: the ranks that hold 1 / split of each
    activation (tp's sequence-parallel residual x cp), tp of them tp's; shared_params: the elements of the weights
    outside the stack a rank stores (its dp_shard x tp shard), in `shared_tensors` tensors."""
    pp = schedule.stages
    micro_batch = tokens / schedule.micro_batches * dim * compute_bytes / split
    permutes = 2 * (schedule.iterations - 1) * accum
    shared = 2 * (pp - 1) / pp * shared_params * 4  # the fp32 gradient shards, summed once per step
    # The last stage's outputs shared out to the loss (a reduce-scatter) and their gradient gathered
    # back, on every token of the batch the tp ranks hold whole after the final norm (split / tp: cp's)
    share_out = 2 * (pp - 1) / pp * tokens * dim * compute_bytes / (split // tp) * accum
    return [Collective("permute", "pp", pp, permutes * micro_batch,
                       f"micro-batch activations to the next stage and their gradients back "
                       f"({schedule.iterations - 1} iterations each way)", permutes),
            Collective("reduce_scatter", "pp", pp, share_out,
                       "the last stage's outputs shared out to every stage's loss, and their gradient back", 2 * accum),
            Collective("all_reduce", "pp", pp, shared, "gradients of the weights every stage holds, once per step",
                       shared_tensors)]
