"""The TPU kernels inside a step captured on CPU and lowered to JAX (`titan-tpu compile`).

On a TPU the kernel variants of kernels/tpu.py hand JAX functions (kernels/tpu_jax.py: splash
attention, megablox's grouped matmul, tokamax's linear cross-entropy) to TorchTPU's
`torch.tpu.pallas.jax_op`. A step captured on this CPU for the JAX lowering cannot call TorchTPU,
so `traceable_jax_op` stands in for jax_op there: it makes a torch custom op (namespace
``titan_tpu_jax``) with the same calling convention, whose fake kernel gives the result's shapes
from `jax.eval_shape` of the JAX function, so make_fx records it as one node; and it remembers
the JAX function, which graph/jax_lowering.py calls in place of the node. The Pallas kernels then
enter the lowered program as what they are on a TPU: Mosaic custom calls (`tpu_custom_call`),
compiled by XLA's TPU compiler for the slice's topology without a TPU.

`traced_for_jax()` is the switch: while it is active the kernel registry answers for the device
type "jax" where model code asks for "cpu" (kernels/__init__.py), and the jax_op variants run
through `traceable_jax_op`. The ops have no CPU kernel: they are traced, never run by torch.

TorchTPU's ragged all-to-all (expert parallelism's TPU dispatch, parallel/expert_parallel.py) has
its stand-in too: ``titan_tpu_jax::ragged_all_to_all``, a collective, which graph/jax_lowering.py
lowers to `jax.lax.ragged_all_to_all` over the mesh axes of its process group. While
`traced_for_jax()` is active the parallel plans also read their rank as a value of the program
(parallel/group_rank.py, tracing.py `one_program_for_every_rank`): one program runs on every device.

Imports jax: only the TPU environment (.venv-tpu) imports this module.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import jax
import torch

__all__ = ["LOWERED", "RAGGED_ALL_TO_ALL", "traceable_jax_op", "traced_for_jax"]

NAMESPACE = "titan_tpu_jax"

# torch op (OpOverload) -> the JAX function it stands for; read by graph/jax_lowering.py.
LOWERED: dict[object, Callable] = {}

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


# torch.tpu.ops.ragged_all_to_all's call, traceable: the result has the output buffer's shape.
_LIBRARY.define("ragged_all_to_all(Tensor operand, Tensor output, Tensor input_offsets, Tensor send_sizes, "
                "Tensor output_offsets, Tensor recv_sizes, str group_name) -> Tensor")
torch.library.register_fake(f"{NAMESPACE}::ragged_all_to_all", lambda operand, output, *_: torch.empty_like(output),
                            lib=_LIBRARY)
RAGGED_ALL_TO_ALL = getattr(torch.ops, NAMESPACE).ragged_all_to_all


def _is_array(annotation) -> bool:
    return annotation is jax.Array or annotation == "jax.Array"


def _schema(fn: Callable) -> tuple[str, list[bool]]:
    """fn's torch schema (arguments and results, without the name) as jax_op derives it: `jax.Array`
    parameters are tensors, int and str static arguments; the result a tensor or a tuple of them."""
    signature = inspect.signature(inspect.unwrap(fn), eval_str=True)
    arguments, is_array = [], []
    for name, parameter in signature.parameters.items():
        kind = parameter.annotation
        if _is_array(kind):
            arguments.append(f"Tensor {name}")
        elif kind in (int, str, float, bool):
            arguments.append(f"{kind.__name__} {name}")
        else:
            raise TypeError(f"{fn.__qualname__}: parameter {name} is annotated {kind!r}; jax_op takes jax.Array, "
                            "int, float, bool or str")
        is_array.append(_is_array(kind))
    result = signature.return_annotation
    count = len(result.__args__) if getattr(result, "__origin__", None) is tuple else 1
    returns = "Tensor" if count == 1 else "(" + ", ".join(["Tensor"] * count) + ")"
    return f"({', '.join(arguments)}) -> {returns}", is_array


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "int32": torch.int32, "int64": torch.int64, "bool": torch.bool, "float64": torch.float64}


def traceable_jax_op(name: str, fn: Callable) -> Callable:
    """Same call as torch.tpu.pallas.jax_op(name, fn): the torch op ``titan_tpu_jax::<op name>``,
    traceable on fake tensors, lowered by graph/jax_lowering.py to `fn`."""
    op_name = name.split("::", 1)[1]
    schema, is_array = _schema(fn)
    if not hasattr(getattr(torch.ops, NAMESPACE), op_name):
        _LIBRARY.define(op_name + schema)

        def fake(*args):
            like = next(a for a in args if isinstance(a, torch.Tensor))
            specs = [jax.ShapeDtypeStruct(tuple(a.shape), _jax_dtype(a.dtype)) if array else a
                     for a, array in zip(args, is_array)]
            static = {i for i, array in enumerate(is_array) if not array}
            shapes = jax.eval_shape(lambda *arrays: fn(*_merge(arrays, specs, static)),
                                    *(s for i, s in enumerate(specs) if i not in static))
            leaves = shapes if isinstance(shapes, (tuple, list)) else (shapes,)
            out = tuple(like.new_empty(tuple(s.shape), dtype=_TORCH_DTYPES[str(s.dtype)]) for s in leaves)
            return out if isinstance(shapes, (tuple, list)) else out[0]

        torch.library.register_fake(f"{NAMESPACE}::{op_name}", fake, lib=_LIBRARY)
    op = getattr(getattr(torch.ops, NAMESPACE), op_name)
    LOWERED[op.default] = fn
    return op


def _merge(arrays, specs, static):
    arrays = iter(arrays)
    return [specs[i] if i in static else next(arrays) for i in range(len(specs))]


def _jax_dtype(dtype: torch.dtype):
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise TypeError(f"a JAX kernel's input of dtype {dtype}; the kernels take float32, bfloat16 and int32")
    return jax.numpy.dtype(name)


@contextlib.contextmanager
def traced_for_jax() -> Iterator[None]:
    """Capture a step for the JAX lowering: the kernel registry picks for the device type "jax"
    (the TPU's JAX kernels where they have one) and the jax_op variants become traceable ops."""
    from titan_tpu import kernels
    from titan_tpu.kernels import tpu
    from titan_tpu.tracing import one_program_for_every_rank

    previous, tpu.TOKAMAX_IMPLEMENTATION = tpu.TOKAMAX_IMPLEMENTATION, "xla"  # kernels/__init__.py NOT_AS_ON_TPU
    try:
        with (kernels.device_type_as("cpu", "jax"), one_program_for_every_rank(),
              tpu.jax_op_replaced(traceable_jax_op, ragged_all_to_all=RAGGED_ALL_TO_ALL)):
            yield
    finally:
        tpu.TOKAMAX_IMPLEMENTATION = previous
