"""Run a captured step's FX graph as a JAX function: the program XLA compiles is the step we capture.

Two stages:

1. `functional_graph(gm, example_inputs)` traces the captured graph once more, functionalised
   (in-place ops such as ``add_`` and ``_foreach_mul_`` become their out-of-place forms, views
   become copies) and decomposed to core ATen, so the lowering below only ever sees pure ops on
   values, which is what a JAX array is. The collectives of SimpleFSDP and tp/cp/ep are already
   functional (``_c10d_functional``) and pass through unchanged.
2. `to_jax(gm, group_axes)` returns a function of JAX arrays that walks the graph in order and
   evaluates each node with the JAX form of its op (the table `LOWERINGS`, graph/jax_ops.py). It computes the values
   of *one device*; `shard_step` wraps it in `shard_map` over a mesh whose axes carry our mesh
   names, where each collective becomes the `jax.lax` collective over the axes of its process
   group (all_gather_into_tensor -> all_gather, reduce_scatter_tensor -> psum_scatter,
   all_reduce -> psum/pmax/pmin, all_to_all_single -> all_to_all; wait_tensor is the identity).
   Three ops of ours are collectives too: TorchTPU's ragged all-to-all, captured as its stand-in
   (kernels/jax_traced.py), -> ragged_all_to_all, ``titan_tpu::group_rank`` (a rank the step
   reads as a value, parallel/group_rank.py) -> axis_index over the group's axes, so a rank-dependent
   number of cp or ep is one program's value on every device, not a constant per rank; and
   ``titan_tpu::pp_permute`` (pipeline stages handing activations on, parallel/pipeline.py) ->
   ppermute, XLA's collective-permute over the pp axis.

Every node's result is cast to the dtype the trace recorded for it, and its shape checked against
the recorded one: torch and JAX promote mixed dtypes differently (a 0-dim float64 tensor times a
float32 tensor stays float32 in torch), and the trace is the reference for both.

Our own lowering instead of torchax's table: the captured steps of our models use about 80 core
ATen ops (listed in LOWERINGS), and torchax 0.0.13 does not import under torch 2.13. An op missing
here is one line naming it (`JaxLoweringError`).

Imports jax: used only by `titan-tpu compile` and tests/tpu/ (.venv-tpu).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import torch
import torch.fx
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from titan_tpu.graph.jax_ops import LOWERINGS, JaxLoweringError, jax_dtype
from titan_tpu.graph.passes import REMAT_REGION
from titan_tpu.graph.reverse_scan import marked_reverse

__all__ = ["LOWERINGS", "JaxLoweringError", "functional_graph", "global_shape", "jax_dtype", "rank_constants",
           "scans_unrolled", "shard_step", "to_jax"]

aten = torch.ops.aten
funcol = torch.ops._c10d_functional


def functional_graph(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """`gm` traced again without mutations or views, decomposed to core ATen (see the module docstring).
    example_inputs: the captured step's fake inputs (CapturedStep.example_inputs). Run node by node
    (fx.Interpreter) with node meta preserved, so each new node keeps the meta of the node it
    came from: its module (``nn_module_stack``, graph/capture_errors.py) for error messages."""
    import torch.fx.traceback as fx_traceback

    pure = torch.func.functionalize(lambda *inputs: torch.fx.Interpreter(gm).run(*inputs),
                                    remove="mutations_and_views")
    with fx_traceback.preserve_node_meta():
        return make_fx(pure, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*example_inputs)


# -- collectives ----------------------------------------------------------------------------------

def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
    """jax.lax.ragged_all_to_all's contract from all-gathers, for XLA:CPU, which has no
    ragged-all-to-all (jax 0.10.2: UNIMPLEMENTED): sender s's rows operand_s[input_offsets_s[r] :
    + send_sizes_s[r]] land in receiver r's output at output_offsets_s[r]; the rest of the output is
    kept. Same values as the TPU's collective; only the parity tests run it (every row travels)."""
    me = jax.lax.axis_index(axes)
    operands = jax.lax.all_gather(operand, axes)  # [senders, N, ...]
    starts, sizes, offsets = (jax.lax.all_gather(a, axes)[:, me] for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    for sender in range(operands.shape[0]):
        i = rows - offsets[sender]
        mine = ((i >= 0) & (i < sizes[sender])).reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(mine, operands[sender][jnp.clip(starts[sender] + i, 0, operand.shape[0] - 1)], output)
    return output


def _collective_lowerings(group_axes: dict[str, tuple[str, ...]], on_cpu: bool = False) -> dict[object, Callable]:
    """The `_c10d_functional` ops, and ours that are collectives (the module docstring), as jax.lax
    collectives over the mesh axes of each process group. on_cpu: the program runs on XLA:CPU
    (`_ragged_all_to_all_emulated`)."""
    import titan_tpu.parallel.group_rank  # noqa: F401 - registers titan_tpu::group_rank
    import titan_tpu.parallel.pipeline  # noqa: F401 - registers titan_tpu::pp_permute
    from titan_tpu.kernels.jax_traced import RAGGED_ALL_TO_ALL

    def axes(group_name: str):
        if group_name not in group_axes:
            raise JaxLoweringError(f"a collective runs on process group {group_name!r}, which is no axis of the mesh "
                                   f"(known groups: {', '.join(sorted(group_axes)) or 'none'})")
        names = group_axes[group_name]
        return names[0] if len(names) == 1 else names

    def reduce(x, op, group_name):
        op = op.lower()
        if op in ("sum", "avg"):
            total = jax.lax.psum(x, axes(group_name))
            return total / jax.lax.psum(1, axes(group_name)) if op == "avg" else total
        if op == "max":
            return jax.lax.pmax(x, axes(group_name))
        if op == "min":
            return jax.lax.pmin(x, axes(group_name))
        raise JaxLoweringError(f"_c10d_functional reduce op {op!r} has no JAX lowering")

    def reduce_scatter(x, op, group_size, group_name):
        if op.lower() not in ("sum", "avg"):
            raise JaxLoweringError(f"_c10d_functional.reduce_scatter_tensor with {op!r} has no JAX lowering")
        out = jax.lax.psum_scatter(x, axes(group_name), scatter_dimension=0, tiled=True)
        return out / group_size if op.lower() == "avg" else out

    def all_to_all(x, output_split_sizes, input_split_sizes, group_name):
        for sizes in (output_split_sizes, input_split_sizes):
            if sizes is not None and len(set(sizes)) > 1:
                raise JaxLoweringError("_c10d_functional.all_to_all_single with uneven splits has no JAX lowering")
        return jax.lax.all_to_all(x, axes(group_name), split_axis=0, concat_axis=0, tiled=True)

    def pp_permute(x, shift, group_size, group_name):
        # XLA's collective-permute: rank i of the group's axis sends to rank (i + shift) % size.
        pairs = [(i, (i + shift) % group_size) for i in range(group_size)]
        return jax.lax.ppermute(x, axes(group_name), perm=pairs)

    def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
        sizes = [a.astype(jnp.int32) for a in (input_offsets, send_sizes, output_offsets, recv_sizes)]
        if on_cpu:
            return _ragged_all_to_all_emulated(operand, output, *sizes, axes(group_name))
        return jax.lax.ragged_all_to_all(operand, output, *sizes, axis_name=axes(group_name))

    return {
        RAGGED_ALL_TO_ALL.default: ragged_all_to_all,
        torch.ops.titan_tpu.group_rank.default: lambda group_name: jax.lax.axis_index(axes(group_name)),
        torch.ops.titan_tpu.pp_permute.default: pp_permute,
        funcol.all_gather_into_tensor.default:
            lambda x, group_size, group_name: jax.lax.all_gather(x, axes(group_name), axis=0, tiled=True),
        funcol.reduce_scatter_tensor.default: reduce_scatter,
        funcol.all_reduce.default: reduce,
        funcol.all_to_all_single.default: all_to_all,
        funcol.wait_tensor.default: lambda x: x,
    }


# -- the interpreter ------------------------------------------------------------------------------

def _where(node: torch.fx.Node) -> str:
    """Where a node came from, for error messages: the innermost module whose forward made it
    (or whose forward's backward did), as the capture recorded it (graph/capture_errors.py)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        name, cls = list(stack.values())[-1]
        what = "the backward of " if node.meta.get("custom", {}).get("phase") == "backward" else ""
        return f"{what}module {name or 'the model'} ({getattr(cls, '__name__', cls)}), graph node {node.name}"
    return f"graph node {node.name}, outside any module's forward"


def _scope(node: torch.fx.Node) -> str:
    """The name scope of a node's JAX ops: the module whose forward made it, "bwd " before it for
    its backward, "step" outside any module (the loss reduction, clipping, AdamW)."""
    stack = node.meta.get("nn_module_stack")
    name = (list(stack.values())[-1][0] or "model") if stack else "step"
    return f"bwd {name}" if node.meta.get("custom", {}).get("phase") == "backward" else name


def _table(group_axes: dict[str, tuple[str, ...]] | None, on_cpu: bool = False) -> dict[object, Callable]:
    """Every op's JAX form: the ATen table, the collectives over the mesh axes of their groups, and
    the TPU kernels a step captured for JAX holds as ops (kernels/jax_traced.py: each the JAX
    function TorchTPU's jax_op would be handed, its Pallas kernel a Mosaic custom call on TPU)."""
    from titan_tpu.kernels.jax_traced import LOWERED

    return {**LOWERINGS, **_collective_lowerings(group_axes or {}, on_cpu), **LOWERED}


def check_lowerable(gm: torch.fx.GraphModule, group_axes: dict[str, tuple[str, ...]] | None = None) -> None:
    """Raise JaxLoweringError for the first op of `gm` with no JAX lowering (before any tracing)."""
    table = _table(group_axes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _SCAN:
            check_lowerable(_subgraph(gm, node.args[0]), group_axes)  # the body: the same table
        elif node.op == "call_function" and node.target not in table:
            raise JaxLoweringError(f"operator {node.target} (from {_where(node)}) has no JAX lowering, so neither "
                                   "compile.backend jax nor titan-tpu compile can run this step; torch runs it: "
                                   "--compile.backend inductor (CPU, GPU), tpu (TorchTPU) or --training.mode eager; "
                                   "or add it to LOWERINGS in titan_tpu/graph/jax_ops.py")


def rank_constants(graphs: list[torch.fx.GraphModule]) -> dict[str, dict[int, list]]:
    """The constants that differ between the ranks' graphs (graphs[r]: global rank r's
    `functional_graph`): node name -> {index of the number among the node's flattened arguments:
    its value on each rank}. tp's vocabulary offset and ep's first local expert are such numbers;
    `to_jax` reads them per device. Graphs that differ otherwise (an op, or a shape: cp's head-tail
    chunks attend to rank-dependent key lengths) have no single SPMD program: JaxLoweringError."""
    from torch.utils._pytree import tree_flatten

    out: dict[str, dict[int, list]] = {}
    node_lists = [list(g.graph.nodes) for g in graphs]
    if len({len(nodes) for nodes in node_lists}) > 1:
        raise JaxLoweringError("the ranks' captured steps have different numbers of operations: no single SPMD "
                               "program runs them all")
    for nodes in zip(*node_lists):
        first = nodes[0]
        vals = [n.meta.get("val") for n in nodes]
        shapes = {tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals}
        if len({n.target for n in nodes}) > 1 or len(shapes) > 1:
            raise JaxLoweringError(f"operation {first.target} (from {_where(first)}) has a different shape or op on "
                                   "different ranks: no single SPMD program runs them all")
        leaves = [tree_flatten((n.args, n.kwargs))[0] for n in nodes]
        for i, values in enumerate(zip(*leaves)):
            # A process group's name differs between ranks that sit on different groups of the same
            # axes (dp_shard x tp: rank 0's dp_shard group is not rank 1's); its axes are group_axes'.
            if isinstance(values[0], (torch.fx.Node, str)):
                continue
            if any(v != values[0] for v in values):
                out.setdefault(first.name, {})[i] = list(values)
    return out


def to_jax(gm: torch.fx.GraphModule, group_axes: dict[str, tuple[str, ...]] | None = None,
           per_rank: dict[str, dict[int, list]] | None = None, axis_sizes: dict[str, int] | None = None, *,
           on_cpu: bool = False) -> Callable:
    """A function of JAX arrays (the graph's flat inputs, one device's values) returning the list of
    its flat outputs. gm: a `functional_graph`. group_axes: process group name -> the mesh axis
    names it spans (empty for a one-device step); the function must then run inside shard_map.
    per_rank (`rank_constants`) with the mesh's axis_sizes: numbers read per device, by its rank
    (row-major over the mesh axes); without it every device uses gm's own (rank 0's) numbers.
    on_cpu: the function will run on XLA:CPU (the parity tests), whose missing ragged-all-to-all is
    emulated (`_ragged_all_to_all_emulated`); False for a TPU program."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    check_lowerable(gm, group_axes)
    table = _table(group_axes, on_cpu)
    nodes = list(gm.graph.nodes)
    per_rank = per_rank or {}

    def device_rank():
        rank = 0
        for name, size in (axis_sizes or {}).items():
            rank = rank * size + jax.lax.axis_index(name)
        return rank

    def run(*inputs):
        env: dict[torch.fx.Node, object] = {}
        placeholders = iter(inputs)
        barriers = _RematBarriers(nodes, env)
        rank = device_rank() if per_rank else None
        for node in nodes:
            # A recomputed node reads its block's inputs through the block's barrier (`_RematBarriers`).
            read = barriers.reader(node)
            load = lambda a, read=read: torch.fx.node.map_arg(a, read)  # noqa: E731
            if node.op == "placeholder":
                env[node] = jnp.asarray(next(placeholders))
            elif node.op == "call_function" and node.target is _SCAN:
                env[node] = _as_traced(_scan(gm, node, load, group_axes, on_cpu), node.meta.get("val"), node)
            elif node.op == "call_function":
                if node.name in per_rank:  # the node's arguments with its rank-dependent numbers read per device
                    leaves, spec = tree_flatten((node.args, node.kwargs))
                    leaves = [read(a) if isinstance(a, torch.fx.Node) else a for a in leaves]
                    for i, values in per_rank[node.name].items():
                        leaves[i] = jnp.asarray(values)[rank]
                    args, kwargs = tree_unflatten(leaves, spec)
                else:
                    args, kwargs = load(node.args), load(node.kwargs)
                kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory",
                                                                       "memory_format", "non_blocking")}
                try:
                    with jax.named_scope(_scope(node)):  # XLA's op names then say which module (xla/dump.py)
                        value = table[node.target](*args, **kwargs)
                except JaxLoweringError:
                    raise
                except Exception as e:
                    raise JaxLoweringError(f"lowering {node.target} (from {_where(node)}) failed: "
                                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
                env[node] = _as_traced(value, node.meta.get("val"), node)
                barriers.computed(node)
            elif node.op == "output":
                return list(load(node.args[0]))
            elif node.op == "get_attr" and all(u.target is _SCAN for u in node.users):
                continue  # a scan's body, read by the scan's lowering
            else:
                raise JaxLoweringError(f"graph node {node.name} of kind {node.op} has no JAX lowering")
        raise AssertionError("graph without an output node")

    return run


_SCAN = torch.ops.higher_order.scan
# How many of a scan's steps one trip of XLA's loop runs (jax.lax.scan's unroll): 1, the program that
# trains and that a compile certifies; 2 only for XLA's time estimate (`scans_unrolled`).
_SCAN_UNROLL = contextvars.ContextVar("scan_unroll", default=1)


@contextlib.contextmanager
def scans_unrolled(steps: int) -> Iterator[None]:
    """Lower every scan with `steps` of its steps per loop trip (the rest after the loop): another
    program than the one that trains, whose only use is XLA's time estimate, which counts a loop's
    body once (xla/numbers.py `loop_seconds`: the body's time is the difference between the two)."""
    token = _SCAN_UNROLL.set(steps)
    try:
        yield
    finally:
        _SCAN_UNROLL.reset(token)


class _RematBarriers:
    """Activation checkpointing that XLA keeps. A checkpointed block's backward recomputes its
    forward ops (graph/passes.py `rematerialize`): copies of the forward's ops on the same inputs.
    Left as they are, XLA merges them back into the forward's (common-subexpression elimination)
    or runs them in the forward, either way keeping every intermediate alive until the backward:
    checkpointing undone (a scanned stack is safe, its body being a loop's). So, as
    `jax.checkpoint` does (its prevent_cse), the copies of one block call read the values they
    take from outside it through one optimization barrier, which XLA neither looks through nor
    merges. The barrier also takes the gradient that the copies' first backward use reads beside
    them, and every backward value computed since the block before's barrier (its weight
    gradients' sums among them): the recomputation then cannot start before the backward reaches
    the block, nor before the block after it is done. Without the first, XLA runs it in the
    forward; without the second, it recomputes many blocks ahead and holds their intermediates for
    weight-gradient sums it runs late."""

    def __init__(self, nodes: list[torch.fx.Node], env: dict):
        self.env = env
        self.outside: dict[object, list[torch.fx.Node]] = {}  # region -> the nodes its copies read from outside it
        self.gradients: dict[object, list[torch.fx.Node]] = {}  # region -> what its first backward use reads besides
        for node in nodes:
            region = _region(node)
            if region is not None:
                reads = self.outside.setdefault(region, [])
                reads.extend(n for n in node.all_input_nodes if _region(n) != region and n not in reads)
            elif _backward(node):
                for read in {_region(n) for n in node.all_input_nodes} - {None}:
                    self.gradients.setdefault(read, [n for n in node.all_input_nodes
                                                     if _region(n) is None and _backward(n)])
        self.barred: dict[object, dict[torch.fx.Node, object]] = {}
        self.since: list[torch.fx.Node] = []  # backward values computed since the last block's barrier

    def computed(self, node: torch.fx.Node) -> None:
        if _region(node) is None and _backward(node) and isinstance(self.env.get(node), jax.Array):
            self.since.append(node)

    def reader(self, node: torch.fx.Node) -> Callable[[torch.fx.Node], object]:
        region = _region(node)
        if region is None:
            return self.env.__getitem__
        if region not in self.barred:
            gradients = [n for n in self.gradients.get(region, []) if n in self.env]
            gradients += [n for n in self.since if n not in gradients]
            self.since = []
            self.barred[region] = self._barrier(self.outside[region], gradients)

        def read(source: torch.fx.Node):
            barred = self.barred[region]
            if source not in barred and _region(source) != region and isinstance(self.env[source], jax.Array):
                barred.update(self._barrier([source], []))  # computed after the region's first copy: its own barrier
            return barred.get(source, self.env[source])

        return read

    def _barrier(self, sources: list[torch.fx.Node], gradients: list[torch.fx.Node]) -> dict[torch.fx.Node, object]:
        sources = [n for n in sources if isinstance(self.env.get(n), jax.Array)]
        gradients = [n for n in gradients if isinstance(self.env.get(n), jax.Array)]
        values = jax.lax.optimization_barrier([self.env[n] for n in sources + gradients])
        for n, value in zip(gradients, values[len(sources):]):
            self.env[n] = value  # later readers take the barrier's copy, so XLA keeps the tie
        return dict(zip(sources, values))


def _backward(node: torch.fx.Node) -> bool:
    return node.meta.get("custom", {}).get("phase") == "backward"


def _region(node: torch.fx.Node):
    return node.meta.get("custom", {}).get(REMAT_REGION)


def _subgraph(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """The GraphModule a `get_attr` node of `gm` names (a scan's body)."""
    assert node.op == "get_attr", node
    return getattr(gm, node.target)


def _scan(gm: torch.fx.GraphModule, node: torch.fx.Node, load: Callable, group_axes, on_cpu: bool) -> list:
    """torch's scan op (scanned layers, their backward) as `jax.lax.scan`: XLA's while loop over the
    leading dim of the stacked inputs, the body (one layer) lowered once, by this same table.

    The op's arguments: (body, init, xs, additional_inputs); the body takes (*carry, one slice of
    each xs, *additional_inputs) and returns (*next carry, one slice of each stacked output); the op
    returns (*last carry, *stacked outputs), which is what lax.scan returns (a reversed scan reaches
    here as flips of xs and of the outputs, lowered as flips)."""
    body_gm, init, xs, additional = node.args[0], *load(node.args[1:4])
    assert not node.kwargs, node.kwargs
    body = to_jax(_subgraph(gm, body_gm), group_axes, on_cpu=on_cpu)
    n_carry = len(init)

    def step(carry, layer_xs):
        out = body(*carry, *layer_xs, *additional)
        return list(out[:n_carry]), list(out[n_carry:])

    # A scan marked to run in reverse (graph/reverse_scan.py mark_reverse_scans: its flips taken
    # away) is XLA's loop reading and writing row L-1-i at step i, as TorchTPU builds it.
    reverse = marked_reverse(_subgraph(gm, body_gm))
    carry, ys = jax.lax.scan(step, [jnp.asarray(c) for c in init], [jnp.asarray(x) for x in xs], reverse=reverse,
                             unroll=_SCAN_UNROLL.get())
    return [*carry, *ys]


def _as_traced(value, val, node):
    """`value` cast to the dtype the trace recorded (`val`, a fake tensor or a list of them); its shape
    checked against the recorded one (an invariant: a wrong lowering, not a user error)."""
    if isinstance(val, torch.Tensor):
        value = jnp.asarray(value)
        assert tuple(value.shape) == tuple(val.shape), (str(node.target), node.name, value.shape, tuple(val.shape))
        dtype = jax_dtype(val.dtype)
        return value if value.dtype == dtype else value.astype(dtype)
    if isinstance(val, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(value)(_as_traced(v, m, node) for v, m in zip(value, val))
    return value


def shard_step(fn: Callable, mesh: jax.sharding.Mesh, input_ndims: Sequence[int],
               output_ndims: Sequence[int]) -> Callable:
    """`fn` (one device's step, from `to_jax`) over every device of `mesh`, with shard_map.

    Every input and output is given as its per-device values laid end to end (`global_shape`):
    a value of one or more dimensions concatenated along its first, device (i, j, ...) holding the
    row-major (i, j, ...)th block; a scalar stacked, [*mesh.devices.shape]. Uniform for sharded
    parameters, replicated values and per-rank batches alike, exactly the per-device bytes the
    trainer holds (what memory_analysis then reports per chip), and each device's block is its
    tensor with no extra axes: a stacked form ([1, 1, *local]) leaves size-1 axes that XLA's
    layouts can pad (a gathered bf16 [1, vocab, dim] took twice its bytes)."""
    from jax.sharding import PartitionSpec

    axes = tuple(mesh.axis_names)

    def spec(ndim: int) -> PartitionSpec:
        return PartitionSpec(axes) if ndim else PartitionSpec(*axes)

    def local(*inputs):
        outputs = fn(*(x if ndim else x.reshape(()) for x, ndim in zip(inputs, input_ndims)))
        return [y if ndim else jnp.reshape(y, (1,) * len(axes)) for y, ndim in zip(outputs, output_ndims)]

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec(n) for n in input_ndims),
                         out_specs=[spec(n) for n in output_ndims], check_vma=False)


def global_shape(mesh: jax.sharding.Mesh, local_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape `shard_step` takes a value of `local_shape` on every device in."""
    if not local_shape:
        return tuple(mesh.devices.shape)
    return (mesh.devices.size * local_shape[0], *local_shape[1:])
