"""Scan-over-layers: L identical blocks stored as one stacked set of weights and run by a loop op.

A model that repeats one block L times normally shows the compiler L copies of the block, so
compile time grows with depth (XLA on TPU especially). `StackedBlocks` stores each block
parameter once, with a leading layer axis ([L, ...]), and runs the blocks with torch's scan
higher-order op: the body (one block) is traced and compiled once, and the backends lower the op
to a loop (Inductor on CPU/CUDA; TorchTPU to an XLA while loop).

Layout: the stacked module mirrors the block's module tree, so its parameters are named like the
block's (``layers.attention.wq.weight``, shape [L, out, in]). Saving and loading keep the
per-layer layout of the unrolled model (``layers.{i}.attention.wq.weight``): `state_dict()`
returns per-layer *views* into the stacked tensors (so loading into them in place, as DCP does,
fills the stack) and `load_state_dict()` stacks per-layer entries. Checkpoints and Hugging Face
exports are therefore the same for scanned and unrolled runs. `to_per_layer` / `from_per_layer`
do the same renaming for other per-parameter dicts (the optimizer's moments).

The body calls the block as a function of one layer's slice of the weights (a meta-device
template run by `torch.func.functional_call`, see functional_block.py). It uses the
real-arithmetic RoPE: scan functionalises its body, and complex views have no autograd formula
there. Data parallelism shards the stacked weights on their per-layer dim 0 (dim 1 of the stack,
see parallel/simple_fsdp.py), so a stacked weight's shard on a rank is exactly the stack of the
per-layer shards an unrolled run holds. With re-sharding after the forward (the default) the
wrapper sets `PER_LAYER_GATHER` on this module: the loop then runs over the local shards and each
iteration gathers its own layer (parallel/reshard.py); otherwise the forward all-gathers the
stack once before the loop.

When the op is used: only while tracing (the graph trainer's capture). Eagerly, the same block
function runs over the same stacked weights in a Python loop, because torch's scan op retraces
its body on every eager call (about a second per step here). Activation checkpointing inside the
scan: ``full`` runs `_ScanRecomputingLayers` (the forward scan keeps only each layer's input; the
backward is a reverse scan that recomputes each layer and takes its vector-Jacobian product);
``none`` and ``selective`` use scan's own autograd, whose partitioner decides what the body
saves; selective's tags do not reach it (see docs/decisions.md), so inside a scanned body in
graph mode selective currently saves what none saves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._higher_order_ops.scan import scan_op
from torch.overrides import TorchFunctionMode

from titan_tpu.model_contract import PER_LAYER_GATHER, STACKED_MARKER, STAGE_ROWS, stored_weights
from titan_tpu.models.common.activation_checkpoint import checkpointed
from titan_tpu.models.common.functional_block import FunctionalBlock, read_weights
from titan_tpu.tracing import is_tracing

__all__ = ["StackedBlocks", "StackedRuns", "ScanAutogradMemory", "padding_params", "scan_autograd_memory"]


class StackedBlocks(nn.Module):
    """`n_layers` copies of the block made by `make_block()`, as stacked weights run by scan.

    make_block: builds one block (called twice: under the current default device for the
    parameters' structure, and on meta for the template). init_layer(block, layer_id): initialises
    one full-size block in place, as the unrolled model does for layer `layer_id`.
    ac_mode: activation checkpointing inside the body ("none" | "full" | "selective").
    first_layer: the model's layer id of the stack's layer 0 (a run of `StackedRuns`): per-layer
    names and `init_layer` count from it.
    """

    def __init__(self, make_block: Callable[[], nn.Module], n_layers: int, *,
                 init_layer: Callable[[nn.Module, int], None], ac_mode: str = "none", first_layer: int = 0):
        super().__init__()
        self.n_layers = n_layers
        self.first_layer = first_layer
        # The model's layer of each row of the stack: in order, unless pipeline stages laid the
        # rows out stage by stage (a circular schedule's chunks; parallel/pipeline.py).
        self.row_layers: list[int] = list(range(first_layer, first_layer + n_layers))
        self._init_layer = init_layer
        block = make_block()
        for name, child in block.named_children():
            self.add_module(name, child)
        if block._parameters:
            raise ValueError("StackedBlocks: the block must keep its parameters in submodules")
        for module in self.modules():
            setattr(module, STACKED_MARKER, True)
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    stacked = torch.empty((n_layers, *p.shape), dtype=p.dtype, device=p.device)
                    module._parameters[pname] = nn.Parameter(stacked, requires_grad=p.requires_grad)
            for bname, b in list(module._buffers.items()):  # persistent per-layer state (MoE expert_bias)
                if b is not None and bname not in module._non_persistent_buffers_set:
                    module._buffers[bname] = torch.empty((n_layers, *b.shape), dtype=b.dtype, device=b.device)
        block_fn = FunctionalBlock(make_block)
        assert block_fn.param_names == self.state_names
        object.__setattr__(self, "_make_block", make_block)  # a plain attribute, not a submodule
        self._block_fn = block_fn
        self.ac_mode = ac_mode
        self._body = checkpointed(block_fn, ac_mode)
        self._register_state_dict_hook(_split_layers_hook)
        self._register_load_state_dict_pre_hook(_stack_layers_hook, with_module=True)

    @property
    def param_names(self) -> list[str]:
        """The stacked parameters' names, read each time: parameters added to the stack and its
        template after construction (LoRA adapters, models/lora.py) count."""
        return [n for n, _ in self.named_parameters()]

    @property
    def state_names(self) -> list[str]:
        """What the body reads per layer: the parameters, then the persistent buffers."""
        return self.param_names + [n for n, _ in _persistent_buffers(self)]

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(self, h: Tensor, rope: Tensor, document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """h [B, S, D] through every layer -> (h, the blocks' statistics stacked [L, ...]); rope:
        the batch's RoPE rows; document_ids: None or one id per token."""
        gather = getattr(self, PER_LAYER_GATHER, None)
        if gather is None:
            # Under data parallelism (without re-sharding): one all-gather per stacked weight (or
            # per bucket), before the loop.
            stacked, block_fn, body = read_weights(self, self.state_names), self._block_fn, self._body
        else:
            # Re-sharding (parallel/reshard.py): the loop runs over the local shards and each
            # iteration gathers its own layer (and reduce-scatters its gradient in the backward).
            stacked = gather.local(stored_weights(self, self.state_names))
            block_fn = functools.partial(_gather_then_run, self._block_fn, gather)
            body = checkpointed(block_fn, self.ac_mode)
        if not is_tracing():
            # Eager: the same block function over the same stacked weights, in a Python loop.
            # torch's scan op would retrace its body (make_fx and a partitioner) on every eager
            # call, about a second per step even for a tiny model; the op pays off once traced.
            # The stack is unbound once, not indexed per layer: each `w[i]` would have its own
            # backward building a zero-filled [L, ...] gradient for its one layer (L full-size
            # tensors summed per weight and step); unbind's one backward stacks the L layer
            # gradients.
            per_layer = zip(*(w.unbind(0) for w in stacked))
            stats = []
            for layer_weights in per_layer:
                h, layer_stats = body(h, rope, document_ids, *layer_weights)
                stats.append(layer_stats)
            return h, torch.stack(stats)
        if self.ac_mode == "full":
            return _ScanRecomputingLayers.apply(block_fn, h, rope, document_ids, *stacked)
        final, stats, _ = _scan_layers(body, h, rope, document_ids, stacked)
        return final, stats

    def unbound_layers(self, pick: Callable[[Tensor, Tensor], Tensor] | None = None,
                       buffer_rows: Callable[[Tensor], Tensor] | None = None
                       ) -> tuple[Callable, list[tuple[Tensor, ...]]]:
        """(the block function body(h, rope, document_ids, *weights) -> (h, stats), each row's
        weights as read): the stack run row by row by a caller (pipeline stages, parallel/pipeline.py).
        pick(weight, index) -> weight: the body then takes (h, rope, document_ids, index, *weights)
        and reads each weight through pick inside its checkpointed block, so that the backward's
        recomputation picks again rather than the forward saving each pick's copy.
        buffer_rows(buffer) -> the rows the caller runs of a persistent buffer (a pipeline stage's:
        its parameters are split over the stages, its buffers whole on every one)."""
        stacked = read_weights(self, self.state_names)
        if buffer_rows is not None:
            n_params = len(self.param_names)
            stacked = stacked[:n_params] + [buffer_rows(t) for t in stacked[n_params:]]
        rows = list(zip(*(w.unbind(0) for w in stacked), strict=True))
        if pick is None:
            return self._body, rows
        block_fn = self._block_fn

        def picked(h: Tensor, rope: Tensor, document_ids: Tensor | None, index: Tensor, *weights: Tensor):
            return block_fn(h, rope, document_ids, *(pick(w, index) for w in weights))

        return checkpointed(picked, self.ac_mode), rows

    # ------------------------------------------------------------------------------------------
    # initialisation

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise layer by layer exactly as the unrolled model initialises layers 0..L-1
        (same RNG draws in the same order), through one full-size scratch block. Runs on the
        plain (not yet sharded) stack, as build_model and materialize_and_init call it."""
        some = next(iter(self.parameters()))
        with torch.device("meta"):
            scratch = self._make_block()
        scratch.to_empty(device=some.device)
        scratch.to(dtype=some.dtype)
        scratch_state = {**dict(scratch.named_parameters()), **dict(_persistent_buffers(scratch))}
        own_state = {**dict(self.named_parameters()), **dict(_persistent_buffers(self))}
        # Parameters the block does not make (LoRA adapters) are initialised by their owner.
        own_state = {name: t for name, t in own_state.items() if name in scratch_state}
        for i in sorted(self._layer_rows(), key=lambda row: self.row_layers[row]):  # the RNG's draws in layer order
            self._init_layer(scratch, self.row_layers[i])
            for name, t in own_state.items():
                t[i].copy_(scratch_state[name])
        for i in self._padding_rows():  # no RNG draws: the model's layers are those of a run without padding
            for t in own_state.values():
                t[i].zero_()

    def pad_rows(self, rows: int) -> None:
        """Grow the stack, on the meta device before it is materialised, to `rows` rows: the rows past
        the model's layers are padding rows (pipeline stages whose chunks the layers do not fill,
        parallel/pipeline.py), zero weights (`init_weights`) that no state dict shows. Their row ids in
        `row_layers` run on from the last layer's."""
        if rows == self.n_layers:
            return
        assert rows > self.n_layers, (rows, self.n_layers)
        for module in self.modules():
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    assert p.is_meta, "pad_rows runs before the stack is materialised"
                    grown = torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
                    module._parameters[pname] = nn.Parameter(grown, requires_grad=p.requires_grad)
            for bname, b in list(module._buffers.items()):
                if b is not None and bname not in module._non_persistent_buffers_set:
                    module._buffers[bname] = torch.empty((rows, *b.shape[1:]), dtype=b.dtype, device=b.device)
        self.row_layers = list(range(self.first_layer, self.first_layer + rows))

    @property
    def padding_rows(self) -> int:
        """The stack's padding rows (`pad_rows`), 0 without."""
        return len(self.row_layers) - self.n_layers

    def _is_padding(self, row: int) -> bool:
        return self.row_layers[row] >= self.first_layer + self.n_layers

    def _layer_rows(self) -> list[int]:
        """The rows that hold one of the model's layers (all but the padding rows)."""
        return [i for i in range(len(self.row_layers)) if not self._is_padding(i)]

    def _padding_rows(self) -> list[int]:
        return [i for i in range(len(self.row_layers)) if self._is_padding(i)]

    # ------------------------------------------------------------------------------------------
    # per-layer <-> stacked names

    @property
    def layer_ids(self) -> range:
        """The model's layer ids this stack holds."""
        return range(self.first_layer, self.first_layer + self.n_layers)

    def to_per_layer(self, named: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """{prefix + stacked name: [L, ...]} -> {prefix + "i." + name: view of layer i} (i counted
        from `first_layer`), layer by layer as the unrolled model orders them, where the first
        stacked entry was; other entries pass through in order."""
        stacked = {k[len(prefix):]: v for k, v in named.items()
                   if k.startswith(prefix) and k[len(prefix):] in self.state_names}
        out = {}
        for key, value in named.items():
            if key[len(prefix):] not in stacked or not key.startswith(prefix):
                out[key] = value
            elif key[len(prefix):] == next(iter(stacked)):  # at the first stacked entry: all of them
                rows = {name: self._rows(t) for name, t in stacked.items()}
                held = [i for i in next(iter(rows.values())) if not self._is_padding(i)]  # padding rows: unsaved
                for i in sorted(held, key=lambda row: self.row_layers[row]):
                    out.update((f"{prefix}{self.row_layers[i]}.{name}", held[i]) for name, held in rows.items())
        return out

    def _rows(self, t: Tensor) -> dict[int, Tensor]:
        """The rows of stacked `t` this rank holds, each a view: all of them, or a pipeline stage's."""
        stage_rows = getattr(self, STAGE_ROWS, None)
        return dict(stage_rows(t)) if stage_rows is not None else {i: t[i] for i in range(t.shape[0])}

    def from_per_layer(self, named: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """The inverse of `to_per_layer` (stacks copies); per-layer groups that are incomplete
        are left as they are, so a strict load reports what is missing."""
        out = dict(named)
        for name in self.state_names:
            keys = [f"{prefix}{self.row_layers[i]}.{name}" for i in self._layer_rows()]
            if all(k in out for k in keys):
                rows = [out.pop(k) for k in keys]
                if self.padding_rows:  # zeros in the padding rows (`pad_rows`), which no state dict holds
                    per_row, zero = dict(zip(self._layer_rows(), rows)), torch.zeros_like(rows[0])
                    rows = [per_row.get(i, zero) for i in range(len(self.row_layers))]
                out[prefix + name] = torch.stack(rows)
        return out


def padding_params(model: nn.Module) -> int:
    """The elements of the padding rows (`StackedBlocks.pad_rows`) in `model`'s stacks: 0 without."""
    return sum(p.numel() // p.shape[0] * stack.padding_rows for stack in model.modules()
               if isinstance(stack, StackedBlocks) and stack.padding_rows for p in stack.parameters())


class StackedRuns(nn.Module):
    """Layers that are not all one block, scanned as runs: each run of consecutive identical blocks
    is its own `StackedBlocks` (DeepSeek-V3: its dense first layers, then its MoE layers), run
    one after the other. A compiler sees one body per run, whatever the depth.

    runs: (make_block, number of layers) per run, in layer order. The runs are the children
    ``run0``, ``run1``, ... (parameters ``run1.attention.wkv_a.weight``, [layers of run 1, ...]);
    state dicts show the unrolled model's per-layer names (``{i}.attention.wkv_a.weight``, i the
    model's layer id), so checkpoints stay interchangeable with unrolled and single-stack runs.
    """

    def __init__(self, runs: Sequence[tuple[Callable[[], nn.Module], int]], *,
                 init_layer: Callable[[nn.Module, int], None], ac_mode: str = "none"):
        super().__init__()
        first = 0
        for j, (make_block, n_layers) in enumerate(runs):
            self.add_module(f"run{j}", StackedBlocks(make_block, n_layers, init_layer=init_layer, ac_mode=ac_mode,
                                                     first_layer=first))
            first += n_layers
        self.n_layers = first
        self._register_state_dict_hook(_runs_split_hook)
        self._register_load_state_dict_pre_hook(_runs_stack_hook, with_module=True)

    def stacks(self, prefix: str = "") -> list[tuple[str, StackedBlocks]]:
        """(name, run) of every run, in layer order."""
        return [(prefix + name, run) for name, run in self.named_children()]

    @property
    def param_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    def forward(self, h: Tensor, rope: Tensor, document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """h through every run -> (h, the statistics of the runs whose blocks return any,
        concatenated in layer order [L_stats, ...]; the last run's empty ones if none does)."""
        kept = []
        for _, run in self.stacks():
            h, stats = run(h, rope, document_ids)
            if stats.shape[1:].numel() > 0:  # a dense block's statistics are an empty tensor
                kept.append(stats)
        return h, (torch.cat(kept) if kept else stats)

    @torch.no_grad()
    def init_weights(self) -> None:
        for _, run in self.stacks():
            run.init_weights()

    def to_per_layer(self, named: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """Stacked entries of every run -> per-layer views named by the model's layer ids
        (`StackedBlocks.to_per_layer`, the run's name dropped)."""
        for name, run in self.stacks(prefix):
            named = {_drop_run(key, name, run): value for key, value in run.to_per_layer(named, name + ".").items()}
        return named

    def from_per_layer(self, named: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """The inverse of `to_per_layer` (stacks copies)."""
        for name, run in self.stacks(prefix):
            own = tuple(f"{prefix}{i}." for i in run.layer_ids)
            named = {(name + "." + key[len(prefix):] if key.startswith(own) else key): value
                     for key, value in named.items()}
            named = run.from_per_layer(named, name + ".")
        return named


def _drop_run(key: str, run_name: str, run: StackedBlocks) -> str:
    """``layers.run1.5.x`` -> ``layers.5.x`` for the per-layer keys of `run`; other keys as they are."""
    head, _, rest = run_name.rpartition(".")
    if key.startswith(run_name + ".") and key[len(run_name) + 1:].split(".", 1)[0] in map(str, run.layer_ids):
        return (head + "." if head else "") + key[len(run_name) + 1:]
    return key


def _runs_split_hook(module: StackedRuns, state_dict: dict, prefix: str, local_metadata) -> None:
    # After each run's own hook (per-layer views under the run's name): drop the run's name, in place.
    items = list(state_dict.items())
    state_dict.clear()
    for name, run in module.stacks(prefix):
        items = [(_drop_run(key, name, run), value) for key, value in items]
    state_dict.update(items)


def _runs_stack_hook(module: StackedRuns, state_dict: dict, prefix: str, *args) -> None:
    # Before the runs' own hooks (which stack their per-layer entries): put each layer under its run.
    for name, run in module.stacks(prefix):
        own = tuple(f"{prefix}{i}." for i in run.layer_ids)
        for key in [k for k in state_dict if k.startswith(own)]:
            state_dict[name + "." + key[len(prefix):]] = state_dict.pop(key)


def _gather_then_run(block_fn: Callable, gather, h: Tensor, rope: Tensor, document_ids: Tensor | None,
                     *layer_tensors: Tensor):
    """One layer from its local shard slices: gather them (PER_LAYER_GATHER), run the block."""
    return block_fn(h, rope, document_ids, *gather.gather(list(layer_tensors)))


def _persistent_buffers(module: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, buffer) of `module`'s persistent buffers, recursively (what its state_dict saves)."""
    out = []
    for mod_name, mod in module.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{bname}" if mod_name else bname, b))
    return out


def _shared_inputs(rope: Tensor, document_ids: Tensor | None) -> tuple[Tensor, ...]:
    """What every layer reads besides its weights, as scan's "additional inputs" (passed whole to
    each iteration: the body may not close over tensors)."""
    return (rope,) if document_ids is None else (rope, document_ids)


def _split_shared(shared: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
    return shared[0], (shared[1] if len(shared) > 1 else None)


def _scan_layers(block_fn: Callable, h: Tensor, rope: Tensor, document_ids: Tensor | None, stacked: list[Tensor], *,
                 keep_inputs: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """h -> block_fn(h, rope, document_ids, *layer i's weights) for i = 0..L-1 with torch's scan op.

    Returns the final h, the blocks' statistics stacked ([L, ...]) and, with keep_inputs, every
    layer's input stacked ([L, *h.shape]).
    scan_op, not the public torch scan(): that one routes eager calls through Dynamo, which
    cannot run inside our make_fx capture. The body's arguments are flat tensors: the carry, one
    layer's slice of each stacked weight, then the shared inputs (RoPE rows, document ids).
    """
    shared = _shared_inputs(rope, document_ids)
    n_weights = len(stacked)

    def body(carry: Tensor, *layer_weights_and_shared: Tensor) -> list[Tensor]:
        layer_weights = layer_weights_and_shared[:n_weights]
        rope_rows, document_ids = _split_shared(layer_weights_and_shared[n_weights:])
        with _LinearsSaveTheirWeight():
            out, stats = block_fn(carry, rope_rows, document_ids, *layer_weights)
        # The body may not return an alias of its input, hence the clone of the layer input. No
        # placeholder output when the inputs are not kept: TorchTPU's lowering of a scan body
        # merges its outputs that share storage, and every empty tensor has none (a dense
        # block's empty `stats` and an empty placeholder made one output where scan expects two).
        return [out, stats, carry.clone()] if keep_inputs else [out, stats]

    final, stats, *per_layer = scan_op(body, [h], stacked, additional_inputs=shared)
    return final, stats, per_layer[0] if keep_inputs else None


class _LinearSavingItsWeight(torch.autograd.Function):
    """y = x W^T (no bias) whose backward reads W itself, not its transpose.

    Scan's autograd functionalises the body (views become copies: `t` becomes `t_copy`) before its
    min-cut partitioner chooses what the forward saves. With `F.linear` the backward's
    grad_x = grad_y W reads `t_copy(W)`, a copy the partitioner saves as a per-layer output of the
    forward scan: every step wrote a transposed copy of all the stacked matmul weights, and the
    backward flipped that stack (a second copy). Here the backward reads W, the body's input
    slice of the stack, which the partitioner saves by reference (scan's REMOVE_XS: no per-layer
    output). Same matmuls as F.linear's backward (grad_x = grad_y W, grad_W = grad_y^T x)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x.matmul(w.t())

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, Tensor | None]:
        x, w = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[1]:  # not for a frozen weight (LoRA's base)
            grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_y.matmul(w), grad_w


class _LinearsSaveTheirWeight(TorchFunctionMode):
    """Inside the scanned body: bias-free `F.linear` calls (every block matmul but the MoE experts'
    grouped ones) run as `_LinearSavingItsWeight`; everything else as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[2:3] in ((), (None,)) and kwargs.get("bias") is None:
            return _LinearSavingItsWeight.apply(*args[:2])
        return func(*args, **kwargs)


class _ScanRecomputingLayers(torch.autograd.Function):
    """Scanned layers with full activation checkpointing.

    Left to itself, scan's autograd partitions the body into a forward that saves what the
    backward needs (every layer's intermediates, stacked) and a backward. Here the forward scan
    keeps only each layer's input, and the backward is a reverse scan whose body recomputes the
    layer and takes its vector-Jacobian product (torch.func.vjp): (grad of the layer output,
    layer input, weights) -> (grad of the layer input, grads of the weights). Both scans are
    traced into the captured graph like any other op.
    """

    @staticmethod
    def forward(ctx, block_fn, h, rope, document_ids, *stacked):
        final, stats, inputs = _scan_layers(block_fn, h, rope, document_ids, list(stacked), keep_inputs=True)
        ctx.block_fn = block_fn
        ctx.n_shared = len(_shared_inputs(rope, document_ids))
        ctx.save_for_backward(inputs, *_shared_inputs(rope, document_ids), *stacked)
        return final, stats

    @staticmethod
    def backward(ctx, grad_out, grad_stats):
        inputs, *rest = ctx.saved_tensors
        shared, stacked = tuple(rest[:ctx.n_shared]), rest[ctx.n_shared:]
        block_fn, n_weights = ctx.block_fn, len(stacked)

        def body(grad_carry: Tensor, layer_input: Tensor, grad_layer_stats: Tensor,
                 *weights_and_shared: Tensor) -> list[Tensor]:
            weights = weights_and_shared[:n_weights]
            rope_rows, document_ids = _split_shared(weights_and_shared[n_weights:])
            _, vjp = torch.func.vjp(lambda x, *w: block_fn(x, rope_rows, document_ids, *w), layer_input, *weights)
            # [grad of the layer input, grads of its weights (zeros for buffers)]
            return list(vjp((grad_carry, grad_layer_stats)))

        # Last layer first: flip the layer axis in, and the weight gradients back.
        flipped = [t.flip(0) for t in (inputs, grad_stats, *stacked)]
        grad_h, *grad_weights = scan_op(body, [grad_out], flipped, additional_inputs=shared)
        return (None, grad_h, None, None, *(g.flip(0) for g in grad_weights))


def _split_layers_hook(module: StackedBlocks, state_dict: dict, prefix: str, local_metadata) -> None:
    # Rebuild in place (the parent ignores a returned dict): stacked entries become per-layer
    # views, at the same position in the order.
    items = list(state_dict.items())
    state_dict.clear()
    state_dict.update(module.to_per_layer(dict(items), prefix))


def _stack_layers_hook(module: StackedBlocks, state_dict: dict, prefix: str, *args) -> None:
    stacked = module.from_per_layer({k: v for k, v in state_dict.items() if k.startswith(prefix)}, prefix)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    state_dict.update(stacked)


# ----------------------------------------------------------------------------------------------
# Memory of scan's own autograd, for the planner (titan_tpu/plan). Graph mode, scanned layers,
# activation checkpointing none or selective: the traced step differentiates scan_op with torch's
# scan autograd, whose min-cut partitioner splits the body into a forward that also returns every
# value its backward needs and a backward body. Read from the captured graph (tests/test_planner.py
# counts the forward scan's extra outputs and the backward scan's flipped inputs against this).


@dataclass(frozen=True)
class ScanAutogradMemory:
    """Bytes scan's own autograd holds for the backward of L scanned layers."""

    activations: int  # each layer's saved activations, stacked [L, ...] by the forward scan
    weight_copies: float  # weights each layer computes in its body (gathered per layer; MoE experts'
    # transposed views), saved stacked: a copy
    shared: int  # per-layer copies of values every layer reads (the RoPE rows and what RoPE derives)
    flipped: float  # the backward scan's inputs: flipped copies of the saved stacks and of the weights it reads
    gradients: float  # the backward scan's output stack of every layer's weight gradients

    @property
    def saved(self) -> float:
        """Kept from the forward scan to the backward scan."""
        return self.activations + self.weight_copies + self.shared

    @property
    def at_backward_start(self) -> float:
        """Held when the backward loop starts, beyond the model's parameters and optimizer state:
        the saved stacks, their flipped copies (see `scan_autograd_memory`) and the gradient stack."""
        return self.saved + self.flipped + self.gradients


def scan_autograd_memory(*, activations_per_layer: Sequence[int], layer_weight_bytes: float,
                         shared_per_layer: int, read_weight_bytes: float,
                         gradient_bytes: float, flipped: bool = True) -> ScanAutogradMemory:
    """What `StackedBlocks` in graph mode without full checkpointing keeps through scan's autograd.

    activations_per_layer: the bytes each layer's saved activations take (the block's own count
    with partitioned=True, activation_memory.py `block_saved_per_token`). layer_weight_bytes: one layer's
    weights that the body computes before multiplying by them and the backward reads again: the
    partitioner saves those as outputs of the body (copies, not views) and never recomputes the
    all-gather that produced them (gathered per layer when sharded: all matmul weights, in the
    compute dtype; the MoE experts' transposed views where the grouped_mm kernel reads a view, every
    kernel but "torch", see kernels/grouped_mm.py `with_linear_layout`; the dense linears' weights
    otherwise not, see `_LinearSavingItsWeight`). shared_per_layer: bytes per layer of the saved copies of
    values every layer reads (RoPE, rope.py `rope_real_saved_per_position`). read_weight_bytes:
    the stacked weights the backward body reads as they are (the norm scales; the dense matmul
    weights unless gathered per layer). gradient_bytes: the stacked weight gradients the backward
    loop writes (local shards when each layer reduce-scatters its own).

    The backward scan runs the layers in reverse over flipped (copied) stacks of everything saved
    and of the weights it reads (torch's scan autograd: `torch.flip` of each). Inductor writes the
    flips in a few fused kernels and frees each original after its kernel (qwen3 debug: 70% of the
    activation stacks were copied while their originals were alive), and allocates the gradient
    stack before the forward loop; `at_backward_start` counts every original beside its copy, an
    upper bound (a memory-aware scheduler holds one stack twice at a time). flipped False: under
    Inductor, graph/reverse_scan.py runs that loop with a reversed index over the stacks as they
    are, and the flipped copies do not exist."""
    activations = sum(activations_per_layer)
    n_layers = len(activations_per_layer)
    weights = layer_weight_bytes * n_layers
    shared = shared_per_layer * n_layers
    return ScanAutogradMemory(activations=activations, weight_copies=weights, shared=shared,
                              flipped=(activations + weights + shared + read_weight_bytes) if flipped else 0.0,
                              gradients=gradient_bytes)
