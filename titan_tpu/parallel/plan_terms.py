"""What a parallel layout costs per rank, for the planner (titan_tpu/plan): the share of each
parameter a rank stores, the gathered copies it holds while computing, and the bytes each
collective moves per step. Beside the layouts it describes (simple_fsdp.py, expert_parallel.py),
so that a new layout brings its own numbers.

Facts of the current code these terms encode (read from it, checked by tests/test_planner.py and
the calibration in docs/planner.md):

* SimpleFSDP stores every parameter sharded over dp_shard (expert weights over dp_shard too: ep
  by expert, the rest by row), whole over dp_replicate.
* Reading a weight all-gathers it in the compute dtype, and autograd keeps what a matmul needs
  for its backward. With re-sharding after the forward (`parallelism.reshard_after_forward`, the
  default; parallel/reshard.py) autograd keeps a token instead of a gathered block weight and the
  backward gathers the block again, so about two layers' gathered weights are alive at a time
  (`gather` = "layer"); a scanned stack is gathered one layer at a time inside the loop. Without
  it (or with per-parameter collectives, bucket_mb 0) every block weight stays gathered from the
  forward to the end of the backward (`gather` = "model"); so does a scanned stack in graph mode
  without full activation checkpointing, where scan's own partitioner saves each layer's gathered
  weights stacked (it never recomputes a collective).
* Parameters, gradients and AdamW moments are fp32 (master weights) on one process too; there a
  compute dtype below fp32 casts each weight when read (simple_fsdp.cast_for_compute), and the
  cast copies stay alive from the forward to the backward like gathered weights kept whole.
* The gradient of a gathered weight is full size (reduce dtype) until it is reduce-scattered
  into the shard: one parameter at a time when unrolled; a scanned stack's gradient whole when it
  was gathered whole, one layer's when gathered per layer (re-sharding).
* Collectives (ring algorithms; bytes sent per rank): forward all-gather of every weight and
  backward reduce-scatter of every gradient, (n - 1) / n of the full size each, per micro-batch;
  an all-reduce over dp_replicate of the sharded gradients, 2 (r - 1) / r; expert parallelism
  all-gathers each MoE layer's tokens and routing over ep and reduce-scatters the outputs in the
  forward (the reverse in the backward, and again when a checkpointed block is recomputed).
* Tensor parallelism (parallel/tensor_parallel.py) splits every weight over tp (the norms, a few
  vectors, are counted as split too), so stored, gathered and full-size gradient terms divide by
  tp, and the data-parallel collectives move 1 / tp of the weights. Its own collectives act on
  activations [tokens, dim] in the compute dtype, per micro-batch: per block an all-gather and a
  reduce-scatter around attention and around the feed-forward, plus the embedding's
  reduce-scatter and the gather after the final norm, each again (swapped) in the backward and,
  for recomputed blocks, in the recomputation; and the vocabulary-parallel loss's three
  all-reduces of one fp32 value per token. The norms' gradient all-reduces (vectors) are left out.
* Context parallelism (parallel/context_parallel.py) stores parameters whole over cp (replicated:
  stored terms do not divide by cp) and all-reduces every gradient over cp in each micro-batch's
  backward, 2 (cp - 1) / cp of the sharded gradient. Per block it all-gathers keys and values
  ([tokens, kv dim] of the whole sequence, compute dtype) in the forward (again when recomputed)
  and reduce-scatters their gradients in the backward; with document masks also the int32
  document ids. The loss's all-reduce over cp (one value) is left out. Its activations are the
  planner's (titan_tpu/plan/memory.py: the rank's tokens, plus `cp_attention_saved_bytes`).
* cp x tp: tensor parallelism works on a cp rank's tokens (its collectives and the loss's
  all-reduces move 1 / cp of the micro-batch's tokens), and cp gathers the keys and values of a
  tp rank's kv heads (1 / tp of the kv dim; the document ids whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_tpu.parallel.axes import AXES, EP_OUTER_AXIS, MESH_AXES

__all__ = ["Layout", "Collective", "cp_collectives", "ep_dispatch_bytes"]

# Collective calls of one MoE layer's dispatch per pass: all_gather gathers tokens, choices and
# weights and reduce-scatters the outputs; all_to_all exchanges the row counts, then sends
# tokens, choices and weights and returns the outputs.
EP_DISPATCH_CALLS = {"all_gather": 4, "all_to_all": 5}


def ep_dispatch_bytes(kind: str, *, tokens: int, dim: int, top_k: int, num_experts: int, ep: int,
                      compute_bytes: int, padded: bool = False) -> float:
    """Bytes one rank sends for one MoE layer's dispatch, one way (the tokens [T, D] with their
    choices [T, k] int64 and weights [T, k] to the experts, the outputs [D] back).
    all_gather: every token to the ep - 1 other ranks, and the reduce-scatter of [ep T, D] sends
    (ep - 1) T rows. all_to_all: each token once to each other rank that holds one of its experts:
    with routing spread evenly, a token's k distinct experts miss a given rank's E / ep with
    probability C(E - E/ep, k) / C(E, k); padded (a static worst-case buffer sent whole): T rows
    to each other rank, the all-gather's bytes. Plus the row counts (ep int64) for all_to_all."""
    row = dim * compute_bytes + top_k * (8 + compute_bytes) + dim * compute_bytes  # there and back
    if kind == "all_gather" or padded:
        copies = ep - 1
    else:
        local = num_experts // ep
        copies = (ep - 1) * (1 - math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k))
    return tokens * copies * row + (ep * 8 if kind == "all_to_all" else 0)


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce
    axis: str  # dp_shard | dp_shard_mod_ep | dp_replicate | ep | tp | cp
    group_size: int
    bytes_per_step: float  # bytes each rank sends per optimizer step
    purpose: str
    calls: int = 0  # collective calls per optimizer step (each pays the hardware's per-call latency)


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh (parallel/mesh.py ParallelDims) and the dtypes SimpleFSDP uses."""

    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages: not counted by the terms yet (the planner refuses pp > 1)
    compute_bytes: int = 4  # model.dtype
    reduce_bytes: int = 4  # parallelism.reduce_dtype
    # How long gathered weights live (module docstring). "layer": re-sharded after the forward, a
    # layer's weights gathered again for its backward, two layers' worth live at a time (one
    # prefetched). "model": every block weight from its forward gather to the end of the backward.
    gather: str = "layer"
    # How MoE tokens reach their experts under ep (parallel/expert_parallel.py): all_gather or
    # all_to_all; ep_padded: the all_to_all sends its static worst-case buffer whole (captured
    # steps on CPU/CUDA; TPU's ragged all-to-all and eager steps send the real rows only).
    ep_dispatch: str = "all_gather"
    ep_padded: bool = False

    def __post_init__(self):
        for name in dict.fromkeys(axis.size_key for axis in AXES.values()):  # each axis's size, once
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name} = {getattr(self, name)} must be >= 1")
        if self.gather not in ("model", "layer"):
            raise ValueError(f"gather = {self.gather!r}: use layer (re-shard after forward) or model (keep gathered)")
        if self.ep > 1 and self.dp_shard % self.ep != 0:
            raise ValueError(f"parallelism.ep ({self.ep}) must divide parallelism.dp_shard ({self.dp_shard})")

    def mesh_sizes(self) -> dict[str, int]:
        """Each axis of the dense mesh -> its size, outermost first (parallel/axes.py MESH_AXES)."""
        return {axis: getattr(self, AXES[axis].size_key) for axis in MESH_AXES}

    @property
    def world(self) -> int:
        return math.prod(self.mesh_sizes().values())

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors (any mesh): fp32 master weights and gathered compute copies."""
        return self.world > 1

    def master_bytes(self) -> int:
        """Bytes per stored parameter element: fp32 master weights, on one device as on many
        (docs/mixed_precision.md)."""
        return 4

    def stored_elements(self, total_params: int, expert_params: int = 0) -> float:
        """Elements of parameters (and of each AdamW moment, and of the sharded gradient) a rank
        stores: 1 / (dp_shard x tp) of every parameter, 1 / dp_shard of the MoE experts (whole on tp:
        parallel/expert_parallel.py), which `total_params` includes."""
        return (total_params - expert_params) / (self.dp_shard * self.tp) + expert_params / self.dp_shard

    def local_block_elements(self, *, block_params: int, expert_params: int) -> float:
        """Elements of the block weights a rank computes with: all of them, but only its own
        experts under expert parallelism, its tp shard of the rest under tensor parallelism."""
        return (block_params - expert_params) / self.tp + expert_params / self.ep

    def gathered_bytes(self, *, block_params: int, expert_params: int, n_layers: int) -> float:
        """Gathered compute copies of block weights a rank holds through the forward and backward
        (see the module docstring and `gather`). Without data-parallel axes (one process, or
        tensor parallelism alone) nothing is gathered: fp32 weights are used in place (0); a lower
        compute dtype's cast copies are kept from the forward to the backward, all of them (nothing
        re-casts per layer there)."""
        local = self.local_block_elements(block_params=block_params, expert_params=expert_params)
        if self.dp_shard * self.dp_replicate * self.cp == 1:  # cp: replicated, read through buckets like replicas
            return 0.0 if self.compute_bytes == 4 else local * self.compute_bytes
        if self.gather == "layer":
            local = min(local, 2 * local / n_layers)
        return local * self.compute_bytes

    def full_gradient_bytes(self, *, largest_param: int, block_params: int, expert_params: int, n_layers: int,
                            scanned: bool) -> float:
        """The largest full-size gradient alive before its reduce-scatter (reduce dtype): the whole
        layer stack when scanned and gathered whole (the stack's gradient comes out of the loop
        whole; pass scanned=False when the stack is gathered per layer), one parameter when
        unrolled, one layer with `gather` = layer; 0 on one process."""
        if not self.sharded:
            return 0.0
        local = self.local_block_elements(block_params=block_params, expert_params=expert_params)
        if self.gather == "layer":
            return max(local / n_layers, largest_param) * self.reduce_bytes
        return (local if scanned else largest_param) * self.reduce_bytes

    def step_collectives(self, *, total_params: int, expert_params: int, micro_batches: int,
                         moe_layers: int, tokens_per_micro_batch: int, dim: int, top_k: int,
                         recompute_blocks: bool, regathered_params: int = 0, gathers: int = 0,
                         regathers: int = 0, n_layers: int = 0, num_experts: int = 0,
                         trained_params: int | None = None, trained_expert_params: int | None = None
                         ) -> list[Collective]:
        """Every collective of one optimizer step with the bytes each rank sends and its calls.
        trained_params / trained_expert_params: the elements with gradients (LoRA's adapters, an hf
        model's trained parts), which the gradient collectives move; default every parameter.
        regathered_params: block parameters gathered a second time in the backward (re-sharding
        after the forward); gathers / regathers: collective calls of SimpleFSDP per micro-batch
        in the forward / again in the backward (`collective_calls`); n_layers: blocks (tensor
        parallelism's collectives are per block); num_experts: per MoE layer (the all-to-all's
        count depends on how many ranks a token's experts fall on)."""
        out = []
        n, r, ep = self.dp_shard, self.dp_replicate, self.ep
        trained_params = total_params if trained_params is None else trained_params
        trained_expert_params = expert_params if trained_expert_params is None else trained_expert_params
        # What the data-parallel axes move: this rank's tp shard, of the experts all (whole on tp).
        total_params = (total_params - expert_params) / self.tp + expert_params
        trained_params = (trained_params - trained_expert_params) / self.tp + trained_expert_params
        if regathered_params:
            regathered_params = (regathered_params - expert_params) / self.tp + expert_params
        if n > 1:
            # Dense weights gather over dp_shard; under ep the experts over the dp_shard / ep ranks that
            # hold the same experts (dp_shard_mod_ep, a wider stride: parallel/fabric_terms.py), each
            # its own entry so each is timed on the fabric its axis crosses. The experts' calls are
            # counted in dp_shard's (the same buckets).
            m = n // ep
            share = regathered_params / max(total_params, 1)
            for axis, size, elements, grads, what in (
                    ("dp_shard", n, total_params - expert_params, trained_params - trained_expert_params, ""),
                    (EP_OUTER_AXIS, m, expert_params / ep, trained_expert_params / ep, "expert ")):
                if size == 1 or not elements:
                    continue
                moved = micro_batches * elements * (size - 1) / size
                calls = micro_batches if axis == "dp_shard" else 0
                out.append(Collective("all_gather", axis, size, moved * self.compute_bytes, f"{what}weights, forward",
                                      calls * gathers))
                if regathered_params:
                    out.append(Collective("all_gather", axis, size, moved * self.compute_bytes * share,
                                          f"{what or 'block '}weights again, backward (re-shard after forward)",
                                          calls * regathers))
                if grads:
                    out.append(Collective("reduce_scatter", axis, size,
                                          micro_batches * grads * (size - 1) / size * self.reduce_bytes,
                                          f"{what}gradients, backward", calls * gathers))
        if r > 1:
            shard = trained_params / n
            out.append(Collective("all_reduce", "dp_replicate", r, 2 * (r - 1) / r * shard * self.reduce_bytes,
                                  "gradients over replicas, once per step", gathers))
        if ep > 1 and moe_layers:
            # Each pass (forward, backward, the forward again of recomputed blocks) moves the
            # tokens there and the outputs back (ep_dispatch_bytes); the backward sends no routing
            # choices, counted anyway (a small overcount: 8 bytes x top_k per row).
            passes = 2 + (1 if recompute_blocks else 0)
            # The MoE layer routes a rank's own tokens: its cp chunks, its tp sequence shard.
            both = {kind: ep_dispatch_bytes(kind, tokens=tokens_per_micro_batch // (self.cp * self.tp), dim=dim,
                                            top_k=top_k,
                                            num_experts=num_experts, ep=ep, compute_bytes=self.compute_bytes,
                                            padded=self.ep_padded) for kind in EP_DISPATCH_CALLS}
            other = "all_to_all" if self.ep_dispatch == "all_gather" else "all_gather"
            scale = micro_batches * moe_layers * passes
            out.append(Collective(self.ep_dispatch.replace("all_gather", "all_gather+reduce_scatter"), "ep", ep,
                                  scale * both[self.ep_dispatch],
                                  f"MoE token dispatch ({other} would send {scale * both[other] / 1e9:.3g} GB)",
                                  scale * EP_DISPATCH_CALLS[self.ep_dispatch]))
        if self.cp > 1:
            c = self.cp
            out.append(Collective("all_reduce", "cp", c, micro_batches * 2 * (c - 1) / c * trained_params / n
                                  * self.reduce_bytes, "gradients over cp, backward", micro_batches * gathers))
        if self.tp > 1:
            out += self.tp_collectives(micro_batches=micro_batches, n_layers=n_layers,
                                       tokens_per_micro_batch=tokens_per_micro_batch, dim=dim,
                                       recompute_blocks=recompute_blocks, moe_layers=moe_layers)
            if trained_expert_params:  # experts are whole on tp: each tp rank's gradient covers its tokens
                t = self.tp
                out.append(Collective("all_reduce", "tp", t, micro_batches * 2 * (t - 1) / t * trained_expert_params
                                      / n * self.reduce_bytes, "expert gradients over tp, backward",
                                      micro_batches * gathers))
        return out

    def tp_collectives(self, *, micro_batches: int, n_layers: int, tokens_per_micro_batch: int, dim: int,
                       recompute_blocks: bool, moe_layers: int = 0) -> list[Collective]:
        """Tensor parallelism's activation collectives (module docstring), bytes each rank sends
        and calls; on a cp rank's share of the tokens (cp x tp). An MoE block gathers the sequence
        for its attention only (its experts run on the rank's sequence shard)."""
        tp, t = self.tp, tokens_per_micro_batch / self.cp
        one = (tp - 1) / tp * t * dim * self.compute_bytes  # one all-gather or reduce-scatter of [T, D]
        per_block = 4 * n_layers - 2 * moe_layers
        per_pass = per_block + 2
        passes = 2 * per_pass + (per_block if recompute_blocks else 0)
        loss = 3 * 2 * (tp - 1) / tp * t * 4
        return [Collective("all_gather+reduce_scatter", "tp", tp, micro_batches * passes * one,
                           "sequence-parallel activations, forward and backward", micro_batches * passes),
                Collective("all_reduce", "tp", tp, micro_batches * loss, "vocabulary-parallel loss",
                           micro_batches * 3)]


def cp_collectives(*, cp: int, micro_batches: int, n_layers: int, kv_elements: int, compute_bytes: int,
                   documents_tokens: int, recompute_blocks: bool, v_elements: int | None = None) -> list[Collective]:
    """Context parallelism's per-block collectives (module docstring), bytes each rank sends and
    calls. kv_elements: keys (and values, unless v_elements gives theirs: multi-head latent
    attention's are narrower) of one micro-batch's whole sequences, [B, S, kv dim] (a tp rank's kv
    heads under cp x tp: kv dim / tp);
    documents_tokens: B x S with document masks (their ids are gathered too), else 0."""
    share = (cp - 1) / cp
    forwards = 2 if recompute_blocks else 1
    v_elements = kv_elements if v_elements is None else v_elements
    kv = share * (kv_elements + v_elements) * compute_bytes  # keys and values, one direction
    out = [Collective("all_gather+reduce_scatter", "cp", cp, micro_batches * n_layers * (forwards + 1) * kv,
                      "keys and values gathered, their gradients reduce-scattered", micro_batches * n_layers
                      * 2 * (forwards + 1))]
    if documents_tokens:
        out.append(Collective("all_gather", "cp", cp, micro_batches * n_layers * forwards * share * documents_tokens
                              * 4, "document ids", micro_batches * n_layers * forwards))
    return out


def collective_calls(*, tensors_per_layer: list[int], bytes_per_layer: list[float], outside_tensors: int,
                     bucket_bytes: float, scanned_whole: bool, regather: bool) -> tuple[int, int]:
    """(calls per forward, calls again in the backward) of SimpleFSDP's gathers (each has its
    gradient reduction) on a sharded mesh (parallel/buckets.py, simple_fsdp.py). Per parameter
    (bucket_bytes 0): one per parameter tensor. Bucketed: one per piece outside the blocks
    (embedding, final norm, output) and, per block, its tensors cut into runs of at most
    bucket_bytes (taken as ceil(block bytes / bucket_bytes), at most one per tensor); a scanned
    stack gathered whole (scanned_whole: not re-sharded) is one piece of stacked tensors.
    regather: block buckets gathered again in the backward (re-sharding after the forward), all
    but the last block's, which stays gathered from its forward into its backward."""
    if bucket_bytes <= 0:
        return sum(tensors_per_layer) + outside_tensors, 0

    def runs(tensors: int, nbytes: float) -> int:
        return min(tensors, max(1, -(-int(nbytes) // int(bucket_bytes))))

    if scanned_whole:
        return runs(max(tensors_per_layer), sum(bytes_per_layer)) + outside_tensors, 0
    per_block = [runs(t, b) for t, b in zip(tensors_per_layer, bytes_per_layer)]
    return sum(per_block) + outside_tensors, sum(per_block[:-1]) if regather else 0
