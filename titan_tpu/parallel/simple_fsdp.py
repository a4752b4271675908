"""SimpleFSDP: data parallelism as DTensor parameters plus one parametrization.

Every parameter is stored as a DTensor on the data-parallel mesh: sharded on dim 0 across
`dp_shard` (fully_shard), whole on every rank (replicate), or both (hybrid_shard); in equal
blocks on every rank (a dim 0 that `dp_shard` does not divide: `_even_blocks`). Reading
`module.weight` returns the parameter redistributed to a full, replicated plain tensor in the
compute dtype. So the forward holds an all-gather per parameter and, through DTensor's autograd,
the backward a reduce-scatter (shard axis) and/or an all-reduce (replicate axis) of the gradient.
The model code does not change, and because the collectives are ordinary ops they appear as
graph nodes when the step is traced, where a compiler can bucket, overlap or reorder them.

Gradients land on the stored parameters as DTensors with the parameters' placements, so
clipping and the optimizer run on local shards (optimizer state is sharded like its parameter).

With expert parallelism (an `expert_mesh`, parallel/expert_parallel.py) the MoE expert weights
live on that mesh instead, sharded over `ep` by expert, and reading one gathers only the other
axis: a rank computes with its own experts, whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from titan_tpu.model_contract import (
    EXPERT_MARKER,  # set on modules holding MoE expert weights
    PER_LAYER_GATHER,
    STACKED_MARKER,  # set on modules holding stacked layers
    WHOLE_ON_STAGES,  # set on modules of a stack every pipeline stage holds whole
    TrainableModel,
    stored_weights,
)
from titan_tpu.parallel.axes import AXES, CP_AXIS, PP_AXIS, TP_AXIS, gathered_for_compute
from titan_tpu.parallel.buckets import (
    DEFAULT_BUCKET_MB,
    Bucket,
    bucketable,
    build_buckets,
    gather_flat,
    group_into_buckets,
)
from titan_tpu.parallel.expert_parallel import ExpertParallelDispatch, expert_placements
from titan_tpu.parallel.reshard import LayerGather, ReshardHooks
from titan_tpu.parallel.tensor_parallel import tp_placement

__all__ = ["MixedPrecision", "SimpleFSDPState", "cast_for_compute", "data_parallel", "default_mixed_precision",
           "fsdp_state", "local_bytes", "materialize_and_init", "MODES"]

MODES = ("replicate", "fully_shard", "hybrid_shard")


@dataclass
class MixedPrecision:
    """Compute and gradient-reduction dtypes. Stored (master) parameters and the optimizer state
    keep the dtype the model was built in (fp32), on one device (`cast_for_compute`) as on many
    (`data_parallel`): docs/mixed_precision.md."""

    param_dtype: torch.dtype = torch.float32  # dtype parameters are all-gathered to and computed in
    reduce_dtype: torch.dtype = torch.float32  # dtype gradients are reduced in
    # A bucket's parameters gathered (and their gradients reduce-scattered) one collective each in
    # their own shapes, not through one flat buffer: on a TPU, where XLA combines collectives itself
    # and the flat buffer's reshapes to and from the parameters' tiled layouts are copies its TPU
    # backend compiles slowly (DeepSeek-V3 16B: minutes and gigabytes of host memory per expert
    # stack). parallel/buckets.py gather_per_tensor; buckets of tensors sharded on another dimension
    # than their first keep the flat buffer.
    per_tensor: bool = False


def default_mixed_precision(device_type: str) -> MixedPrecision:
    """model.dtype auto: fp32 throughout on CPU (bf16 there is opt-in, for CPUs with bf16
    instructions); bf16 compute with fp32 gradient reduction on accelerators."""
    if device_type == "cpu":
        return MixedPrecision()
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass
class SimpleFSDPState:
    """What SimpleFSDP keeps on a module it wraps, as one object under the one attribute
    `_simple_fsdp` (`fsdp_state`). A module whose parameters it parametrizes uses `mp` and
    `buckets`; the root module (the one `data_parallel` was given) uses `all_buckets` and
    `hook_handles`. Kept in the module's __dict__, read without nn.Module.__getattr__ (every
    parameter read goes through `_compute_tensor`)."""

    mp: MixedPrecision | None = None  # the dtypes this module's parameters are read (gathered, cast) in
    buckets: dict[str, Bucket] = field(default_factory=dict)  # parameter name -> the bucket gathering it
    all_buckets: list[Bucket] = field(default_factory=list)  # root: every bucket of the model, in order
    hook_handles: tuple = ()  # root: the hooks `_install_buckets` registered (removed when it runs again)


_STATE = "_simple_fsdp"


def fsdp_state(module: nn.Module) -> SimpleFSDPState:
    """`module`'s SimpleFSDPState, created empty on first use."""
    state = module.__dict__.get(_STATE)
    if state is None:
        state = module.__dict__[_STATE] = SimpleFSDPState()
    return state


def _placements(mode: str, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """The placements on the data-parallel axes of `mesh` and on its cp axis (all but tp, which
    the tensor-parallel plan places per module: `_module_placements`). Parameters are replicated
    over cp: each cp rank's gradient covers its own tokens, a partial sum all-reduced over cp."""
    if mode not in MODES and not (mode == "none" and (_has_tp(mesh) or _has_cp(mesh) or _has_pp(mesh))):
        raise ValueError(f"data parallel mode must be one of {', '.join(MODES)}, got {mode!r}")
    placements = {
        "none": (),
        "replicate": (Replicate(),),
        "fully_shard": (Shard(0),),
        "hybrid_shard": (Replicate(), Shard(0)),
    }[mode]
    dp_ndim = mesh.ndim - _has_tp(mesh) - _has_cp(mesh) - _has_pp(mesh)
    if dp_ndim != len(placements):
        raise ValueError(f"data parallel mode {mode!r} needs {len(placements)} data-parallel mesh axes, got "
                         f"{mesh.mesh_dim_names}; build the mesh with ParallelDims")
    # pp: replicated here; a scanned stack is split on its layer dim instead (`_module_placements`).
    return placements + ((Replicate(),) if _has_pp(mesh) else ()) + ((Replicate(),) if _has_cp(mesh) else ())


def _has_tp(mesh: DeviceMesh) -> bool:
    return TP_AXIS in (mesh.mesh_dim_names or ())


def _has_cp(mesh: DeviceMesh) -> bool:
    return CP_AXIS in (mesh.mesh_dim_names or ())


def _has_pp(mesh: DeviceMesh) -> bool:
    return PP_AXIS in (mesh.mesh_dim_names or ())


# ---------------------------------------------------------------------------------------------
# Sharding parameters
# ---------------------------------------------------------------------------------------------


def _module_placements(module: nn.Module, placements: tuple[Placement, ...],
                       mesh: DeviceMesh) -> tuple[Placement, ...]:
    """The placements of `module`'s parameters on every axis of `mesh`.

    With a tp axis (innermost) the module's tensor-parallel placement is appended, and a weight
    the tp plan shards on dim 0 is sharded over dp_shard on dim 1 instead: each axis then splits
    its own dim, so gathering the data-parallel axes leaves exactly the tp shard (no strided
    sharding), and checkpoints hold the same global tensors.
    Stacked-layer weights are sharded on their per-layer dims, i.e. one dim further in the stack:
    a rank's shard is then the stack of the shards it would hold of each layer unrolled, which
    keeps checkpoints interchangeable and never splits the layer axis the scan loops over."""
    if _has_tp(mesh):
        tp = tp_placement(module)
        if isinstance(tp, Shard) and tp.dim == 0:
            placements = tuple(Shard(1) if isinstance(p, Shard) else p for p in placements)
        placements = (*placements, tp)
    if not getattr(module, STACKED_MARKER, False):
        return placements
    stacked = [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in placements]
    if _has_pp(mesh) and not getattr(module, WHOLE_ON_STAGES, False):  # pipeline stages: each its layers
        stacked[mesh.mesh_dim_names.index(PP_AXIS)] = Shard(0)  # (parallel/pipeline.py)
    return tuple(stacked)


def _even_blocks(placements: tuple[Placement, ...], shape: torch.Size, mesh: DeviceMesh, *,
                 stacked: bool) -> tuple[Placement, ...]:
    """`placements` with every sharded data-parallel axis (parallel/axes.py: params "shard") on a
    dim its size divides, so that each rank holds an equal block of the parameter.

    Why: the JAX path runs one program on every device (graph/jax_step.py), fed the devices' blocks
    end to end; an uneven split (torch.chunk's: a [1, 1, D] probe over 2 ranks is [1, 1, D] on one
    and [0, 1, D] on the other) gives the ranks different shapes, so no one program fits them. The
    planned dim is kept where it divides; else the first other dim that divides and no other axis
    splits (the probe: D; a vocabulary of 50257 rows: the model dim; the embedding and output of the
    three largest recipes, whose vocabularies dp_shard does not divide: 128256 or 129280 rows over
    1024 ranks, 151936 over 512), which costs one collective more per such weight (its
    own bucket) and nothing in memory; else the tensor stays whole on that axis (Replicate: its
    bytes and both moments on every rank, its gradient all-reduced instead of reduce-scattered),
    which in practice only tiny tensors meet. A stacked weight's layer dim is never taken (the scan
    loops over it)."""
    names = mesh.mesh_dim_names or ()
    out = list(placements)
    for axis, placement in enumerate(placements):
        if not (isinstance(placement, Shard) and names and AXES[names[axis]].params == "shard"):
            continue
        size = mesh.size(axis)
        taken = {p.dim for i, p in enumerate(out) if isinstance(p, Shard) and i != axis}
        dims = [placement.dim] + [d for d in range(int(stacked), len(shape)) if d != placement.dim]
        fit = next((d for d in dims if d < len(shape) and d not in taken and shape[d] % size == 0), None)
        out[axis] = Replicate() if fit is None else Shard(fit)
    return tuple(out)


def _param_layout(module: nn.Module, shape: torch.Size, mesh: DeviceMesh, placements: tuple[Placement, ...],
                  expert_mesh: DeviceMesh | None) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """Where a parameter of `module` of this shape lives: expert weights on the expert mesh under
    expert parallelism, everything else on the data-parallel mesh; in equal blocks (`_even_blocks`)."""
    stacked = getattr(module, STACKED_MARKER, False)
    if expert_mesh is not None and getattr(module, EXPERT_MARKER, False):
        mesh, placements = expert_mesh, expert_placements(stacked=stacked, axes=tuple(expert_mesh.mesh_dim_names))
    else:
        placements = _module_placements(module, placements, mesh)
    return mesh, _even_blocks(placements, shape, mesh, stacked=stacked)


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements, *, src_data_rank: int | None,
                       expert_mesh: DeviceMesh | None = None) -> None:
    """Replace every plain parameter of `module` (recursively) by an nn.Parameter holding a DTensor.

    src_data_rank=None: every rank already holds the same full values and keeps its own slice
    without communicating; an int: that rank's values are scattered/broadcast to the others.
    """
    module_placements, dp_mesh = placements, mesh
    # A parameter shared by several modules (tied embeddings) becomes one DTensor parameter, so it
    # stays shared: one shard, one gradient summed from both uses, one optimizer entry.
    distributed: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) in distributed:
                sub._parameters[name] = distributed[id(param)]
                continue
            mesh, placements = _param_layout(sub, param.shape, dp_mesh, module_placements, expert_mesh)
            dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank)
            local = dt.to_local()
            if local.untyped_storage().data_ptr() == param.untyped_storage().data_ptr() and any(
                p.is_shard() for p in placements
            ):
                # The shard may be a view into the full tensor, which would keep the full tensor
                # alive; copy it so the full-size storage is freed.
                local = local.clone()
                dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=dt.shape, stride=dt.stride())
            sub._parameters[name] = distributed[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)


# ---------------------------------------------------------------------------------------------
# The parametrization: module.weight -> all-gathered plain tensor
# ---------------------------------------------------------------------------------------------


def _replicate_for_compute(param: DTensor, mp: MixedPrecision) -> torch.Tensor:
    # Expert weights keep their expert-parallel shard (this rank's experts), tensor-parallel
    # weights their tp shard; every other axis is gathered whole.
    keep = [not gathered for gathered in gathered_for_compute(param.device_mesh.mesh_dim_names or ())]
    full = param.redistribute(
        placements=[p if k else Replicate() for p, k in zip(param.placements, keep)],
        forward_dtype=mp.param_dtype, backward_dtype=mp.reduce_dtype,
    )
    # Each rank's gradient w.r.t. the full weight covers only its own micro-batch rows: a partial
    # sum. Declaring it Partial makes the backward reduce it into the parameter's placements
    # (reduce-scatter on a Shard axis, all-reduce on a Replicate axis). On the ep and tp axes a
    # sharded weight's gradient is already this rank's own: it stays sharded; a weight replicated
    # over tp (the norms) saw only this rank's tokens or heads: a partial sum, all-reduced. Over pp
    # a weight outside the stack is used by one stage (the embedding by the first): its gradient is
    # summed over the stages after the backward (train/step.py), not inside it, where the stages
    # meet the permutes in different orders.
    axes = param.device_mesh.mesh_dim_names or ()
    return full.to_local(grad_placements=[p if k and (p.is_shard() or axis == PP_AXIS) else Partial()
                                          for p, k, axis in zip(param.placements, keep, axes)])


def _compute_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """What reading `module.<name>` returns: the gathered tensor, from its bucket while the root
    module's forward runs (buckets.py), else gathered on its own; on one device (a plain stored
    tensor, `cast_for_compute`) the stored tensor cast to the compute dtype, whose backward casts
    the gradient back to the stored dtype."""
    state = module.__dict__[_STATE]
    bucket = state.buckets.get(name)
    if bucket is not None and bucket.open:
        return bucket.get(module, name)
    param = module._parameters[name]
    if not isinstance(param, DTensor):
        return param.to(state.mp.param_dtype)
    return _replicate_for_compute(param, state.mp)


_PARAMETRIZED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _parametrize_module(module: nn.Module, mp: MixedPrecision) -> None:
    """Swap `module`'s class for a subclass whose parameter names are properties returning the
    gathered tensor. The DTensor parameters stay in `module._parameters` under their original
    names, so named_parameters(), state_dict() and load_state_dict() see them unchanged (unlike
    torch.nn.utils.parametrize, which renames them to `parametrizations.<name>.original`)."""
    names = tuple(n for n, p in module._parameters.items() if p is not None)
    if not names:
        return
    fsdp_state(module).mp = mp  # read by the properties; per instance, so classes can be shared
    cls = type(module)
    if _PARAMETRIZED_CLASSES.get((cls.__base__, names)) is cls:
        return  # already parametrized (the class is one of ours, made for these names)
    key = (cls, names)
    if key not in _PARAMETRIZED_CLASSES:
        # A data descriptor on the class wins over nn.Module.__getattr__ (which is only consulted
        # when normal lookup fails). Assigning a Parameter still goes through nn.Module.__setattr__
        # into _parameters, so load_state_dict(assign=True) and to_empty keep working.
        props = {
            n: property(lambda self, n=n: _compute_tensor(self, n))
            for n in names
        }
        _PARAMETRIZED_CLASSES[key] = type(f"SimpleFSDP{cls.__name__}", (cls,), props)
    module.__class__ = _PARAMETRIZED_CLASSES[key]


def data_parallel(model: nn.Module, mesh: DeviceMesh, *, mode: str, mp: MixedPrecision,
                  expert_mesh: DeviceMesh | None = None, bucket_mb: float = DEFAULT_BUCKET_MB,
                  reshard_after_forward: bool = True) -> nn.Module:
    """Make `model` data parallel on `mesh` in place (and return it); with `expert_mesh`, its MoE
    experts expert-parallel on that mesh (parallel/expert_parallel.py).

    bucket_mb > 0: the parameters of each model piece (block) are gathered in buckets of at most
    that many MB, one collective per bucket each way (parallel/buckets.py); 0: one per parameter.
    reshard_after_forward (with bucket_mb > 0): block weights are not kept gathered from the
    forward to the backward but gathered again there (parallel/reshard.py), and a scanned stack
    is gathered one layer at a time inside the loop.

    Parameters that are still plain tensors are distributed from rank 0 (so ranks need not agree
    beforehand); ones that are already DTensors (see `materialize_and_init`) are kept as they are.
    """
    placements = _placements(mode, mesh)
    if expert_mesh is not None and mode != "fully_shard":
        raise ValueError("expert parallelism (--parallelism.ep > 1) needs fully sharded data parallelism: "
                         "set --parallelism.dp_replicate 1")
    _distribute_params(model, mesh, placements, src_data_rank=0, expert_mesh=expert_mesh)
    for sub_name, sub in model.named_modules():
        for pname, param in sub.named_parameters(recurse=False):
            want_mesh, want = _param_layout(sub, param.shape, mesh, placements, expert_mesh)
            name = f"{sub_name}.{pname}" if sub_name else pname
            if param.device_mesh != want_mesh or tuple(param.placements) != want:
                raise ValueError(f"parameter {name} is already distributed as {param.placements}; data_parallel "
                                 f"expects {want} (mode {mode!r}): build the model again for another layout")
    for sub in model.modules():
        _parametrize_module(sub, mp)
    _install_buckets(model, mp, bucket_mb, reshard_after_forward=reshard_after_forward)
    if expert_mesh is not None:
        model.expert_dispatch.dispatch = ExpertParallelDispatch(expert_mesh)
    return model


def cast_for_compute(model: nn.Module, mp: MixedPrecision | None) -> nn.Module:
    """One device: keep `model`'s stored parameters (fp32 master weights, which the optimizer
    updates and checkpoints save) and make reading `module.<param>` return it cast to
    `mp.param_dtype`, through the same parametrization as `data_parallel` without the collectives.
    So `model.dtype` means the compute dtype on one device as on many. In place; a model already
    stored in the compute dtype (or mp None) is returned unchanged: nothing to cast."""
    if mp is None or all(p.dtype == mp.param_dtype for p in model.parameters()):
        return model
    for sub in model.modules():
        _parametrize_module(sub, mp)
    return model


def _install_buckets(model: nn.Module, mp: MixedPrecision, bucket_mb: float, *, reshard_after_forward: bool) -> None:
    """Gather `model`'s parameters in buckets (parallel/buckets.py) and, with reshard_after_forward,
    drop the gathered block weights after each block's forward (parallel/reshard.py). Replaces
    what an earlier call installed."""
    if bucket_mb < 0:
        raise ValueError(f"parallelism.bucket_mb = {bucket_mb} must be >= 0 (0 turns bucketing off)")
    _uninstall_buckets(model)
    pieces = _reshard_pieces(model) if reshard_after_forward and bucket_mb > 0 else []
    # Nothing to re-shard (replicate, the HF backend's one piece): no saved-tensor hooks.
    hooks = ReshardHooks() if pieces else None
    stacks = [piece for piece in pieces if getattr(piece, STACKED_MARKER, False)]
    blocks = [piece for piece in pieces if not getattr(piece, STACKED_MARKER, False)]
    per_layer = _install_layer_gathers(stacks, mp=mp, hooks=hooks)
    buckets = build_buckets(model, mp=mp, bucket_mb=bucket_mb, skip=per_layer) if bucket_mb > 0 else []
    for bucket in buckets:
        for module, name in bucket.members:
            fsdp_state(module).buckets[name] = bucket
    handles = _install_block_gathers(blocks, buckets, mp=mp, bucket_mb=bucket_mb, hooks=hooks)
    if buckets or hooks is not None:
        handles += _install_gathering_window(model, buckets, hooks)
    root = fsdp_state(model)
    root.all_buckets, root.hook_handles = buckets, tuple(handles)


def _uninstall_buckets(model: nn.Module) -> None:
    """Remove what `_install_buckets` installed: its hooks, the bucket of every parameter and the
    blocks' per-layer gathers."""
    for handle in fsdp_state(model).hook_handles:
        handle.remove()
    for sub in model.modules():
        if _STATE in sub.__dict__:
            sub.__dict__[_STATE].buckets = {}
        sub.__dict__.pop(PER_LAYER_GATHER, None)


def _install_layer_gathers(stacks: list[nn.Module], *, mp: MixedPrecision, hooks: ReshardHooks | None) -> set[int]:
    """A scanned stack under re-sharding is gathered layer by layer inside the loop (LayerGather),
    never whole; returns the ids of its parameters, which are therefore not bucketed."""
    per_layer = set()
    for stack in stacks:
        stored = stored_weights(stack, stack.state_names)
        stack.__dict__[PER_LAYER_GATHER] = LayerGather(stored, mp=mp, hooks=hooks)
        per_layer.update(id(t) for t in stored)
    return per_layer


def _install_block_gathers(blocks: list[nn.Module], buckets: list[Bucket], *, mp: MixedPrecision, bucket_mb: float,
                           hooks: ReshardHooks | None) -> list:
    """Re-shard each block after its forward: its buckets register their gathers with `hooks`
    (autograd saves tokens, not the gathered weights) and are released when the block's forward
    ends. A checkpointed block is run as a function of its stored weights and gathers them inside
    the checkpointed region (BlockGather), so the recomputation in the backward gathers them
    again. Returns the hook handles."""
    handles = []
    for block in blocks:
        own = [b for b in buckets if b.owner is block]
        for bucket in own:
            bucket.reshard_hooks = hooks
        block.__dict__[PER_LAYER_GATHER] = BlockGather(mp=mp, bucket_mb=bucket_mb)

        def release(*_, own=own):
            for bucket in own:
                bucket.release()

        handles.append(block.register_forward_hook(release, always_call=True))
    return handles


def _install_gathering_window(model: nn.Module, buckets: list[Bucket], hooks: ReshardHooks | None) -> list:
    """The gathering window: the root's forward. Opening and closing both drop what was gathered,
    so nothing outlives one forward (autograd holds what the backward needs, or, re-sharded, tokens
    to gather it again). Returns the hook handles."""

    def window(value: bool):
        def hook(*_):
            for bucket in buckets:
                bucket.set_open(value)
            if hooks is not None:
                hooks.enter() if value else hooks.exit()
        return hook

    return [model.register_forward_pre_hook(window(True)),
            model.register_forward_hook(window(False), always_call=True)]


def _reshard_pieces(model: nn.Module) -> list[nn.Module]:
    """The pieces whose gathered weights are dropped after the forward: the transformer blocks
    (init_plan pieces named layers.*) but the last one, whose backward comes first (FSDP2 and
    TorchTitan keep it too), or the scanned stacks (gathered per layer). The embedding, final
    norm and output projection stay gathered: their backward follows the forward at once.
    Models without such pieces (the Hugging Face backend's one piece) keep every gather."""
    if not isinstance(model, TrainableModel):
        return []
    if not any(isinstance(p, DTensor) and any(isinstance(pl, Shard) and axis != TP_AXIS
                                              for pl, axis in zip(p.placements, p.device_mesh.mesh_dim_names or ()))
               for p in model.parameters()):
        return []  # replicate: nothing is gathered, nothing to re-shard
    named = [(name, piece) for name, piece, _ in model.init_plan()]
    stacked = [piece for name, piece in named  # `layers`, or its runs (`layers.run0`, ...) when the blocks differ
               if name.split(".")[0] == "layers" and getattr(piece, STACKED_MARKER, False)]
    if stacked:
        # A tensor-parallel stack is read whole (its data-parallel axes gathered before the loop,
        # its tp shard kept, `_replicate_for_compute`): the per-layer gather (LayerGather) gathers
        # flat buffers over the whole mesh and has no tp shard to keep, like the buckets.
        return [] if _has_tp(next(stacked[0].parameters()).device_mesh) else stacked
    return [piece for name, piece in named if name.startswith("layers.")][:-1]


class BlockGather:
    """The compute tensors of one block's stored weights, gathered in the block's buckets (one
    all-gather per bucket, buckets.group_into_buckets as for build_buckets: by mesh and placements,
    at most bucket_mb MB each); expert weights under expert parallelism and plain tensors as they are
    read elsewhere. Used inside activation-checkpointed blocks (models/common/transformer.py)."""

    def __init__(self, *, mp: MixedPrecision, bucket_mb: float):
        self.mp = mp
        self.bucket_mb = bucket_mb

    def local(self, stored: list) -> list:
        return list(stored)

    def gather(self, stored: list) -> list[torch.Tensor]:
        out: list = list(stored)
        for i, t in enumerate(stored):
            if isinstance(t, DTensor) and not bucketable(t):
                out[i] = _replicate_for_compute(t, self.mp)
        bucketed = [(i, t) for i, t in enumerate(stored) if bucketable(t)]
        for run in group_into_buckets(bucketed, mp=self.mp, bucket_mb=self.bucket_mb):
            for i, full in zip(run, gather_flat([stored[i] for i in run], self.mp)):
                out[i] = full
        return out


# ---------------------------------------------------------------------------------------------
# Meta model -> initialised, sharded model
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def materialize_and_init(
    model: nn.Module, mesh: DeviceMesh | None, *, mode: str, mp: MixedPrecision | None, device: torch.device, seed: int,
    expert_mesh: DeviceMesh | None = None, bucket_mb: float = DEFAULT_BUCKET_MB, reshard_after_forward: bool = True,
) -> nn.Module:
    """Initialise a meta-device Transformer on `device`, sharded on `mesh` (plain when None, then
    computed in `mp.param_dtype` through `cast_for_compute`).

    Walks `model.init_plan()`: each piece (embedding, one block, final norm, output) is
    materialised at full size, initialised, and immediately sharded, so a rank never holds more
    than one piece at full size. Every rank seeds the global RNG identically and draws the full
    pieces in the single-process order, so the weights are bitwise those of
    `build_model(args, seed=seed)` whatever the number of ranks, with no communication.
    """
    device = torch.device(device)
    if mesh is None:
        if mode not in ("none", *MODES):
            raise ValueError(f"data parallel mode must be one of none, {', '.join(MODES)}, got {mode!r}")
        model.to_empty(device=device)
        torch.manual_seed(seed)
        model.init_weights()
        return cast_for_compute(model, mp)
    placements = _placements(mode, mesh)
    torch.manual_seed(seed)
    for _, piece, init in model.init_plan():
        piece.to_empty(device=device)
        init()
        _distribute_params(piece, mesh, placements, src_data_rank=None, expert_mesh=expert_mesh)
    model.init_buffers(device)  # RoPE table: cheap, recomputed whole on every rank
    leftover = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not leftover, f"init_plan missed parameters: {leftover}"
    return data_parallel(model, mesh, mode=mode, mp=mp, expert_mesh=expert_mesh, bucket_mb=bucket_mb,
                         reshard_after_forward=reshard_after_forward)


def local_bytes(tensors) -> int:
    """Bytes this rank stores for these (possibly DTensor) tensors: their local shards."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
